"""Verification of draft tokens against the target model, exact in distribution.

For draft token d_i (i = 1..k) with target distribution p_i (the distribution normal sampling draws from:
layers/sampling_rule.py, after penalties) and draft distribution q_i: accept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the normalized residual (p_i - q_i)+ and
stop; if all k are accepted draw one more token from p_{k+1}, exactly as normal sampling would at that position.
The output then follows the target model exactly (Leviathan et al., 2023). A prompt-lookup draft is a point
mass: q_i(d_i) = 1. Greedy requests accept while the draft equals the target's argmax. Every random number is the
request's keyed Philox number at the position concerned (sampling_rule's draw rule, on streams of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.sampler import argmax
from pagedserve.layers.sampling_rule import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    FilterColumns,
    draw,
    filtered_distribution,
    philox_uniform,
    philox_uniforms,
    sample,
)
from pagedserve.sampling_params import SamplingParams


@dataclass
class Verification:
    accepted: list[int]  # the draft tokens accepted, in order
    token_id: int  # the token drawn after them (a correction, or the bonus when all were accepted)


def target_probabilities(logits: torch.Tensor, params: SamplingParams | list[SamplingParams]) -> torch.Tensor:
    """[rows, V] processed logits (penalties applied) -> [rows, V] float64: the distributions normal sampling draws
    from, under one request's parameters or each row's own."""
    per_row = params if isinstance(params, list) else [params] * logits.shape[0]
    return filtered_distribution(logits, FilterColumns.of(per_row, logits.device))


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, draw_keys: list[tuple[int, int]],
           draft_probs: torch.Tensor | None = None, cpu_kernels=None) -> Verification:
    """logits: [k + 1, V], processed (penalties and min_tokens bans applied per position); drafts: k tokens;
    draw_keys: (key, counter) of the k + 1 positions; draft_probs: [k, V] for a draft model, None for point-mass drafts."""
    if params.is_greedy:
        picks = argmax(logits.float().contiguous(), cpu_kernels).tolist()
        accepted = []
        for draft, pick in zip(drafts, picks):
            if draft != pick:
                return Verification(accepted, pick)
            accepted.append(draft)
        return Verification(accepted, picks[len(drafts)])
    probabilities = target_probabilities(logits[: len(drafts)].float(), params) if drafts else None
    keys, counters = zip(*draw_keys[: len(drafts)]) if drafts else ((), ())
    acceptance_uniforms = philox_uniforms(keys, counters, ACCEPT_STREAM)
    accepted = []
    for position, draft in enumerate(drafts):
        p = probabilities[position]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[position, draft])
        key, counter = draw_keys[position]
        if float(acceptance_uniforms[position]) * q_draft < float(p[draft]):  # probability min(1, p / q)
            accepted.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[position].double(), min=0.0)
        return Verification(accepted, draw(residual, philox_uniform(key, counter, RESIDUAL_STREAM)))
    # All accepted: the next token is drawn as normal sampling draws it.
    key, counter = draw_keys[len(drafts)]
    bonus = sample(logits[len(drafts):].float().contiguous(), FilterColumns.of([params], logits.device),
                   torch.tensor([key]), torch.tensor([counter]), cpu_kernels)
    return Verification(accepted, int(bonus[0]))
