"""The gated activations of MLPs: SiLU-and-mul, the Llama family's, a fused C++ kernel on CPU float32 and bfloat16 (a
bfloat16 gate-up output stays bfloat16 for the down projection), torch's ops elsewhere; and GELU(tanh)-and-mul,
Gemma's, on torch's ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.cpu_kernels import UsesCPUKernels


class SiluAndMul(nn.Module, UsesCPUKernels):
    def forward(self, gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[T, 2 * I] (gate, then up) -> silu(gate) * up, [T, I], in out_dtype (default: gate_up's): bfloat16 where the
        down projection multiplies its input rounded to it, rounded here once rather than written wide and rounded there."""
        kernels = self.kernels_for(gate_up, dtypes=(torch.float32, torch.bfloat16))
        if kernels is not None:
            return kernels.silu_and_mul(gate_up, out_dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out if out_dtype is None else out.to(out_dtype)


class GeluTanhAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[T, 2 * I] (gate, then up) -> gelu(gate) * up with GELU's tanh approximation (transformers'
        gelu_pytorch_tanh), [T, I], in out_dtype (default: gate_up's)."""
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.gelu(gate, approximate="tanh") * up
        return out if out_dtype is None else out.to(out_dtype)


# A config's hidden activation -> its gated activation.
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
