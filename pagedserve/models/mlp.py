"""The SiLU-gated MLP of the Llama family (and the shared expert of a mixture): gate and up fused into one
column-parallel GEMM, down row-parallel."""

from __future__ import annotations

from torch import nn

from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only 'silu'")
        size = intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (size, size), bias=bias, name="intermediate_size")
        self.down_proj = RowParallelLinear(size, hidden_size, bias=bias, name="intermediate_size")
        self.act_fn = SiluAndMul()

    def forward(self, x):
        activated = self.gate_up_proj.fused_silu_and_mul(x)
        if activated is None:
            activated = self.act_fn(self.gate_up_proj(x), out_dtype=self.down_proj.input_dtype(x.shape[0]))
        return self.down_proj(activated)
