"""Paged attention. The reference backend is plain, device-agnostic torch; on CPU in float32 the
decodes and most prefill chunks (see prefill_in_kernel) go through C++ kernels (pagedserve/csrc)
that read K/V straight from the blocks. The other chunks run torch's fused attention: a long
prompt's first chunk on its own new K/V, a long chunk after a longer context on that context
gathered once (on CPU the context and the chunk attended apart, merged by log-sum-exp).

The flat batch holds decodes first (one query token each), then prefill chunks. K/V of the new
tokens are written into the paged cache through slot_mapping; attention then reads each
sequence's keys and values through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers import cpu_kernels


@dataclass
class PrefillChunk:
    query_start: int  # offset in the flat batch
    query_len: int
    seq_len: int  # context + this chunk
    block_table: torch.Tensor  # [num_blocks_of_this_sequence]


# Which prefill chunks the CPU kernel takes, from measurements at the default shapes (one layer,
# kernel vs torch's fused attention): a chunk that starts its sequence up to 512 tokens (1.4-2x
# faster; torch's causal flash kernel wins from ~1024 on). A chunk after context up to 128 tokens
# (1.2-2.5x faster than gathering the context for torch), and longer ones on a shorter context than
# the chunk: with a mask torch computes the whole square where the kernel skips the causal half. A
# long chunk on a longer context suits torch's blocked GEMMs better (15-60% faster there).
KERNEL_MAX_FRESH_LEN = 512
KERNEL_MAX_QUERY_LEN = 128


def prefill_in_kernel(chunk: PrefillChunk) -> bool:
    context_len = chunk.seq_len - chunk.query_len
    if context_len == 0:
        return chunk.query_len <= KERNEL_MAX_FRESH_LEN
    return chunk.query_len <= KERNEL_MAX_QUERY_LEN or context_len < chunk.query_len


def pad_block_tables(tables: list) -> np.ndarray:
    """Block tables (each already cut to the blocks its sequence uses) as one zero-padded int64 array."""
    padded = np.zeros((len(tables), max(len(table) for table in tables)), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return padded


@dataclass
class PagedPrefills:
    """The prefill chunks whose attention the CPU kernel computes from the paged cache (see
    prefill_in_kernel), as tensors for one call per layer, and the chunks left to torch."""

    block_tables: torch.Tensor  # [num_chunks, max_blocks], zero padded
    query_starts: torch.Tensor  # [num_chunks]
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    torch_chunks: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def for_kernel(cls, prefills: list[PrefillChunk], device: torch.device) -> PagedPrefills | None:
        """The chunks of a step the kernel takes (decided once a step, not per layer); None when
        there are none or not on CPU."""
        chunks = [chunk for chunk in prefills if prefill_in_kernel(chunk)]
        if not chunks or device.type != "cpu":
            return None
        paged = cls.of(chunks, device)
        paged.torch_chunks = [chunk for chunk in prefills if not prefill_in_kernel(chunk)]
        return paged

    @classmethod
    def of(cls, chunks: list[PrefillChunk], device: torch.device) -> PagedPrefills:
        tables = torch.from_numpy(pad_block_tables([chunk.block_table for chunk in chunks]))
        columns = [[chunk.query_start for chunk in chunks], [chunk.query_len for chunk in chunks], [chunk.seq_len for chunk in chunks]]
        starts, query_lens, seq_lens = (torch.tensor(column, dtype=torch.long, device=device) for column in columns)
        return cls(tables.to(device), starts, query_lens, seq_lens)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: flat cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk]
    paged_prefills: PagedPrefills | None = None  # the prefills the CPU kernel takes (built by the runner)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads

    def forward(self, query, key, value, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, KV, D], kv_cache [2, num_blocks, block_size, KV, D] -> [T, H*D]."""
        write_kv_cache(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = decode_attention(query[:num_decodes], kv_cache, meta)
        kernels = cpu_kernels.for_kv_cache(kv_cache)
        torch_chunks = meta.prefills
        if kernels is not None and meta.paged_prefills is not None and query.dtype == torch.float32:
            paged = meta.paged_prefills
            kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], paged.block_tables, paged.query_starts,
                                            paged.query_lens, paged.seq_lens, self.head_dim**-0.5, out)
            torch_chunks = paged.torch_chunks
        for chunk in torch_chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = prefill_attention(query[rows], key[rows], value[rows], kv_cache, chunk)
        return out.view(out.shape[0], -1)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kernels = cpu_kernels.for_kv_cache(kv_cache)
    if kernels is not None and key.dtype == torch.float32:
        kernels.write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping)
        return
    reference_write_kv_cache(kv_cache, key, value, slot_mapping)


