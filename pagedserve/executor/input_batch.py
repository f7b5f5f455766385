"""Turn one SchedulerOutput into the flat token batch the model runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.layers.attention import AttentionMetadata, PagedPrefills, PrefillChunk, pad_block_tables
from pagedserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The runner's own copy of a request: it appends the tokens it samples."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs_start: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


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
    logits_indices: torch.Tensor
    prompt_logprobs: list[PromptLogprobsSlice] = field(default_factory=list)


def prepare_inputs(
    states: dict[str, CachedRequestState], num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device
) -> ModelInputs:
    # Decodes (one query token) first: they share one batched attention call.
    order = sorted(num_scheduled_tokens, key=lambda rid: num_scheduled_tokens[rid] != 1)
    input_ids, positions, slots = [], [], []
    sampling_req_ids, logits_indices, prompt_slices, prefills = [], [], [], []
    decode_tables, decode_seq_lens = [], []
    offset = 0
    for request_id in order:
        state, num_tokens = states[request_id], num_scheduled_tokens[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        token_positions = np.arange(start, end)
        block_ids = np.asarray(state.block_ids, dtype=np.int64)
        input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        positions.append(token_positions)
        slots.append(block_ids[token_positions // block_size] * block_size + token_positions % block_size)
        if num_tokens == 1:
            decode_tables.append(block_ids)
            decode_seq_lens.append(end)
        else:
            table = torch.from_numpy(block_ids[: -(-end // block_size)]).to(device)
            prefills.append(PrefillChunk(offset, num_tokens, end, table))
        if end == len(state.token_ids):
            sampling_req_ids.append(request_id)
            logits_indices.append(offset + num_tokens - 1)
        if state.sampling_params.prompt_logprobs is not None:
            prompt_slice = _prompt_logprobs_slice(state, start, end, offset)
            if prompt_slice is not None:
                prompt_slices.append(prompt_slice)
        offset += num_tokens
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        num_decode_tokens=len(decode_tables),
        decode_block_tables=None,
        decode_seq_lens=None,
        prefills=prefills,
        paged_prefills=PagedPrefills.for_kernel(prefills, device),
    )
    if decode_tables:
        fill_decode_metadata(meta, decode_tables, decode_seq_lens, block_size, device)
    return ModelInputs(
        input_ids=torch.from_numpy(np.concatenate(input_ids)).to(device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        attn_metadata=meta,
        sampling_req_ids=sampling_req_ids,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        prompt_logprobs=prompt_slices,
    )


def fill_decode_metadata(meta: AttentionMetadata, tables: list[np.ndarray], seq_lens: list[int], block_size: int, device) -> None:
    padded = pad_block_tables([table[: -(-seq_len // block_size)] for table, seq_len in zip(tables, seq_lens)])
    meta.decode_block_tables = torch.from_numpy(padded).to(device)
    meta.decode_seq_lens = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(device)


def _prompt_logprobs_slice(state: CachedRequestState, start: int, end: int, offset: int) -> PromptLogprobsSlice | None:
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
