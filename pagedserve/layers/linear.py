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

from pagedserve.layers import cpu_kernels

# Batch size oneDNN's weight layout is tuned for: a typical decode batch.
_PACKING_BATCH_HINT = 32


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# Rows up to which the GGUF-block kernel beats oneDNN on float32 weights: decode batches are bound by
# reading the weights, bigger steps by arithmetic, where oneDNN's GEMM is faster than ours. Bare
# forward on this machine, tokens/s blocks vs float32, alternating runs: batch 1 38 vs 13, 16 175-214
# vs 124, 32 217-228 vs 217-228, 48 212-241 vs 265-287; 512-token prefill 317 vs 442.
QUANTIZED_MAX_ROWS = 32
# The 49152-wide lm_head crosses over earlier (one call, caches cold, ms blocks vs float32: 1 row
# 2.3 vs 9.0, 8 rows 7.4 vs 10.1, 16 13.3 vs 13.8, 24 18.1 vs 18.0, 32 23.4 vs 21.0).
LM_HEAD_QUANTIZED_MAX_ROWS = 16


class QuantizedWeight:
    """A weight in GGUF blocks ([out_features, bytes per row] uint8), its gguf type id, and the most
    rows it runs (larger inputs take the float32 weight)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, max_rows: int = QUANTIZED_MAX_ROWS) -> None:
        self.blocks = blocks.contiguous()
        self.qtype = qtype
        self.max_rows = max_rows
        self._kernel = cpu_kernels.load().quantized_linear  # looked up once, not per call

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x.contiguous(), self.blocks, self.qtype, bias)

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows


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
