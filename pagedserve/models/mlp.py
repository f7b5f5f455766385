"""The gated MLP of the Llama family (SiLU; and the shared expert of a mixture) and of Gemma (GELU, tanh): gate and up
fused into one column-parallel GEMM, down row-parallel."""

from __future__ import annotations

from torch import nn

from pagedserve.layers.activation import GATED_ACTIVATIONS, SiluAndMul
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
        size = intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (size, size), bias=bias, name="intermediate_size")
        self.down_proj = RowParallelLinear(size, hidden_size, bias=bias, name="intermediate_size")
        self.act_fn = GATED_ACTIVATIONS[hidden_act]()
        # The GEMMs' epilogues, and the native decode layers, compute SiLU alone.
        self.silu = isinstance(self.act_fn, SiluAndMul)

    def forward(self, x):
        activated = self.gate_up_proj.fused_silu_and_mul(x) if self.silu else None
        if activated is None:
            activated = self.act_fn(self.gate_up_proj(x), out_dtype=self.down_proj.input_dtype(x.shape[0]))
        return self.down_proj(activated)


def hidden_activation(hf_config) -> str:
    """The MLP's activation, as the config names it (Gemma's configs: hidden_activation)."""
    return getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
