"""The plain-torch reference backend: device-agnostic, and the oracle every other backend is tested
against. It gathers each sequence's blocks and runs torch's scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        reference_write_kv_cache(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = reference_decode_attention(query[:num_decodes], kv_cache, meta, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = reference_prefill_attention(query[rows], key[rows], value[rows], kv_cache, chunk, scale)
        return out


def reference_write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's K and V as [seq_len, KV, D], read through its block table."""
    blocks = kv_cache[:, block_table]  # [2, nb, bs, KV, D]
    flat = blocks.flatten(1, 2)[:, :seq_len]
    return flat[0], flat[1]


def reference_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                               scale: float | None = None) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched, masked SDPA."""
    num_decodes = query.shape[0]
    blocks = kv_cache[:, meta.decode_block_tables].to(query.dtype)  # [2, B, max_blocks, bs, KV, D]
    keys = blocks[0].flatten(1, 2).transpose(1, 2)  # [B, KV, L, D]
    values = blocks[1].flatten(1, 2).transpose(1, 2)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    # Gathered slots past each sequence's length (the rest of its last block, the padding) are masked.
    key_mask = torch.arange(keys.shape[2], device=query.device) < meta.decode_seq_lens[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask[:, None, None, :], enable_gqa=True, scale=scale)
    return out.view(num_decodes, query.shape[1], query.shape[2])


def reference_prefill_attention(query, key, value, kv_cache: torch.Tensor, chunk: PrefillChunk,
                                scale: float | None = None) -> torch.Tensor:
    """Causal SDPA over a fresh chunk's own K/V, or over the gathered context and chunk with a mask."""
    context_len = chunk.context_len
    if context_len == 0:
        keys, values, mask, causal = key, value, None, True
    else:
        keys, values = (kv.to(query.dtype) for kv in gather_sequence_kv(kv_cache, chunk.block_table, chunk.seq_len))
        query_positions = torch.arange(context_len, chunk.seq_len, device=query.device)
        key_positions = torch.arange(chunk.seq_len, device=query.device)
        mask, causal = key_positions[None, :] <= query_positions[:, None], False
    # [1, heads, tokens, D]: with a batch dimension torch picks its fused (flash) CPU kernel; 3-D
    # inputs fall back to the unfused math path, several times slower on long prompts.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
        enable_gqa=True, scale=scale,
    )
    return out[0].transpose(0, 1)
