"""Sampling on the device: allowed tokens, logit biases, min_tokens bans, penalties, then one keyed draw per row by the rule of
layers/sampling_rule.py (temperature, min-p, top-k, top-p; in the C++ kernel on CPU, in torch elsewhere, the same
tokens either way); logprobs of the model's raw distribution."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.layers.sampling_rule import FilterColumns, sample
from pagedserve.outputs import LogprobsLists


@dataclass
class SamplingMetadata:
    """One row per sampling request, in logits order."""

    filters: FilterColumns  # FilterColumns.of the rows' parameters (greedy rows marked)
    all_greedy: bool
    presence_penalty: torch.Tensor | None  # [R]; None when no row has any penalty
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    token_ids: list[list[int]]  # each row's prompt and outputs, for the penalties (empty when none)
    num_prompt_tokens: list[int]
    # rows still under min_tokens: (row, stop token ids to forbid)
    min_tokens_bans: list[tuple[int, list[int]]]
    max_num_logprobs: int | None  # largest top-N asked; None when no row wants logprobs
    # Each row's logit_bias as (rows, token ids, biases), [B] each over all the rows' entries; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The rows with allowed_token_ids, [A], and their entries as (index into those rows, token id), [E] each; None
    # when no row has them.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Each row's draw as (key, counter) (sampling_rule.DrawKeys): [R] int64 each; None when every row is greedy.
    draw_keys: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    def __init__(self, cpu_kernels=None) -> None:
        self.cpu_kernels = cpu_kernels  # the C++ kernels (CPU); None: the torch paths

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (sampled token ids [R], raw logprobs [R, V] or None). Logprobs are the model's, before any processing."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.process_logits(logits, meta)
        kernels = self.cpu_kernels if logits.device.type == "cpu" else None
        if meta.all_greedy:
            return argmax(logits, kernels), raw_logprobs
        return sample(logits.contiguous(), meta.filters, *meta.draw_keys, kernels), raw_logprobs

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """float32 logits with allowed tokens, logit biases, min_tokens bans and penalties applied (vLLM's order, and
        transformers' for a bias before the repetition penalty): what temperature and the filters act on. Out of place
        where any applies: the caller may read the raw logits after."""
        if meta.allowed_token_ids is not None:
            rows, entry_rows, token_ids = meta.allowed_token_ids
            outside = torch.full((len(rows), logits.shape[1]), float("-inf"), device=logits.device)
            outside[entry_rows, token_ids] = 0.0
            logits = logits.index_put((rows,), logits[rows] + outside)
        if meta.logit_bias is not None:
            logits = logits.index_put(meta.logit_bias[:2], meta.logit_bias[2], accumulate=True)
        if meta.min_tokens_bans:
            logits = logits.clone()
            for row, banned in meta.min_tokens_bans:
                logits[row, banned] = float("-inf")
        if meta.presence_penalty is not None:
            logits = apply_penalties(logits, meta, self.cpu_kernels if logits.device.type == "cpu" else None)
        return logits


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, cpu_kernels=None) -> None:
    """Structured outputs: -inf, in place, at every token a row's bitmask forbids. logits [R, V] float32; bitmask
    [M, ceil(V / 32)] int32 (bit j % 32 of word j // 32 set: token j allowed); rows [M] int64, the logits row of each
    bitmask row. On CPU through the C++ kernel when given (the same result)."""
    if cpu_kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        cpu_kernels.apply_token_bitmask_(logits, bitmask, rows)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def argmax(rows: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
    """torch.argmax over the last dimension of [R, V]; on CPU in float32 through the C++ kernel when given
    (the same result, NaN and ties included, several times faster on a row of a large vocabulary)."""
    if (cpu_kernels is not None and rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2
            and rows.is_contiguous() and rows.shape[1] > 0):
        return cpu_kernels.argmax_rows(rows)
    return rows.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata, cpu_kernels=None) -> torch.Tensor:
    """Repetition penalty over each row's prompt and outputs, then frequency and presence over its outputs.
    With the kernels, in place over the tokens each row has seen; else over whole rows in torch."""
    if cpu_kernels is not None:
        lengths = [len(tokens) for tokens in meta.token_ids]
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        flat = torch.from_numpy(np.fromiter((t for tokens in meta.token_ids for t in tokens), dtype=np.int64, count=int(offsets[-1])))
        logits = logits.contiguous()
        cpu_kernels.apply_penalties_(logits, flat, offsets, torch.tensor(meta.num_prompt_tokens, dtype=torch.long),
                                     meta.presence_penalty, meta.frequency_penalty, meta.repetition_penalty)
        return logits
    num_rows, vocab_size = logits.shape
    outputs = [tokens[n:] for tokens, n in zip(meta.token_ids, meta.num_prompt_tokens)]
    prompts = [tokens[:n] for tokens, n in zip(meta.token_ids, meta.num_prompt_tokens)]
    output_counts = _token_counts(outputs, num_rows, vocab_size, logits.device)
    output_mask = output_counts > 0
    repetition = meta.repetition_penalty.unsqueeze(1)
    seen = output_mask | (_token_counts(prompts, num_rows, vocab_size, logits.device) > 0)
    # Repetition penalty (CTRL): shrink positive logits, grow negative ones, over prompt and outputs.
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * output_counts
    return logits - meta.presence_penalty.unsqueeze(1) * output_mask.to(logits.dtype)


def _token_counts(token_lists: list[list[int]], num_rows: int, vocab_size: int, device) -> torch.Tensor:
    counts = torch.zeros(num_rows, vocab_size + 1, device=device)
    max_len = max((len(t) for t in token_lists), default=0)
    if max_len:
        padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[LogprobsLists]:
    """Per row: the given token's logprob and rank, then the row's top-N. logprobs [R, V], token_ids [R]."""
    max_top = max(num_top, default=0)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    chosen, ranks, token_ids = chosen.squeeze(1).tolist(), ranks.tolist(), token_ids.tolist()
    top_values = top_values.tolist() if max_top else None
    top_ids = top_ids.tolist() if max_top else None
    results = []
    for row, n in enumerate(num_top):
        ids = [token_ids[row]] + (top_ids[row][:n] if n else [])
        values = [chosen[row]] + (top_values[row][:n] if n else [])
        results.append(LogprobsLists([ids], [values], [ranks[row]]))
    return results
