"""Linear layers: float32 weights pre-packed for oneDNN on CPU, or GGUF blocks read by our kernel.

MKL's fp32 GEMM is slow for the small-M shapes of decode steps on this class of CPU; oneDNN with a
weight reordered once at load time is faster for M >= 8 and for the wide lm_head. A GGUF model's
Q4_0/Q4_1/Q8_0 weights run on their blocks (csrc/quantized_linear.cpp): the same values, a fraction
of the bytes to read per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Batch size oneDNN's weight layout is tuned for: a typical decode batch.
_PACKING_BATCH_HINT = 32


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# Rows up to which the GGUF-block kernel beats oneDNN on float32 weights (measured, docs/cpu.md). Small
# steps are bound by reading the weights (7x the bytes in float32); from 3 rows on the kernel runs a
# broadcast GEMM on an interleaved copy of the blocks, level with or ahead of oneDNN up to 64 rows.
QUANTIZED_MAX_ROWS = 64


class QuantizedWeight:
    """A weight in GGUF blocks ([out_features, bytes per row] uint8) and its gguf type id; it runs
    steps of up to QUANTIZED_MAX_ROWS rows (larger ones take the float32 weight). Steps of 3+ rows
    read an interleaved copy of the blocks (8 rows side by side, made here once) that the kernel's
    broadcast GEMM needs."""

    def __init__(self, blocks: torch.Tensor, qtype: int, kernels) -> None:
        self.blocks = blocks.contiguous()
        self.qtype = qtype
        self.interleaved = kernels.interleave_gguf_rows(self.blocks, qtype) if blocks.shape[0] % 8 == 0 else None
        self._kernel = kernels.quantized_linear  # looked up once, not per call

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x.contiguous(), self.blocks, self.qtype, bias, self.interleaved)

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= QUANTIZED_MAX_ROWS


class Linear(nn.Linear):
    """nn.Linear that runs small batches on GGUF blocks once given them, and the rest on a oneDNN-packed
    copy of its float32 weight once pack() was called."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None

    def pack(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and self.quantized.takes(x):
            return self.quantized.linear(x, self.bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)
