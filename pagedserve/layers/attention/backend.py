"""The attention backend interface and the step layout every backend builds its metadata from.

A step is one flat token batch: decodes first (one query token each), then prefill chunks. The
model runner describes it once per step as a BatchLayout; the engine's backend turns that into its
own metadata (build_metadata, once per step) and runs every layer's attention from it (forward).
K/V of the new tokens are written into the paged cache through the slot mapping; attention then
reads each sequence's keys and values through its block table.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from pagedserve.layers.attention.kv_quant import NO_STATIC_SCALES, StaticKVScales


@dataclass
class BatchLayout:
    """What attention needs to know of one step's flat batch, independent of any kernel: the decodes (one query token
    each) as arrays over all of them, then the prefill chunks one by one."""

    slot_mapping: np.ndarray  # [num_tokens]: flat cache slot of each new token
    decode_seq_lens: np.ndarray  # [num_decodes] int64: each decode's context + its token
    decode_block_tables: np.ndarray  # [num_decodes, max_blocks] int64: the blocks each decode's seq_len uses first; past
    # them, block ids that are not its own (readers go by decode_seq_lens)
    chunk_query_lens: list[int]  # per chunk, in batch order
    chunk_seq_lens: list[int]  # per chunk: its context + this step's tokens
    chunk_block_tables: list  # per chunk: the block ids its seq_len uses (a list, or an array)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seq_lens)


@dataclass
class PrefillChunk:
    query_start: int  # offset in the flat batch
    query_len: int
    seq_len: int  # context + this chunk
    block_table: torch.Tensor  # [num_blocks_of_this_sequence]

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class AttentionMetadata:
    """What every backend reads per step. Backends with more to prepare subclass it."""

    slot_mapping: torch.Tensor  # [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], as in BatchLayout
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk]

    @classmethod
    def from_layout(cls, layout: BatchLayout, device: torch.device, **extra) -> AttentionMetadata:
        num_decodes = layout.num_decodes
        decode_tables = decode_lens = None
        if num_decodes:
            decode_tables = torch.from_numpy(layout.decode_block_tables).to(device)
            decode_lens = torch.from_numpy(layout.decode_seq_lens).to(device)
        prefills, start = [], num_decodes
        for query_len, seq_len, block_table in zip(layout.chunk_query_lens, layout.chunk_seq_lens, layout.chunk_block_tables):
            table = torch.as_tensor(block_table, dtype=torch.long).to(device)
            prefills.append(PrefillChunk(start, query_len, seq_len, table))
            start += query_len
        slot_mapping = torch.from_numpy(layout.slot_mapping).to(device)
        return cls(slot_mapping, num_decodes, decode_tables, decode_lens, prefills, **extra)


def pad_block_tables(tables: list) -> np.ndarray:
    """Block tables (each already cut to the blocks its sequence uses; lists or arrays) as one zero-padded int64
    array. Filled in one assignment: a step may carry hundreds of tables."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
    used = np.arange(padded.shape[1]) < lengths[:, None]  # row-major: the tables' ids in order
    padded[used] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    return padded


class AttentionBackend(ABC):
    """One attention implementation. Stateless across steps: everything a step needs is in its metadata."""

    name: ClassVar[str]
    # Whether forward takes query, key and value in bfloat16 (a bfloat16 qkv GEMM's output as it comes) beside float32.
    takes_bfloat16: bool = False

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata.from_layout(layout, device)

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: StaticKVScales = NO_STATIC_SCALES,
                out_dtype: torch.dtype | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Write key/value [T, KV, D] into kv_cache [2, num_blocks, block_size, KV, D] at the slot mapping (an 8-bit
        cache's rows with the layer's static scales where it has them), then attend: query [T, H, D] -> [T, H, D], in
        out_dtype (default: query's). window: a sliding-window layer's; a query at position p attends to the keys at
        (p - window, p] (transformers' sliding-window mask); None: to all of [0, p]. softcap: where set, each scaled
        score s is attended as softcap * tanh(s / softcap) (layers/attention/layer.Attention)."""
