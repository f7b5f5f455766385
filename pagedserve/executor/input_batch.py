"""Turn one SchedulerOutput into the flat token batch the model runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.layers.attention import AttentionBackend, AttentionMetadata, BatchLayout
from pagedserve.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    """The runner's own copy of a request: it appends the tokens it samples."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs_start: int = 0
    num_drafts: int = 0  # draft tokens at the end of token_ids, verified in this step

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_drafts - self.num_prompt_tokens


@dataclass
class PromptLogprobsSlice:
    request_id: str
    flat_indices: list[int]  # positions in the flat batch whose logits predict the next prompt token
    target_token_ids: list[int]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_req_ids: list[str]  # requests that sample this step, in logits order
    logits_indices: torch.Tensor  # one row per sampling request; 1 + k for one verifying k drafts
    prompt_logprobs: list[PromptLogprobsSlice] = field(default_factory=list)


def prepare_inputs(states: dict[str, RunnerRequestState], num_scheduled_tokens: dict[str, int], block_size: int,
                   attn_backend: AttentionBackend, device: torch.device) -> ModelInputs:
    # Decodes (one query token) first: attention takes them in one batched call.
    batch = _FlatBatch(block_size)
    for request_id, num_tokens in num_scheduled_tokens.items():
        if num_tokens == 1:
            batch.add_decode(states[request_id])
    for request_id, num_tokens in num_scheduled_tokens.items():
        if num_tokens != 1:
            batch.add_chunk(states[request_id], num_tokens)
    return batch.inputs(attn_backend, device)


class _FlatBatch:
    """One step's requests laid end to end. A decode's row is a handful of integers, gathered in plain Python (array
    operations per request cost more than the arithmetic, and a step may carry hundreds of decodes); a prompt chunk's
    rows are arrays."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.decode_ids: list[int] = []
        self.decode_slots: list[int] = []
        self.chunk_ids: list[np.ndarray] = []
        self.chunk_slots: list[np.ndarray] = []
        self.decode_positions: list[int] = []
        self.chunk_positions: list[np.ndarray] = []
        self.query_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.tables: list = []
        self.sampling_req_ids: list[str] = []
        self.logits_indices: list[int] = []
        self.prompt_slices: list[PromptLogprobsSlice] = []
        self.offset = 0

    def add_decode(self, state: RunnerRequestState) -> None:
        position, block_size = state.num_computed_tokens, self.block_size
        block_index = position // block_size
        self.decode_ids.append(state.token_ids[position])
        self.decode_positions.append(position)
        self.decode_slots.append(state.block_ids[block_index] * block_size + position % block_size)
        self.tables.append(state.block_ids[: block_index + 1])
        self._account(state, position, 1)

    def add_chunk(self, state: RunnerRequestState, num_tokens: int) -> None:
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        token_positions = np.arange(start, end)
        block_ids = np.asarray(state.block_ids, dtype=np.int64)
        self.chunk_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        self.chunk_positions.append(token_positions)
        self.chunk_slots.append(block_ids[token_positions // self.block_size] * self.block_size + token_positions % self.block_size)
        self.tables.append(block_ids[: -(-end // self.block_size)])
        self._account(state, start, num_tokens)

    def _account(self, state: RunnerRequestState, start: int, num_tokens: int) -> None:
        """The sequence's lengths, whether it samples (and which logits rows), and its prompt logprobs."""
        end, offset = start + num_tokens, self.offset
        self.query_lens.append(num_tokens)
        self.seq_lens.append(end)
        if end == len(state.token_ids):
            self.sampling_req_ids.append(state.request_id)
            if state.num_drafts:  # the target's logits after the last known token and after each draft
                self.logits_indices.extend(range(offset + num_tokens - 1 - state.num_drafts, offset + num_tokens))
            else:
                self.logits_indices.append(offset + num_tokens - 1)
        if state.sampling_params.prompt_logprobs is not None:
            prompt_slice = _prompt_logprobs_slice(state, start, end, offset)
            if prompt_slice is not None:
                self.prompt_slices.append(prompt_slice)
        self.offset = offset + num_tokens

    def inputs(self, attn_backend: AttentionBackend, device: torch.device) -> ModelInputs:
        def flat(decode_values: list[int], chunk_values: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([np.asarray(decode_values, dtype=np.int64), *chunk_values])

        layout = BatchLayout(flat(self.decode_slots, self.chunk_slots), len(self.decode_ids), self.query_lens, self.seq_lens,
                             self.tables)
        return ModelInputs(
            input_ids=torch.from_numpy(flat(self.decode_ids, self.chunk_ids)).to(device),
            positions=torch.from_numpy(flat(self.decode_positions, self.chunk_positions)).to(device),
            attn_metadata=attn_backend.build_metadata(layout, device),
            sampling_req_ids=self.sampling_req_ids,
            logits_indices=torch.tensor(self.logits_indices, dtype=torch.long, device=device),
            prompt_logprobs=self.prompt_slices,
        )


def dummy_layout(num_seqs: int, seq_len: int, context: int, block_size: int) -> BatchLayout:
    """num_seqs sequences of seq_len new tokens after `context` tokens, on blocks 0, 1, 2, ... in turn
    (for timing the bare forward pass; whatever the blocks hold stands in for the context's K/V)."""
    total = context + seq_len
    blocks_per_seq = -(-total // block_size)
    tables = [np.arange(seq * blocks_per_seq, (seq + 1) * blocks_per_seq, dtype=np.int64) for seq in range(num_seqs)]
    slots = np.concatenate([np.arange(context, total) + table[0] * block_size for table in tables])
    return BatchLayout(slots, num_seqs if seq_len == 1 else 0, [seq_len] * num_seqs, [total] * num_seqs, tables)


def _prompt_logprobs_slice(state: RunnerRequestState, start: int, end: int, offset: int) -> PromptLogprobsSlice | None:
    # Logits at position p score prompt token p+1; positions before prompt_logprobs_start were reported already.
    first = max(start, state.prompt_logprobs_start)
    last = min(end, state.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogprobsSlice(
        request_id=state.request_id,
        flat_indices=[offset + p - start for p in range(first, last)],
        target_token_ids=state.token_ids[first + 1 : last + 1],
    )
