"""The plain-torch reference backend: device-agnostic, and the oracle every other backend is tested
against. It gathers each sequence's blocks and runs torch's scaled_dot_product_attention. It reads and writes every
cache layout: 32- and 16-bit, and the 8-bit formats of kv_quant.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk
from pagedserve.layers.attention.kv_quant import NO_STATIC_SCALES, KVFormat, StaticKVScales, dequantize_rows, quantize_rows


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_format: KVFormat | None = None) -> None:
        """kv_format: the 8-bit format the caches hold; None for a 16- or 32-bit cache."""
        self.kv_format = kv_format

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float,
                kv_scales: StaticKVScales = NO_STATIC_SCALES, out_dtype: torch.dtype | None = None,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        fmt = self.kv_format
        reference_write_kv_cache(kv_cache, key, value, meta.slot_mapping, fmt, kv_scales)
        out = torch.empty_like(query, dtype=out_dtype)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = reference_decode_attention(query[:num_decodes], kv_cache, meta, scale, fmt, window, softcap)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = reference_prefill_attention(query[rows], key[rows], value[rows], kv_cache, chunk, scale, fmt, window,
                                                    softcap)
        return out


def reference_write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                             kv_format: KVFormat | None = None, kv_scales: StaticKVScales = NO_STATIC_SCALES) -> None:
    num_kv_heads, row_width = kv_cache.shape[-2], kv_cache.shape[-1]
    for which, rows, static_scale in ((0, key, kv_scales.key), (1, value, kv_scales.value)):
        stored = quantize_rows(rows, kv_format, static_scale) if kv_format is not None else rows.to(kv_cache.dtype)
        kv_cache[which].view(-1, num_kv_heads, row_width).index_copy_(0, slot_mapping, stored)


def read_kv(stored: torch.Tensor, kv_format: KVFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of dtype: widened, or dequantized from an 8-bit format."""
    return dequantize_rows(stored, kv_format, dtype) if kv_format is not None else stored.to(dtype)


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's stored K and V rows as [seq_len, KV, row], read through its block table."""
    blocks = kv_cache[:, block_table]  # [2, nb, bs, KV, row]
    flat = blocks.flatten(1, 2)[:, :seq_len]
    return flat[0], flat[1]


def reference_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                               scale: float | None = None, kv_format: KVFormat | None = None,
                               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched, masked SDPA (window: a sliding window's keys, the last ones;
    softcap: the scores' soft cap)."""
    num_decodes = query.shape[0]
    blocks = read_kv(kv_cache[:, meta.decode_block_tables], kv_format, query.dtype)  # [2, B, max_blocks, bs, KV, D]
    keys = blocks[0].flatten(1, 2).transpose(1, 2)  # [B, KV, L, D]
    values = blocks[1].flatten(1, 2).transpose(1, 2)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    # Gathered slots past each sequence's length (the rest of its last block, the padding) are masked.
    key_positions = torch.arange(keys.shape[2], device=query.device)
    key_mask = key_positions < meta.decode_seq_lens[:, None]
    if window is not None:
        key_mask &= key_positions >= meta.decode_seq_lens[:, None] - window
    out = scaled_dot_product(q, keys, values, attn_mask=key_mask[:, None, None, :], scale=scale, softcap=softcap)
    return out.view(num_decodes, query.shape[1], query.shape[2])


def reference_prefill_attention(query, key, value, kv_cache: torch.Tensor, chunk: PrefillChunk,
                                scale: float | None = None, kv_format: KVFormat | None = None,
                                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal SDPA over a fresh chunk's own K/V, or over the gathered context and chunk with a mask (and with one where
    a sliding window hides keys: window; softcap: the scores' soft cap). Over an 8-bit cache a fresh chunk too reads its
    K/V back from the cache, so that attention sees what the cache holds however a prompt was chunked, cached or
    recomputed."""
    context_len = chunk.context_len
    if context_len == 0 and kv_format is None:
        keys, values = key, value
    else:
        keys, values = (read_kv(kv, kv_format, query.dtype) for kv in gather_sequence_kv(kv_cache, chunk.block_table, chunk.seq_len))
    mask = None  # a fresh chunk is plainly causal, which torch's fused kernel computes without a mask
    windowed = window is not None and chunk.seq_len > window
    if context_len or windowed:  # the queries sit after the context: causal from their positions on
        query_positions = torch.arange(context_len, chunk.seq_len, device=query.device)
        key_positions = torch.arange(chunk.seq_len, device=query.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        if windowed:
            mask &= key_positions[None, :] > query_positions[:, None] - window
    # [1, heads, tokens, D]: with a batch dimension torch picks its fused (flash) CPU kernel; 3-D
    # inputs fall back to the unfused math path, several times slower on long prompts.
    out = scaled_dot_product(query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                             attn_mask=mask, is_causal=mask is None, scale=scale, softcap=softcap)
    return out[0].transpose(0, 1)


def scaled_dot_product(query, keys, values, attn_mask=None, is_causal: bool = False, scale: float | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention of query [..., H, L, D] over keys and values [..., KV, S, D] (each KV head
    shared by H / KV query heads). Where softcap is set, the same written out (torch's takes no cap): each scaled
    score s becomes softcap * tanh(s / softcap) before the mask, and the softmax runs in float32, as transformers'
    eager attention computes it."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True,
                                              scale=scale)
    group = query.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = query @ keys.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ values
