"""RMSNorm, computed in float32 like the reference implementation; fused C++ kernel on CPU float32 (its input may come
bfloat16 beside a float32 residual, its output go bfloat16 to a GEMM that multiplies it)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed.parallel_state import tp_all_reduce
from pagedserve.layers.cpu_kernels import UsesCPUKernels


class RMSNorm(nn.Module, UsesCPUKernels):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        """With a residual: add it first and also return the sum (the next residual), in the residual's dtype; x may
        come narrower (a GEMM's bfloat16 output) and is widened as it is added. out_dtype: what the normalized output
        comes in (default: the sum's dtype), bfloat16 for a GEMM that rounds its input to it anyway."""
        kernels = self.kernels_for(x if residual is None else residual)
        if kernels is not None and self.weight.dtype == torch.float32 and x.dtype in _KERNEL_INPUT_DTYPES:
            out_dtype = out_dtype or torch.float32
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.variance_epsilon, out_dtype)
            return kernels.add_rms_norm(x, residual, self.weight, self.variance_epsilon, out_dtype)
        if residual is not None:
            x = x + residual
            residual = x
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        out = self.weight * hidden.to(input_dtype)
        if out_dtype is not None:
            out = out.to(out_dtype)
        return out if residual is None else (out, residual)


# What the kernel's x may come in beside a float32 residual (alone, x is float32).
_KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)


class SplitRMSNorm(nn.Module):
    """RMSNorm over a vector of full_size whose part (start, length) this tensor-parallel rank holds, the ranks' parts
    disjoint (OLMoE's q and k norms, over all heads, when the heads are split): the sum of squares is all-reduced."""

    def __init__(self, full_size: int, part: tuple[int, int], eps: float = 1e-6) -> None:
        super().__init__()
        self.full_size, self.part = full_size, part
        self.weight = nn.Parameter(torch.ones(part[1]))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.to(torch.float32)
        variance = tp_all_reduce(hidden.pow(2).sum(-1, keepdim=True)) / self.full_size
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)

    def rank_slice(self, tensor: torch.Tensor, shard: int | None, is_bias: bool) -> torch.Tensor:
        return tensor.narrow(0, *self.part)
