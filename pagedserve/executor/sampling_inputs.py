"""What the sampler needs of a batch of requests (SamplingMetadata). Most of it (each row's filters, penalties,
logprobs, which rows have a min_tokens) changes only when the batch's requests do, so it is built once for a run
of steps over the same requests; what moves every step (min_tokens bans, draw keys) is read per step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.input_batch import RunnerRequestState
from pagedserve.layers.sampler import SamplingMetadata
from pagedserve.layers.sampling_rule import DrawKeys, FilterColumns


@dataclass
class _BatchColumns:
    """What sampling reads of a batch that changes only with its requests."""

    filters: FilterColumns
    all_greedy: bool
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # presence, frequency, repetition
    max_num_logprobs: int | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # SamplingMetadata.logit_bias
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # SamplingMetadata.allowed_token_ids
    min_tokens_rows: list[tuple[int, int, list[int]]]  # (row, min_tokens, stop ids to forbid) of rows with min_tokens
    draw_keys: np.ndarray  # [R] int64: each row's draw key (DrawKeys.key_of its seed)
    seeded_rows: list[int]  # rows whose counter is their output position; the others take the engine's next counters
    unseeded: np.ndarray  # [R] bool


class SamplingInputs:
    def __init__(self, device: torch.device, draw_keys: DrawKeys) -> None:
        self.device = device
        self.draw_keys = draw_keys
        self._batch_key: object = None
        self._columns: _BatchColumns | None = None

    def metadata(self, states: list[RunnerRequestState], for_draws: bool = True, batch_key: object = None) -> SamplingMetadata:
        """The rows' metadata, in order. batch_key: equal keys promise the same requests in the same order (the
        batch's columns are then reused); None builds them afresh."""
        columns = self._columns_of(states, batch_key)
        min_tokens_bans = [(row, banned) for row, min_tokens, banned in columns.min_tokens_rows
                           if states[row].num_output_tokens < min_tokens]
        return SamplingMetadata(
            filters=columns.filters,
            all_greedy=columns.all_greedy,
            presence_penalty=columns.penalties[0] if columns.penalties else None,
            frequency_penalty=columns.penalties[1] if columns.penalties else None,
            repetition_penalty=columns.penalties[2] if columns.penalties else None,
            token_ids=[s.token_ids for s in states] if columns.penalties else [],
            num_prompt_tokens=[s.num_prompt_tokens for s in states] if columns.penalties else [],
            min_tokens_bans=min_tokens_bans,
            max_num_logprobs=columns.max_num_logprobs,
            logit_bias=columns.logit_bias,
            allowed_token_ids=columns.allowed_token_ids,
            draw_keys=self._row_draw_keys(states, columns) if for_draws and not columns.all_greedy else None,
        )

    def _columns_of(self, states: list[RunnerRequestState], batch_key: object) -> _BatchColumns:
        if batch_key is not None and batch_key == self._batch_key:
            return self._columns
        columns = _batch_columns([s.sampling_params for s in states], self.draw_keys, self.device)
        if batch_key is not None:
            self._batch_key, self._columns = batch_key, columns
        return columns

    def _row_draw_keys(self, states: list[RunnerRequestState], columns: _BatchColumns) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, counter) of each row's draw at its next output position, as DrawKeys.at gives them row by row."""
        counters = np.empty(len(states), dtype=np.int64)
        counters[columns.unseeded] = self.draw_keys.take_counters(len(states) - len(columns.seeded_rows))
        for row in columns.seeded_rows:
            counters[row] = states[row].num_output_tokens
        return torch.from_numpy(columns.draw_keys), torch.from_numpy(counters)


def _batch_columns(params: list, draw_keys: DrawKeys, device: torch.device) -> _BatchColumns:
    def column(values) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(device)

    any_penalty = any(p.has_penalties for p in params)
    penalties = None
    if any_penalty:
        # A repetition penalty too small for float32 would become 0, and a forbidden token's -inf times 0 is NaN:
        # it is raised to float32's smallest normal number, which keeps -inf where it is.
        smallest = float(np.finfo(np.float32).tiny)
        penalties = (column([p.presence_penalty for p in params]), column([p.frequency_penalty for p in params]),
                     column([max(p.repetition_penalty, smallest) for p in params]))
    min_tokens_rows = []
    for row, p in enumerate(params):
        if p.min_tokens > 0:
            banned = p.all_stop_token_ids()
            if banned:
                min_tokens_rows.append((row, p.min_tokens, sorted(banned)))
    return _BatchColumns(
        filters=FilterColumns.of(params, device),
        all_greedy=all(p.is_greedy for p in params),
        penalties=penalties,
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        logit_bias=_logit_bias_columns(params, device),
        allowed_token_ids=_allowed_token_columns(params, device),
        min_tokens_rows=min_tokens_rows,
        draw_keys=np.array([draw_keys.key_of(p.seed) for p in params], dtype=np.int64),
        seeded_rows=[row for row, p in enumerate(params) if p.seed is not None],
        unseeded=np.array([p.seed is None for p in params], dtype=bool),
    )


def _logit_bias_columns(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(row, token_id, bias) for row, p in enumerate(params) if p.logit_bias for token_id, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries)
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _allowed_token_columns(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    entries = [(index, token_id) for index, row in enumerate(rows) for token_id in params[row].allowed_token_ids]
    entry_rows, token_ids = zip(*entries)
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(entry_rows, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device))
