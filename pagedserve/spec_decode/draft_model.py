"""A smaller model with the target's vocabulary drafts k tokens per request, all requests in one batch per
draft position. It keeps its own paged KV cache in the target's block layout (same block ids, its own
layers and heads): it runs over every step's flat batch with the target, so its cache holds every token the
target has seen, and writes its drafts' K/V into the slots the scheduler holds beyond them."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.layers.attention import AttentionBackend, AttentionMetadata, BatchLayout
from pagedserve.layers.attention.backend import pad_block_tables
from pagedserve.layers.sampler import argmax
from pagedserve.layers.sampling_rule import DRAFT_STREAM, draw, philox_uniforms
from pagedserve.spec_decode.proposer import DraftInput, Proposal
from pagedserve.spec_decode.rejection_sampler import target_probabilities


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, attn_backend: AttentionBackend,
                 device: torch.device, num_speculative_tokens: int, cpu_kernels=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attn_backend = attn_backend
        self.device = device
        self.k = num_speculative_tokens
        self.cpu_kernels = cpu_kernels

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Write the K/V of the target's step into the draft's cache (no logits: nothing samples here)."""
        self.model(input_ids, positions, self.kv_caches, attn_metadata)

    def propose(self, requests: list[DraftInput]) -> list[Proposal]:
        block_size = self.block_size
        tables = [np.asarray(r.block_ids, dtype=np.int64) for r in requests]
        tokens = [r.token_ids[-1] for r in requests]
        positions = np.asarray([len(r.token_ids) - 1 for r in requests], dtype=np.int64)
        drafts: list[list[int]] = [[] for _ in requests]
        probabilities: list[list[torch.Tensor]] = [[] for _ in requests]
        for position in range(self.k):
            slots = np.asarray([table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)])
            seq_lens = positions + 1
            layout = BatchLayout(slots, seq_lens, pad_block_tables([table[: -(-n // block_size)] for table, n in zip(tables, seq_lens)]),
                                 [], [], [])
            hidden = self.model(torch.tensor(tokens, device=self.device), torch.from_numpy(positions).to(self.device), self.kv_caches,
                                self.attn_backend.build_metadata(layout, self.device))
            tokens = self._pick(self.model.compute_logits(hidden).float(), requests, position, probabilities)
            for row, token in enumerate(tokens):
                drafts[row].append(token)
            positions = positions + 1
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probabilities)]

    def _pick(self, logits: torch.Tensor, requests: list[DraftInput], position: int, probabilities: list[list[torch.Tensor]]) -> list[int]:
        """Greedy requests take the draft's argmax (verification wants the target's argmax); the others draw from the
        draft's distribution under their own temperature and filters, and keep it for the verification."""
        picks = argmax(logits.contiguous(), self.cpu_kernels).tolist()
        sampled = [row for row, request in enumerate(requests) if not request.params.is_greedy]
        if sampled:
            distributions = target_probabilities(logits[sampled], [requests[row].params for row in sampled])
            keys, counters = zip(*(requests[row].draw_keys[position] for row in sampled))
            for q, row, uniform in zip(distributions, sampled, philox_uniforms(keys, counters, DRAFT_STREAM)):
                picks[row] = draw(q, float(uniform))
                probabilities[row].append(q)
        return picks
