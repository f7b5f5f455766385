"""Sampling on the device: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs.

On CPU with the C++ kernels, penalties and the filtered draw run in csrc/sampling.cpp: one pass per
row, one counter-based uniform number per draw (keyed by a seed, counted by position: draw_keys).
Elsewhere the torch path below runs (sorting filters, an exponential race with torch generators); it is
also the reference the kernels are tested against, in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.outputs import LogprobsLists


@dataclass
class SamplingMetadata:
    """One row per sampling request, in logits order."""

    temperature: torch.Tensor  # [R] float; 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [R] float
    min_p: torch.Tensor | None  # [R] float
    presence_penalty: torch.Tensor | None  # [R]; None when no row has any penalty
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    token_ids: list[list[int]]  # each row's prompt and outputs, for the penalties (empty when none)
    num_prompt_tokens: list[int]
    # rows still under min_tokens: (row, stop token ids to forbid)
    min_tokens_bans: list[tuple[int, list[int]]]
    max_num_logprobs: int | None  # largest top-N asked; None when no row wants logprobs
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # torch path: rows with their own seed
    # Kernel path: each row's draw as (key, counter) of the counter-based generator: [R] int64 each.
    draw_keys: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None, cpu_kernels=None) -> None:
        self.default_generator = default_generator
        self.cpu_kernels = cpu_kernels  # the C++ kernels (CPU); None: the torch path

    @property
    def uses_kernels(self) -> bool:
        """Whether draws are keyed (SamplingMetadata.draw_keys) rather than drawn from torch generators."""
        return self.cpu_kernels is not None

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (sampled token ids [R], raw logprobs [R, V] or None). Logprobs are the model's, before any processing."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.process_logits(logits, meta)
        kernels = self.cpu_kernels if logits.device.type == "cpu" else None
        if meta.all_greedy:
            return argmax(logits, kernels), raw_logprobs
        if kernels is not None and meta.draw_keys is not None:
            return self._sample_in_kernel(kernels, logits.contiguous(), meta), raw_logprobs
        greedy = argmax(logits, kernels)
        sampled = self._sample_random(logits, meta)
        return torch.where(meta.temperature == 0, greedy, sampled), raw_logprobs

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """float32 logits with min_tokens bans and penalties applied: what temperature and the filters act on."""
        if meta.min_tokens_bans:
            logits = logits.clone()
            for row, banned in meta.min_tokens_bans:
                logits[row, banned] = float("-inf")
        if meta.presence_penalty is not None:
            logits = apply_penalties(logits, meta, self.cpu_kernels if logits.device.type == "cpu" else None)
        return logits

    @staticmethod
    def _sample_in_kernel(kernels, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        rows = logits.shape[0]
        top_k = meta.top_k if meta.top_k is not None else torch.zeros(rows, dtype=torch.long)
        top_p = meta.top_p if meta.top_p is not None else torch.ones(rows)
        min_p = meta.min_p if meta.min_p is not None else torch.zeros(rows)
        return kernels.sample_rows(logits, meta.temperature, top_k, top_p, min_p, *meta.draw_keys)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.temperature == 0, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        return self._exponential_race(probs, meta.generators)

    def _exponential_race(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """argmax(p / Exp(1)) draws from p; each seeded row uses only its own generator,
        so its draws do not depend on what else is in the batch."""
        noise = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            noise.exponential_(generator=self.default_generator)
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        return argmax(probs.div(noise), self.cpu_kernels)


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size)).clamp(max=vocab_size)
        ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
        remove |= ranks >= k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)  # keeps the smallest set reaching top_p, at least one
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


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
