"""The decoder layers of a Llama-family model in one C++ call for steps of decodes alone (csrc/decode_layers.cpp).

A decode step of a few rows through a small model spends longer in Python, between its kernels, than in them: the
modules' calls, splits, views and checks come to a few hundred a step. Where a model's layers are all of the plain
form (no biases, no q/k norms or clipping, a dense MLP, every linear layer on its GGUF blocks, one rank), the C++
object runs the same kernels on the same arguments in the same order, so a step gives the same bits either way
(tests/test_native_decode.py). Where every linear layer also has AMX tiles (Linear.bf16_products), the C++ layers take
the steps beyond the blocks' rows on them too, up to TILES_MAX_ROWS. Everything else (prefills, larger decode batches
oneDNN's dense weights take, LoRA adapters, tensor or pipeline parallelism, other attention backends) keeps the modules.
"""

from __future__ import annotations

import torch

from pagedserve.distributed.parallel_state import rank_info
from pagedserve.layers.attention import AttentionMetadata
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend
from pagedserve.layers.linear import TILES_MAX_ROWS, Linear
from pagedserve.models.mlp import GatedMLP


class NativeDecodeLayers:
    """A model's decoder layers as one kernels.LlamaDecodeLayers, for decode steps of up to max_rows rows (the fewest
    rows any of its linear layers takes on its blocks, as measured on the machine, or TILES_MAX_ROWS where every one
    has AMX tiles for the steps beyond its blocks)."""

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
        on_tiles = all(m.bf16_products is not None for m in linears)
        max_rows = TILES_MAX_ROWS if on_tiles else min(m.quantized.max_rows for m in linears)
        if not isinstance(backend, CPUAttentionBackend) or backend.kernels is None or max_rows < 1:
            return None
        rotary = attention.rotary_emb
        native = kernels.LlamaDecodeLayers(attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                           layers[0].input_layernorm.variance_epsilon, attention.attn.scale, backend.kernel_format,
                                           rotary.cos_cache, rotary.sin_cache)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            scales = attn.attn.kv_scales
            native.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, _linear_args(attn.qkv_proj),
                             _linear_args(attn.o_proj), _linear_args(mlp.gate_up_proj), _linear_args(mlp.down_proj),
                             scales.key or 0.0, scales.value or 0.0)
        return cls(native, max_rows)

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        return meta.num_decode_tokens == rows <= self.max_rows

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.native.forward(hidden_states, residual, positions, kv_caches, meta.slot_mapping, meta.decode_block_tables,
                                   meta.decode_seq_lens)


def _plain(layer) -> bool:
    """Whether a decoder layer is what the native layers compute: float32 norms, attention without biases, q/k norms,
    clipping, scales, a sliding window or a soft cap of its own, a dense SiLU-gated MLP without biases, every linear layer on its blocks
    and without adapters."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or not isinstance(mlp, GatedMLP) or not mlp.silu:
        return False
    if attn.qk_norm or attn.qk_norm_across_heads or attn.clip_qkv is not None:
        return False
    if layer.residual_multiplier != 1.0 or attn.attn.scale != attn.head_dim**-0.5:  # Granite's multipliers
        return False
    if attn.attn.window is not None or attn.attn.softcap is not None:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(m.bias is not None or m.lora is not None or m.quantized is None for m in linears):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    on_kernels = all(module.kernels is not None for module in (*norms, attn.rotary_emb, mlp.act_fn))
    return on_kernels and all(norm.weight.dtype == torch.float32 for norm in norms)


def _linear_args(linear: Linear) -> tuple:
    """A linear layer's paths as the C++ layers take them: its blocks and their row limits, its AMX tiles' pairs (or None)."""
    blocks, tiles = linear.quantized, linear.bf16_products
    return (blocks.blocks, blocks.qtype, blocks.interleaved, blocks.panels, blocks.max_rows,
            tiles.packed if tiles is not None else None, linear.out_features)
