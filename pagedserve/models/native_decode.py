"""The decoder layers of a Llama-family model in one C++ call for steps of decodes alone (csrc/decode_layers.cpp).

A decode step of a few rows through a small model spends longer in Python, between its kernels, than in them: the
modules' calls, splits, views and checks come to a few hundred a step. Where a model's layers are all of the plain
form (no biases, clipping or norms across the heads, a dense gated MLP, every linear layer on its GGUF blocks or every
one on its bfloat16 values, one rank; per-head q/k norms, Gemma's norms around attention and the MLP and its GELU,
sliding windows and soft caps included),
the C++ object runs the same kernels on the same arguments in the same order, so a step gives the same bits either way
(tests/test_native_decode.py). Where every linear layer also has AMX tiles (Linear.bf16_products), the C++ layers take
the steps beyond the blocks' rows on them too, up to TILES_MAX_ROWS, as do layers on bfloat16 values
(Linear.bf16_values). Everything else (prefills, larger decode batches oneDNN's dense weights take, LoRA adapters,
tensor or pipeline parallelism, other attention backends) keeps the modules.
"""

from __future__ import annotations

import torch

from pagedserve.distributed.parallel_state import rank_info
from pagedserve.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedserve.layers.attention import AttentionMetadata
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend
from pagedserve.layers.linear import TILES_MAX_ROWS, Linear, QuantizedWeight
from pagedserve.layers.rotary import NoRotary
from pagedserve.models.mlp import GatedMLP


class NativeDecodeLayers:
    """A model's decoder layers as one kernels.LlamaDecodeLayers, for decode steps of up to max_rows rows (the fewest
    rows any of its linear layers takes on its blocks, as measured on the machine, or TILES_MAX_ROWS where every one
    has AMX tiles for the steps beyond its blocks, or where every one runs on its bfloat16 values)."""

    def __init__(self, native, max_rows: int) -> None:
        self.native = native
        self.max_rows = max_rows

    @classmethod
    def of(cls, model, kernels) -> NativeDecodeLayers | None:
        """The native layers of model (a LlamaModel), or None where any of its layers is not of the plain form."""
        info = rank_info()
        layers = list(model.layers)
        if kernels is None or info.tp_size != 1 or not (info.is_first_stage and info.is_last_stage) or not layers:
            return None
        if not all(_plain(layer) for layer in layers):
            return None
        attention = layers[0].self_attn
        backend = attention.attn.backend
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
        max_rows = _max_rows(linears)
        if not isinstance(backend, CPUAttentionBackend) or backend.kernels is None or max_rows < 1:
            return None
        # One scale of the scores and one epsilon serve every layer.
        epsilons = _epsilons(layers)
        if len({layer.self_attn.attn.scale for layer in layers}) != 1 or len(epsilons) != 1:
            return None
        native = kernels.LlamaDecodeLayers(attention.num_heads, attention.num_kv_heads, attention.head_dim, epsilons.pop(),
                                           attention.attn.scale, backend.kernel_format)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            scales, rotary = attn.attn.kv_scales, attn.rotary_emb
            norms = {place: None if norm is None else norm.weight for place, norm in layer.norms_by_place().items()}
            native.add_layer(qkv=_linear_args(attn.qkv_proj), o=_linear_args(attn.o_proj), gate_up=_linear_args(mlp.gate_up_proj),
                             down=_linear_args(mlp.down_proj), k_scale=scales.key or 0.0, v_scale=scales.value or 0.0,
                             cos_cache=rotary.cos_cache, sin_cache=rotary.sin_cache, window=attn.attn.window or 0,
                             softcap=attn.attn.softcap or 0.0, gelu_tanh=not mlp.silu, **norms)
        return cls(native, max_rows)

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        return meta.num_decode_tokens == rows <= self.max_rows

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.native.forward(hidden_states, residual, positions, kv_caches, meta.slot_mapping, meta.decode_block_tables,
                                   meta.decode_seq_lens)


def _max_rows(linears: list[Linear]) -> int:
    """The most rows of a decode step the native layers take: TILES_MAX_ROWS where every linear layer has AMX tiles or
    runs on its bfloat16 values, else the fewest its blocks take (0: none, where the layers mix the two kinds)."""
    if all(m.bf16_products is not None for m in linears) or all(m.bf16_values is not None for m in linears):
        return TILES_MAX_ROWS
    if any(m.quantized is None for m in linears):
        return 0
    return min(m.quantized.max_rows for m in linears)


def _plain(layer) -> bool:
    """Whether a decoder layer is what the native layers compute: float32 norms on the kernels (Gemma's around
    attention and the MLP, and per-head q/k norms, included), attention without biases, clipping or norms across the
    heads, a dense gated MLP (SiLU, or Gemma's GELU) without biases, every linear layer on its blocks or its bfloat16
    values and without adapters, and no residual multiplier."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or not isinstance(mlp, GatedMLP) or not isinstance(mlp.act_fn, (SiluAndMul, GeluTanhAndMul)):
        return False
    if attn.qk_norm_across_heads or attn.clip_qkv is not None or layer.residual_multiplier != 1.0:
        return False
    if isinstance(attn.rotary_emb, NoRotary) or attn.query_position_scaling is not None:  # nor does it scale queries
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(m.bias is not None or m.lora is not None or (m.quantized is None and m.bf16_values is None) for m in linears):
        return False
    by_place = layer.norms_by_place()
    if by_place is None:
        return False
    norms = [norm for norm in by_place.values() if norm is not None]
    on_kernels = all(module.kernels is not None for module in (*norms, attn.rotary_emb))
    return on_kernels and (not mlp.silu or mlp.act_fn.kernels is not None) and all(norm.weight.dtype == torch.float32 for norm in norms)


def _epsilons(layers) -> set[float]:
    return {norm.variance_epsilon for layer in layers for norm in layer.norms_by_place().values() if norm is not None}


def _linear_args(linear: Linear) -> tuple:
    """A linear layer's paths as the C++ layers take them: its blocks (none for a layer of mixed types, which multiplies on
    its parts' panels alone) and their row limits, its AMX tiles' pairs (or None); or its bfloat16 values' pairs alone."""
    if linear.bf16_values is not None:
        return torch.empty(0, dtype=torch.uint8), -1, None, [], [], [], 0, linear.bf16_values.packed, linear.out_features, True
    blocks, tiles = linear.quantized, linear.bf16_products
    panels, types, rows = (list(column) for column in zip(*blocks.panel_parts())) if blocks.rounds_activations else ([], [], [])
    whole = (blocks.blocks, blocks.qtype) if isinstance(blocks, QuantizedWeight) else (torch.empty(0, dtype=torch.uint8), -1)
    return (*whole, blocks.interleaved, panels, types, rows, blocks.max_rows, tiles.packed if tiles is not None else None,
            linear.out_features, False)
