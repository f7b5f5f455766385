"""Turn one SchedulerOutput into the flat token batch the model runs on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.layers.attention import AttentionBackend, AttentionMetadata, BatchLayout
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    """The runner's own copy of a request: it appends the tokens it samples. How many of its tokens are computed is kept
    by RunnerRequests, with the other columns the decode pass reads."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    prompt_logprobs_start: int = 0
    num_drafts: int = 0  # draft tokens at the end of token_ids, verified in this step
    row: int = -1  # its row of RunnerRequests' block tables and columns, once added
    lora_request: LoRARequest | None = None  # the adapter it runs with

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_drafts - self.num_prompt_tokens


@dataclass
class PromptLogprobsSlice:
    request_id: str
    flat_indices: list[int]  # positions in the flat batch whose logits predict the next prompt token
    target_token_ids: list[int]


class BlockTables:
    """Block ids as rows of one array, a row per request (rows are reused as requests come and go; both dimensions
    grow as needed). A step's decode block tables are then one gather, not hundreds of lists padded each step.
    What lies beyond a request's blocks in its row is left as it was: readers cut each row to the blocks they use."""

    def __init__(self, num_rows: int = 16, num_columns: int = 64) -> None:
        self.ids = np.zeros((num_rows, num_columns), dtype=np.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: the lowest row first

    def add(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            num_rows = self.ids.shape[0]
            self._resize(2 * num_rows, self.ids.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self.write(row, 0, block_ids)
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """block_ids as the row's blocks from index start on."""
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            self._resize(self.ids.shape[0], max(end, 2 * self.ids.shape[1]))
        self.ids[row, start:end] = block_ids

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def _resize(self, num_rows: int, num_columns: int) -> None:
        ids = np.zeros((num_rows, num_columns), dtype=np.int64)
        ids[: self.ids.shape[0], : self.ids.shape[1]] = self.ids
        self.ids = ids


class RunnerRequests:
    """The runner's requests by id. What a step reads of each of hundreds of requests is kept in columns too, a request's
    entries in its row (its row of block_tables): its block ids, how many of its tokens are computed (kept only here),
    how many it knows and the last of them, and whether it wants prompt logprobs. A step of decodes is then a few
    gathers over the columns, not a pass over Python objects. Every change to a request's blocks, tokens or computed
    count goes through here, so the columns never differ from the states."""

    def __init__(self) -> None:
        self._states: dict[str, RunnerRequestState] = {}
        self.block_tables = BlockTables()
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.last_token = np.zeros(0, dtype=np.int64)
        self.wants_prompt_logprobs = np.zeros(0, dtype=bool)
        # Changes whenever a request is added or removed: with the ids of a batch, it names the same requests.
        self.version = 0
        self._rows_key: tuple | None = None
        self._rows = np.zeros(0, dtype=np.int64)

    def __getitem__(self, request_id: str) -> RunnerRequestState:
        return self._states[request_id]

    def of(self, request_ids: Iterable[str]) -> list[RunnerRequestState]:
        states = self._states
        return [states[request_id] for request_id in request_ids]

    def rows_of(self, request_ids: list[str]) -> np.ndarray:
        """The requests' rows, in order. Kept for the last ids asked for: a step asks for its batch's rows a few times,
        and a run of decode steps has the same batch step after step."""
        key = (self.version, tuple(request_ids))
        if key != self._rows_key:
            states = self._states
            self._rows_key, self._rows = key, np.array([states[request_id].row for request_id in request_ids], dtype=np.int64)
        return self._rows

    def add(self, state: RunnerRequestState, num_computed_tokens: int) -> None:
        self.remove(state.request_id)
        state.row = row = self.block_tables.add(state.block_ids)
        if row >= len(self.num_computed):
            self._grow_columns(self.block_tables.ids.shape[0])
        self._states[state.request_id] = state
        self.num_computed[row] = num_computed_tokens
        self.wants_prompt_logprobs[row] = state.sampling_params.prompt_logprobs is not None
        self._note_tokens(state)
        self.version += 1

    def remove(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.block_tables.remove(state.row)
            self.version += 1

    def add_blocks(self, request_id: str, new_block_ids: list[int], num_kept_blocks: int = -1) -> None:
        """Append new blocks to the request's, after keeping only its first num_kept_blocks (-1: all of them)."""
        state = self._states[request_id]
        block_ids = state.block_ids
        if 0 <= num_kept_blocks < len(block_ids):
            del block_ids[num_kept_blocks:]
        self.block_tables.write(state.row, len(block_ids), new_block_ids)
        block_ids.extend(new_block_ids)

    def num_computed_of(self, request_id: str) -> int:
        return int(self.num_computed[self._states[request_id].row])

    def set_num_computed(self, request_id: str, num_computed_tokens: int) -> None:
        self.num_computed[self._states[request_id].row] = num_computed_tokens

    def advance(self, num_scheduled_tokens: dict[str, int]) -> None:
        """A step computed these requests' scheduled tokens."""
        rows = self.rows_of(list(num_scheduled_tokens))
        if sum(num_scheduled_tokens.values()) == len(rows):  # one token each, as in most steps
            self.num_computed[rows] += 1
        else:
            self.num_computed[rows] += np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))

    def append_sampled(self, states: list[RunnerRequestState], token_ids: list[int], rows: np.ndarray | None = None) -> None:
        """Each state's new token, in order. rows: the states' rows, where the caller has them."""
        for state, token_id in zip(states, token_ids):
            state.token_ids.append(token_id)
        if rows is None:
            rows = np.array([state.row for state in states], dtype=np.int64)
        self.last_token[rows] = token_ids
        self.num_tokens[rows] += 1

    def extend_tokens(self, state: RunnerRequestState, token_ids: list[int]) -> None:
        state.token_ids.extend(token_ids)
        self._note_tokens(state)

    def truncate_tokens(self, state: RunnerRequestState, num_tokens: int) -> None:
        """Keep the state's first num_tokens tokens."""
        del state.token_ids[num_tokens:]
        self._note_tokens(state)

    def _note_tokens(self, state: RunnerRequestState) -> None:
        token_ids, row = state.token_ids, state.row
        self.num_tokens[row] = len(token_ids)
        self.last_token[row] = token_ids[-1] if token_ids else 0

    def _grow_columns(self, num_rows: int) -> None:
        for name in ("num_computed", "num_tokens", "last_token", "wants_prompt_logprobs"):
            column = getattr(self, name)
            grown = np.zeros(num_rows, dtype=column.dtype)
            grown[: len(column)] = column
            setattr(self, name, grown)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_req_ids: list[str]  # requests that sample this step, in logits order
    logits_indices: torch.Tensor  # one row per sampling request; 1 + k for one verifying k drafts
    prompt_logprobs: list[PromptLogprobsSlice] = field(default_factory=list)
    # With LoRA adapters: the flat batch's rows in order as (adapter id, 0 for the base model; rows), and the step's
    # adapters by id.
    adapter_segments: list[tuple[int, int]] = field(default_factory=list)
    adapters: dict[int, LoRARequest] = field(default_factory=dict)
    # Where each request's tokens lie in the flat batch: the decodes at rows 0, 1, ... in decode_request_ids' order,
    # then each prompt chunk as (request id, its first row, its rows, its first token's position).
    decode_request_ids: list[str] = field(default_factory=list)
    chunk_spans: list[tuple[str, int, int, int]] = field(default_factory=list)


def prepare_inputs(requests: RunnerRequests, num_scheduled_tokens: dict[str, int], block_size: int,
                   attn_backend: AttentionBackend, device: torch.device, with_adapters: bool = False) -> ModelInputs:
    # Decodes (one query token) first: attention takes them in one batched call.
    batch = _FlatBatch(block_size)
    if sum(num_scheduled_tokens.values()) == len(num_scheduled_tokens):  # one token each: decodes only, as most steps
        decode_ids, chunks = list(num_scheduled_tokens), []
    else:
        decode_ids = [request_id for request_id, num_tokens in num_scheduled_tokens.items() if num_tokens == 1]
        chunks = [(requests[request_id], num_tokens) for request_id, num_tokens in num_scheduled_tokens.items() if num_tokens != 1]
    batch.add_decodes(decode_ids, requests)
    if with_adapters:  # each adapter's chunks side by side: one product over all of them
        chunks.sort(key=lambda chunk: chunk[0].lora_request.lora_int_id if chunk[0].lora_request else 0)
    for state, num_tokens in chunks:
        batch.add_chunk(state, int(requests.num_computed[state.row]), num_tokens)
    inputs = batch.inputs(attn_backend, device)
    if with_adapters:
        rows = [(state, 1) for state in requests.of(decode_ids)] + chunks
        inputs.adapter_segments = [(state.lora_request.lora_int_id if state.lora_request else 0, n) for state, n in rows]
        inputs.adapters = {state.lora_request.lora_int_id: state.lora_request for state, _ in rows if state.lora_request}
    return inputs


class _FlatBatch:
    """One step's requests laid end to end. The decodes are laid out with array operations over all of them at once,
    from the requests' columns; a prompt chunk's rows are arrays of its own."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.decode_ids = np.zeros(0, dtype=np.int64)
        self.decode_positions = np.zeros(0, dtype=np.int64)
        self.decode_slots = np.zeros(0, dtype=np.int64)
        self.decode_tables = np.zeros((0, 1), dtype=np.int64)
        self.chunk_ids: list[np.ndarray] = []
        self.chunk_slots: list[np.ndarray] = []
        self.chunk_positions: list[np.ndarray] = []
        self.chunk_query_lens: list[int] = []
        self.chunk_seq_lens: list[int] = []
        self.chunk_tables: list[np.ndarray] = []
        self.sampling_req_ids: list[str] = []
        self.logits_indices: list[np.ndarray | list[int]] = []  # pieces, in order
        self.prompt_slices: list[PromptLogprobsSlice] = []
        self.decode_request_ids: list[str] = []
        self.chunk_spans: list[tuple[str, int, int, int]] = []
        self.offset = 0

    def add_decodes(self, request_ids: list[str], requests: RunnerRequests) -> None:
        """Every decode of the step (one token each), in this order; called first and once."""
        self.offset = len(request_ids)
        self.decode_request_ids = request_ids
        if not request_ids:
            return
        rows = requests.rows_of(request_ids)
        positions = requests.num_computed[rows]
        ids = requests.last_token[rows]  # a gather: the batch's own array
        # A decode whose token is not its last known one (a prompt's, not its last) samples nothing; its token is read
        # from its state.
        samples = positions + 1 == requests.num_tokens[rows]
        if samples.all():
            self.sampling_req_ids.extend(request_ids)
            self.logits_indices.append(np.arange(len(request_ids)))
        else:
            sampling = np.flatnonzero(samples)
            self.sampling_req_ids.extend(request_ids[offset] for offset in sampling.tolist())
            self.logits_indices.append(sampling)
            for offset in np.flatnonzero(~samples).tolist():
                ids[offset] = requests[request_ids[offset]].token_ids[positions[offset]]
        for offset in np.flatnonzero(requests.wants_prompt_logprobs[rows]).tolist():
            position = int(positions[offset])
            self._add_prompt_slice(requests[request_ids[offset]], position, position + 1, offset)
        block_size = self.block_size
        self.decode_ids, self.decode_positions = ids, positions
        last_block = positions // block_size
        table_ids = requests.block_tables.ids
        self.decode_slots = table_ids[rows, last_block] * block_size + positions % block_size
        # Each row as far as the longest sequence's blocks; past its own, whatever its row holds (readers go by
        # decode_seq_lens).
        self.decode_tables = table_ids[rows, : int(last_block.max()) + 1]

    def add_chunk(self, state: RunnerRequestState, start: int, num_tokens: int) -> None:
        """num_tokens of the state's tokens from position start on."""
        end = start + num_tokens
        token_positions = np.arange(start, end)
        block_ids = np.asarray(state.block_ids, dtype=np.int64)
        self.chunk_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        self.chunk_positions.append(token_positions)
        self.chunk_slots.append(block_ids[token_positions // self.block_size] * self.block_size + token_positions % self.block_size)
        self.chunk_tables.append(block_ids[: -(-end // self.block_size)])
        self.chunk_query_lens.append(num_tokens)
        self.chunk_seq_lens.append(end)
        offset = self.offset
        self.chunk_spans.append((state.request_id, offset, num_tokens, start))
        if end == len(state.token_ids):
            self.sampling_req_ids.append(state.request_id)
            if state.num_drafts:  # the target's logits after the last known token and after each draft
                self.logits_indices.append(list(range(offset + num_tokens - 1 - state.num_drafts, offset + num_tokens)))
            else:
                self.logits_indices.append([offset + num_tokens - 1])
        if state.sampling_params.prompt_logprobs is not None:
            self._add_prompt_slice(state, start, end, offset)
        self.offset = offset + num_tokens

    def _add_prompt_slice(self, state: RunnerRequestState, start: int, end: int, offset: int) -> None:
        prompt_slice = _prompt_logprobs_slice(state, start, end, offset)
        if prompt_slice is not None:
            self.prompt_slices.append(prompt_slice)

    def inputs(self, attn_backend: AttentionBackend, device: torch.device) -> ModelInputs:
        def flat(decode_values: np.ndarray, chunk_values: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([decode_values, *chunk_values]) if chunk_values else decode_values

        layout = BatchLayout(flat(self.decode_slots, self.chunk_slots), self.decode_positions + 1, self.decode_tables,
                             self.chunk_query_lens, self.chunk_seq_lens, self.chunk_tables)
        return ModelInputs(
            input_ids=torch.from_numpy(flat(self.decode_ids, self.chunk_ids)).to(device),
            positions=torch.from_numpy(flat(self.decode_positions, self.chunk_positions)).to(device),
            attn_metadata=attn_backend.build_metadata(layout, device),
            sampling_req_ids=self.sampling_req_ids,
            logits_indices=torch.from_numpy(np.concatenate(self.logits_indices, dtype=np.int64) if self.logits_indices
                                            else np.zeros(0, dtype=np.int64)).to(device),
            prompt_logprobs=self.prompt_slices,
            decode_request_ids=self.decode_request_ids,
            chunk_spans=self.chunk_spans,
        )


def dummy_layout(num_seqs: int, seq_len: int, context: int, block_size: int) -> BatchLayout:
    """num_seqs sequences of seq_len new tokens after `context` tokens, on blocks 0, 1, 2, ... in turn
    (for timing the bare forward pass; whatever the blocks hold stands in for the context's K/V)."""
    total = context + seq_len
    blocks_per_seq = -(-total // block_size)
    tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int64).reshape(num_seqs, blocks_per_seq)
    slots = np.concatenate([np.arange(context, total) + table[0] * block_size for table in tables])
    if seq_len == 1:
        return BatchLayout(slots, np.full(num_seqs, total, dtype=np.int64), tables, [], [], [])
    return BatchLayout(slots, np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int64), [seq_len] * num_seqs,
                       [total] * num_seqs, list(tables))


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
