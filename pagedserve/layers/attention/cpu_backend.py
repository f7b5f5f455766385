"""The CPU backend: C++ kernels (pagedserve/csrc) that read K/V straight from the paged blocks, for
float32 activations on CPU (the cache may hold float32, bfloat16 or float16, or the 8-bit rows of kv_quant.py).

Decodes and most prefill chunks run in the kernels (all of them where the kernels are built with
AVX-512); prefill_in_kernel says which chunks. The rest run torch's fused attention: a long prompt's
first chunk on its own new K/V, and a long chunk after a longer context on that context gathered
once, the context and the chunk attended apart and merged by log-sum-exp. Which is faster where was
measured at the default shapes (docs/cpu.md). Where the GEMMs multiply in bfloat16 on AMX tiles, every chunk that
starts its sequence is attended in bfloat16 on the tiles (the kernels' fresh_causal_attention; torch's flash attention
in bfloat16 for a head size the kernel does not take).

A sliding-window layer's decodes run in the decode kernel, which starts each sequence's keys at its window. Its prefill
chunks run as above while no chunk of the step is longer than the window (the window then hides nothing); in a step
where one is, all of them run in the prefill kernel, which hides the keys each row's window has passed. A layer whose
scores are soft-capped (Attention.softcap) runs all its chunks and decodes in the kernels, which cap each span's
scores before the mask; torch's fused attention takes no cap.

Where the GEMMs multiply in bfloat16 and the kernels are built with AVX-512 BF16 (prefill_bf16_products), the prefill
kernel over a bfloat16 cache multiplies in bfloat16 pairs too: q and the probabilities rounded to bfloat16, the sums
in float32. Decodes, read by memory more than by arithmetic, stay float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    PrefillChunk,
    pad_block_tables,
)
from pagedserve.layers.attention.kv_quant import NO_STATIC_SCALES, KVFormat, StaticKVScales
from pagedserve.layers.attention.torch_backend import gather_sequence_kv, read_kv, reference_prefill_attention

# With 8-lane loops (AVX2), a chunk that starts its sequence, up to this many tokens, runs in the kernel; beyond it
# torch's causal flash kernel wins.
KERNEL_MAX_FRESH_LEN = 512
# A chunk after context up to this many tokens runs in the kernel (it beats gathering the context for
# torch), and so does a longer one on a shorter context than itself (with a mask torch computes the
# whole square where the kernel skips the causal half). A long chunk on a longer context suits
# torch's blocked GEMMs better.
KERNEL_MAX_QUERY_LEN = 128
# With 16-lane loops (AVX-512) the kernel beat torch at every chunk and context measured (docs/cpu.md).
WIDE_PREFILL_LANES = 16


def prefill_in_kernel(chunk: PrefillChunk, lanes: int) -> bool:
    """Whether the kernel, whose loops compute `lanes` floats at a time, takes this chunk (else torch does)."""
    if lanes >= WIDE_PREFILL_LANES:
        return True
    if chunk.context_len == 0:
        return chunk.query_len <= KERNEL_MAX_FRESH_LEN
    return chunk.query_len <= KERNEL_MAX_QUERY_LEN or chunk.context_len < chunk.query_len


@dataclass
class PagedPrefills:
    """The prefill chunks the kernel computes from the paged cache, as tensors for one call per layer."""

    block_tables: torch.Tensor  # [num_chunks, max_blocks], zero padded
    query_starts: torch.Tensor  # [num_chunks]
    query_lens: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def of(cls, chunks: list[PrefillChunk], device: torch.device) -> PagedPrefills:
        tables = torch.from_numpy(pad_block_tables([chunk.block_table for chunk in chunks]))
        columns = [[chunk.query_start for chunk in chunks], [chunk.query_len for chunk in chunks], [chunk.seq_len for chunk in chunks]]
        starts, query_lens, seq_lens = (torch.tensor(column, dtype=torch.long, device=device) for column in columns)
        return cls(tables.to(device), starts, query_lens, seq_lens)


class FreshRun(NamedTuple):
    """Chunks that start their sequences, all of one length and side by side in the flat batch: one batched call."""

    query_start: int
    query_len: int
    count: int


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    paged_prefills: PagedPrefills | None = None  # the chunks the kernel takes; None when there are none
    torch_chunks: list[PrefillChunk] = field(default_factory=list)  # the others, but for those in fresh_runs
    fresh_runs: list[FreshRun] = field(default_factory=list)  # chunks attended in the backend's fresh_prefill_dtype
    longest_prefill: int = 0  # the most tokens a chunk's sequence holds after the step
    _all_paged: PagedPrefills | None = None  # every chunk for the kernel, made for the first sliding-window layer that needs it

    def all_prefills_paged(self, device: torch.device) -> PagedPrefills:
        if self._all_paged is None:
            self._all_paged = PagedPrefills.of(self.prefills, device)
        return self._all_paged


def fresh_runs_of(chunks: list[PrefillChunk]) -> list[FreshRun]:
    """Fresh chunks (in batch order) as runs of equal length that follow each other in the flat batch."""
    runs: list[FreshRun] = []
    for chunk in chunks:
        last = runs[-1] if runs else None
        if last is not None and last.query_len == chunk.query_len and last.query_start + last.query_len * last.count == chunk.query_start:
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(FreshRun(chunk.query_start, chunk.query_len, 1))
    return runs


def causal_attention_of_run(query, key, value, count: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """count sequences of equal length side by side ([count * length, heads, D] each), each attended causally over its
    own keys, in one call of torch's flash attention in dtype; the output in dtype."""

    def sequences_heads_first(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(dtype).reshape(count, -1, *rows.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(sequences_heads_first(query), sequences_heads_first(key), sequences_heads_first(value),
                                         is_causal=True, enable_gqa=True, scale=scale)
    return out.transpose(1, 2).reshape(query.shape)


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, kernels, kv_format: KVFormat | None = None, fresh_prefill_dtype: torch.dtype | None = None,
                 prefill_bf16_products: bool = False) -> None:
        """kv_format: the 8-bit format the caches hold; None for a 16- or 32-bit cache. fresh_prefill_dtype: where set,
        chunks that start their sequence are attended by torch in that dtype (their queries, keys and values rounded
        to it, the output widened back). prefill_bf16_products: the prefill kernel multiplies in bfloat16 over a
        bfloat16 cache (q and the probabilities rounded to bfloat16, the sums in float32), where the kernels can."""
        self.kernels = kernels
        self.kv_format = kv_format
        self.fresh_prefill_dtype = fresh_prefill_dtype if kv_format is None else None
        self.prefill_bf16_products = prefill_bf16_products and kernels is not None and kernels.prefill_bf16_products()
        self.kernel_format = kv_format.kernel_code if kv_format is not None else 0
        self.prefill_lanes = kernels.prefill_lanes() if kernels is not None else 1  # None: metadata only (host_costs)
        # An 8-bit cache's rows as values, for the chunks torch attends: the kernels read them as they read them.
        self.dequantize = partial(kernels.dequantize_kv_rows, kv_format=self.kernel_format) if kv_format is not None else None

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> CPUAttentionMetadata:
        meta = CPUAttentionMetadata.from_layout(layout, device)
        in_kernel, fresh = [], []
        for chunk in meta.prefills:
            if self.fresh_prefill_dtype is not None and chunk.context_len == 0:
                fresh.append(chunk)
            else:
                (in_kernel if prefill_in_kernel(chunk, self.prefill_lanes) else meta.torch_chunks).append(chunk)
        meta.fresh_runs = fresh_runs_of(fresh)
        if in_kernel:
            meta.paged_prefills = PagedPrefills.of(in_kernel, device)
        meta.longest_prefill = max((chunk.seq_len for chunk in meta.prefills), default=0)
        return meta

    @property
    def takes_bfloat16(self) -> bool:
        """Whether query, key and value may come in bfloat16 (a bfloat16 qkv GEMM's output as it comes): where fresh
        chunks are attended in bfloat16 anyway. The kernels widen the rest."""
        return self.fresh_prefill_dtype == torch.bfloat16

    def forward(self, query, key, value, kv_cache, meta: CPUAttentionMetadata, scale: float,
                kv_scales: StaticKVScales = NO_STATIC_SCALES, out_dtype: torch.dtype | None = None,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """query, key and value in float32, or in bfloat16 where takes_bfloat16; the output in out_dtype (default: query's;
        a bfloat16 query's step runs its output projection on bfloat16 too)."""
        kernels, kernel_format = self.kernels, self.kernel_format
        rule = (window or 0, softcap or 0.0)  # the kernels' last arguments: 0 for none
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kernels.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping, kernel_format,
                               kv_scales.key or 0.0, kv_scales.value or 0.0)  # 0: each row's own scale
        num_decodes = meta.num_decode_tokens
        if num_decodes == query.shape[0]:  # a step of decodes alone: the kernel's output is the whole of it
            return kernels.paged_decode_attention(query.float(), key_cache, value_cache, meta.decode_block_tables,
                                                  meta.decode_seq_lens, scale, kernel_format, *rule).to(out_dtype or query.dtype)
        out = torch.empty_like(query, dtype=out_dtype)
        kernels_only = softcap is not None or (window is not None and meta.longest_prefill > window)
        paged = meta.all_prefills_paged(query.device) if kernels_only else meta.paged_prefills
        if paged is not None:  # first: the kernel writes its chunks' rows of a float32 tensor, the others' come after
            wide = out if out.dtype == torch.float32 else torch.empty(query.shape, dtype=torch.float32)
            kernels.paged_prefill_attention(query.float(), key_cache, value_cache, paged.block_tables, paged.query_starts,
                                            paged.query_lens, paged.seq_lens, scale, wide, kernel_format, *rule,
                                            self.prefill_bf16_products)
            if wide is not out:
                out.copy_(wide)
        if num_decodes:
            out[:num_decodes] = kernels.paged_decode_attention(query[:num_decodes].float(), key_cache, value_cache,
                                                               meta.decode_block_tables, meta.decode_seq_lens, scale, kernel_format,
                                                               *rule)
        if kernels_only:
            return out
        for run in meta.fresh_runs:
            rows = slice(run.query_start, run.query_start + run.query_len * run.count)
            out[rows] = self._attend_fresh_run(query[rows], key[rows], value[rows], run.count, scale)
        for chunk in meta.torch_chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = prefill_attention(query[rows].float(), key[rows].float(), value[rows].float(), kv_cache, chunk, scale,
                                          self.kv_format, self.dequantize)
        return out

    def _attend_fresh_run(self, query, key, value, count: int, scale: float) -> torch.Tensor:
        """A run of fresh chunks in fresh_prefill_dtype: bfloat16 on the AMX tiles where the kernels take its head size
        (a few tile instructions for each block of 16 queries, where torch's flash kernel sets up small GEMMs), else
        torch's flash kernel."""
        if self.fresh_prefill_dtype == torch.bfloat16 and self.kernels.fresh_attention_on_tiles(query.shape[-1]):
            narrow = [t.to(torch.bfloat16) for t in (query, key, value)]
            return self.kernels.fresh_causal_attention(*narrow, count, scale)
        return causal_attention_of_run(query, key, value, count, scale, self.fresh_prefill_dtype)


# torch's CPU flash attention, which also returns each query row's log-sum-exp (a private op of
# torch's; None where this torch lacks it, and the masked reference runs).
_flash_with_logsumexp = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(query, key, value, kv_cache: torch.Tensor, chunk: PrefillChunk, scale: float | None = None,
                      kv_format: KVFormat | None = None, dequantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      ) -> torch.Tensor:
    """A chunk the kernel does not take: torch's fused attention. After context, the context and the
    chunk's own keys are attended separately and merged (_context_then_chunk); a fresh chunk is one
    causal call (over an 8-bit cache, on its K/V read back from the cache, as the torch backend does).
    dequantize turns an 8-bit cache's rows into values (default: the torch path's dequantize_rows)."""
    if (chunk.context_len == 0 and kv_format is None) or query.device.type != "cpu" or _flash_with_logsumexp is None:
        return reference_prefill_attention(query, key, value, kv_cache, chunk, scale, kv_format)
    read = dequantize if dequantize is not None else partial(read_kv, kv_format=kv_format, dtype=query.dtype)
    keys, values = (read(kv) for kv in gather_sequence_kv(kv_cache, chunk.block_table, chunk.seq_len))
    if chunk.context_len == 0:
        return reference_prefill_attention(query, keys, values, kv_cache, chunk, scale)
    return _context_then_chunk(query, keys, values, chunk.context_len, scale)


def _context_then_chunk(query, keys, values, context_len: int, scale: float | None) -> torch.Tensor:
    """Attention of a chunk's queries [n, H, D] over keys/values [context + n, KV, D]: over the context
    (no mask: every query sees all of it) and causally over the chunk's own keys, merged by their
    log-sum-exps. One masked call would compute the whole square, the chunk's masked-out half included."""
    group = query.shape[1] // keys.shape[1]
    q = query.transpose(0, 1)[None]
    k, v = (kv.transpose(0, 1)[None].repeat_interleave(group, dim=1) for kv in (keys, values))  # the op takes no GQA
    out_context, lse_context = _flash_with_logsumexp(q, k[:, :, :context_len], v[:, :, :context_len], 0.0, False, scale=scale)
    out_chunk, lse_chunk = _flash_with_logsumexp(q, k[:, :, context_len:], v[:, :, context_len:], 0.0, True, scale=scale)
    top = torch.maximum(lse_context, lse_chunk)
    weight_context, weight_chunk = (lse_context - top).exp(), (lse_chunk - top).exp()
    out = (out_context * weight_context[..., None] + out_chunk * weight_chunk[..., None]) / (weight_context + weight_chunk)[..., None]
    return out[0].transpose(0, 1)
