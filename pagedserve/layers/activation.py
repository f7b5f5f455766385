"""SiLU-and-mul, the gated activation of Llama-family MLPs; fused C++ kernel on CPU float32, torch's ops on other
dtypes (a bfloat16 gate-up output stays bfloat16 for the down projection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.cpu_kernels import UsesCPUKernels


class SiluAndMul(nn.Module, UsesCPUKernels):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] (gate, then up) -> silu(gate) * up, [T, I]."""
        kernels = self.kernels_for(gate_up)
        if kernels is not None:
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
