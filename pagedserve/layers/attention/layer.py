"""The attention layer models use: it runs whichever backend the engine selected; models never
branch on kernels."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.layers.attention.kv_quant import NO_STATIC_SCALES, StaticKVScales


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, backend: AttentionBackend,
                 window: int | None = None, softcap: float | None = None) -> None:
        """window: a sliding-window layer's, the most keys a query attends to (itself and those just before it); None
        for full causal attention. softcap: where set, the scaled scores are capped as softcap * tanh(score / softcap)
        before the mask and the softmax (Gemma 2's attention logit soft-capping)."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5
        self.backend = backend
        self.window = window
        self.softcap = softcap
        self.kv_scales: StaticKVScales = NO_STATIC_SCALES  # a checkpoint's, for an FP8 cache (Worker)

    def forward(self, query, key, value, kv_cache: torch.Tensor, meta: AttentionMetadata,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, KV, D], kv_cache [2, num_blocks, block_size, KV, D] -> [T, H*D], in out_dtype
        (default: query's): the dtype the output projection multiplies, so that its input is not converted twice."""
        out = self.backend.forward(query, key, value, kv_cache, meta, self.scale, self.kv_scales, out_dtype, self.window,
                                   self.softcap)
        return out.view(out.shape[0], -1)