def reference_write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's K and V as [seq_len, KV, D], read through its block table."""
    blocks = kv_cache[:, block_table]  # [2, nb, bs, KV, D]
    flat = blocks.flatten(1, 2)[:, :seq_len]
    return flat[0], flat[1]


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    kernels = cpu_kernels.for_kv_cache(kv_cache)
    if kernels is not None and query.dtype == torch.float32:
        return kernels.paged_decode_attention(query.contiguous(), kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                              meta.decode_seq_lens, query.shape[-1] ** -0.5)
    return reference_decode_attention(query, kv_cache, meta)


def reference_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Plain torch: gather each sequence's blocks, then one batched, masked SDPA. The oracle for kernels."""
    num_decodes = query.shape[0]
    blocks = kv_cache[:, meta.decode_block_tables].to(query.dtype)  # [2, B, max_blocks, bs, KV, D]
    keys = blocks[0].flatten(1, 2).transpose(1, 2)  # [B, KV, L, D]
    values = blocks[1].flatten(1, 2).transpose(1, 2)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    # Gathered slots past each sequence's length (the rest of its last block, the padding) are masked.
    key_mask = torch.arange(keys.shape[2], device=query.device) < meta.decode_seq_lens[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask[:, None, None, :], enable_gqa=True)
    return out.view(num_decodes, query.shape[1], query.shape[2])


# torch's CPU flash attention, which also returns each query row's log-sum-exp (a private op of
# torch's; None where this torch lacks it, and the masked path runs).
_flash_with_logsumexp = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(query, key, value, kv_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """A chunk the CPU kernel does not take (prefill_in_kernel): torch's fused attention. After context
    on CPU, the context and the chunk's own keys are attended separately and merged (see
    _context_then_chunk), else one masked call that computes the whole square."""
    context_len = chunk.seq_len - chunk.query_len
    if context_len == 0 or query.device.type != "cpu" or _flash_with_logsumexp is None:
        return reference_prefill_attention(query, key, value, kv_cache, chunk)
    keys, values = (kv.to(query.dtype) for kv in gather_sequence_kv(kv_cache, chunk.block_table, chunk.seq_len))
    return _context_then_chunk(query, keys, values, context_len)


def reference_prefill_attention(query, key, value, kv_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """Plain torch: causal SDPA over a fresh chunk's own K/V, or over the gathered context and chunk with
    a mask. The oracle for the kernels and the other paths."""
    context_len = chunk.seq_len - chunk.query_len
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
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _context_then_chunk(query, keys, values, context_len: int) -> torch.Tensor:
    """Attention of a chunk's queries [n, H, D] over keys/values [context + n, KV, D]: over the context
    (no mask: every query sees all of it) and causally over the chunk's own keys, merged by their
    log-sum-exps. With one masked call torch computes the whole square, the chunk's masked-out half
    included: a 1952-token chunk after 2048 tokens took ~200 ms a layer that way, ~150-180 ms so."""
    group = query.shape[1] // keys.shape[1]
    q = query.transpose(0, 1)[None]
    k, v = (kv.transpose(0, 1)[None].repeat_interleave(group, dim=1) for kv in (keys, values))  # the op takes no GQA
    out_context, lse_context = _flash_with_logsumexp(q, k[:, :, :context_len], v[:, :, :context_len], 0.0, False)
    out_chunk, lse_chunk = _flash_with_logsumexp(q, k[:, :, context_len:], v[:, :, context_len:], 0.0, True)
    top = torch.maximum(lse_context, lse_chunk)
    weight_context, weight_chunk = (lse_context - top).exp(), (lse_chunk - top).exp()
    out = (out_context * weight_context[..., None] + out_chunk * weight_chunk[..., None]) / (weight_context + weight_chunk)[..., None]
    return out[0].transpose(0, 1)
