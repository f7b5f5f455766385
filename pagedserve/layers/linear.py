"""Linear layers, with weights pre-packed for oneDNN on CPU.

MKL's fp32 GEMM is slow for the small-M shapes of decode steps on this class of CPU; oneDNN with a
weight reordered once at load time is faster for M >= 8 and for the wide lm_head.
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


class Linear(nn.Linear):
    """nn.Linear that runs on a oneDNN-packed copy of its weight once pack() was called."""

    packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)
