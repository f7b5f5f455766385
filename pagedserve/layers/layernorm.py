"""RMSNorm, computed in float32 like the reference implementation; fused C++ kernel on CPU float32."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.cpu_kernels import UsesCPUKernels


class RMSNorm(nn.Module, UsesCPUKernels):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: add it first and also return the sum (the next residual)."""
        kernels = self.kernels_for(x)
        if kernels is not None and self.weight.dtype == x.dtype:
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.variance_epsilon)
            return kernels.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is not None:
            x = x + residual
            residual = x
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        out = self.weight * hidden.to(input_dtype)
        return out if residual is None else (out, residual)
