"""Rotary position embedding (neox layout, as HF Llama), with the rope scalings transformers defines."""

from __future__ import annotations

import json
from importlib import metadata

import torch
from torch import nn

from pagedserve import cached_json
from pagedserve.layers.cpu_kernels import UsesCPUKernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Bumped when what the cache keeps of a scaling changes shape.
_CACHE_FORMAT = "1"


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rotary parameters. A config whose layers rotate differently by their type (Gemma 3's sliding and
    full attention layers) holds them per layer type: layer_type's (default: the full attention layers')."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if rotary_layer_types(hf_config) is not None:
        params = dict(params[layer_type or "full_attention"])
    if not params:  # older configs
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rotary_layer_types(hf_config) -> list[str] | None:
    """The layer types the config rotates each by its own parameters (Gemma 3's); None where all layers rotate alike."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        return sorted(params)
    return None


def rotary_dim(hf_config, head_dim: int) -> int:
    """How many of each head's dims the rotation turns (partial_rotary_factor, as transformers reads it); the rest
    pass unturned."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return int(head_dim * factor) if factor else head_dim


# Model types that turn adjacent dims (2i, 2i + 1) of each head together, not i and i + head_dim / 2.
ADJACENT_PAIR_TYPES = ("ernie4_5",)


def rotary_order(hf_config, head_dim: int) -> list[int] | None:
    """Where each head's dims of q and k are laid out at load so that the kernels' rotation, which turns dims i and
    i + head_dim / 2 together, turns the pairs the model turns (None: as they are): a partial rotary's
    (partial_rotary_order); for a model that turns adjacent pairs (ERNIE 4.5's), the even dims, then the odd ones."""
    turned = rotary_dim(hf_config, head_dim)
    if getattr(hf_config, "model_type", None) not in ADJACENT_PAIR_TYPES:
        return partial_rotary_order(head_dim, turned)
    if turned != head_dim:
        raise ValueError("a partial rotary of adjacent pairs is not supported")
    return [*range(0, head_dim, 2), *range(1, head_dim, 2)]


def partial_rotary_order(head_dim: int, turned: int) -> list[int] | None:
    """Where a head's dims go when only `turned` of them rotate (None: all do). transformers turns dims i and
    i + turned/2 together; the kernels turn i and i + head_dim/2. Laid out in this order (q and k alike, so their
    products are unchanged), the turned pairs sit where the kernels turn them, and the dims that pass sit in the
    pairs whose angle is zero."""
    if turned == head_dim:
        return None
    half, passing = turned // 2, (head_dim - turned) // 2
    return [*range(half), *range(turned, turned + passing), *range(half, turned), *range(turned + passing, head_dim)]


def compute_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """The frequencies of the turned pairs (rotary_dim / 2 of them) and the scaling of their cos and sin (of layer_type's
    layers, where the config rotates layers by their type)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        base, dim = params["rope_theta"], rotary_dim(hf_config, head_dim)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    # transformers' rope functions are the authority on the scalings, but importing them takes seconds at every start.
    # What they compute depends on the config alone, so it is kept in the cache and read back by later starts.
    config_text = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    path = cached_json.cache_file("rope", config_text, str(head_dim), str(layer_type), metadata.version("transformers"), _CACHE_FORMAT)
    stored = cached_json.read(path)
    if stored is None:
        inv_freq, attention_scaling = _transformers_inv_freq(hf_config, rope_type, layer_type)
        stored = {"inv_freq": inv_freq.tolist(), "attention_scaling": attention_scaling}
        cached_json.write(path, stored)
    # float32 values written as JSON numbers read back exactly.
    return torch.tensor(stored["inv_freq"], dtype=torch.float), float(stored["attention_scaling"])


def _transformers_inv_freq(hf_config, rope_type: str, layer_type: str | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers' rope functions take its own config object (models/hf_config.py keeps a plain one).
    as_transformers = getattr(hf_config, "to_transformers", None)
    config = as_transformers() if as_transformers else hf_config
    per_type = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **per_type)
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module, UsesCPUKernels):
    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        """layer_type: the layers whose rotation this is, where the config rotates layers by their type."""
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim, layer_type)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        # Pairs beyond the turned ones (a partial rotary, its dims laid out by partial_rotary_order) pass as they are.
        passing = head_dim // 2 - inv_freq.numel()
        if passing:
            cos = torch.cat((cos, torch.ones(max_position, passing)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_position, passing)), dim=-1)
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """query [T, H, D], key [T, KV, D] -> rotated, same shapes and dtype (in place with the CPU kernel, which rotates
        bfloat16 in float32 and rounds once)."""
        kernels = self.kernels_for(query, dtypes=(torch.float32, torch.bfloat16))
        if kernels is not None and key.dtype == query.dtype:
            kernels.rotary_embedding(positions, query, key, self.cos_cache, self.sin_cache)
            return query, key
        cos = self.cos_cache[positions].unsqueeze(1).to(query.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(query.dtype)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


class NoRotary(nn.Module):
    """The rotary of a layer that attends without one (SmolLM3's layers that no_rope_layers marks 0): query and key pass
    unturned."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return query, key


def unrotated_layers(hf_config) -> set[int]:
    """The layers that attend without a rotary: those SmolLM3's no_rope_layers marks 0 (1: the layer rotates), and an
    EXAONE 4 with sliding-window layers' other layers."""
    if getattr(hf_config, "model_type", None) == "exaone4" and getattr(hf_config, "sliding_window", None):
        return {index for index, layer_type in enumerate(hf_config.layer_types) if layer_type != "sliding_attention"}
    flags = getattr(hf_config, "no_rope_layers", None) or []
    return {index for index, rotates in enumerate(flags) if not rotates}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
