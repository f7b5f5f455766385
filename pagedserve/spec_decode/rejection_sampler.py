"""Verification of draft tokens against the target model, exact in distribution.

For draft token d_i (i = 1..k) with target distribution p_i (after temperature, min-p, top-k, top-p and
penalties, as normal sampling would use) and draft distribution q_i: accept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the normalized residual (p_i - q_i)+ and
stop; if all k are accepted draw one more token from p_{k+1}. The output then follows the target model
exactly (Leviathan et al., 2023). A prompt-lookup draft is a point mass: q_i(d_i) = 1. Greedy requests
accept while the draft equals the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.layers.sampler import argmax
from pagedserve.sampling_params import SamplingParams


@dataclass
class Verification:
    accepted: list[int]  # the draft tokens accepted, in order
    token_id: int  # the token drawn after them (a correction, or the bonus when all were accepted)


def target_probabilities(logits: torch.Tensor, params: SamplingParams | list[SamplingParams]) -> torch.Tensor:
    """[rows, V] processed logits (penalties applied) -> [rows, V] float64: the distributions normal sampling draws
    from (temperature, then min-p, top-k and top-p as layers/sampler.py applies them), under one request's
    parameters or each row's own."""
    per_row = params if isinstance(params, list) else [params] * logits.shape[0]
    return torch.stack([_filtered_distribution(row, p) for row, p in zip(logits, per_row)])


def _filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.min_p > 0:
        probs = torch.where(probs < probs.max() * params.min_p, 0.0, probs)
    vocab_size = probs.shape[0]
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    if top_k == vocab_size and params.top_p >= 1.0:
        return probs / probs.sum()
    # The largest tokens, in order: the top-k, or (top-p alone) enough of them to hold top_p of the mass. No full
    # sort of the vocabulary: a draft row is filtered once per draft position.
    count = top_k if top_k < vocab_size else min(64, vocab_size)
    values, ids = probs.topk(count)
    mass = values.sum() if top_k < vocab_size else probs.sum()
    while top_k == vocab_size and values.sum() < params.top_p * mass and count < vocab_size:
        count = min(4 * count, vocab_size)
        values, ids = probs.topk(count)
    if params.top_p < 1.0:
        mass_before = torch.cumsum(values, dim=0) - values
        values = torch.where(mass_before < params.top_p * mass, values, 0.0)  # the smallest set reaching top_p
    filtered = torch.zeros_like(probs).index_copy_(0, ids, values)
    return filtered / filtered.sum()


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, uniforms: np.random.Generator,
           draft_probs: torch.Tensor | None = None, cpu_kernels=None) -> Verification:
    """logits: [k + 1, V], processed (penalties and min_tokens bans applied per position); drafts: k tokens;
    draft_probs: [k, V] for a draft model, None for point-mass drafts."""
    if params.is_greedy:
        picks = argmax(logits.float().contiguous(), cpu_kernels).tolist()
        accepted = []
        for draft, pick in zip(drafts, picks):
            if draft != pick:
                return Verification(accepted, pick)
            accepted.append(draft)
        return Verification(accepted, picks[len(drafts)])
    probabilities = target_probabilities(logits.float(), params)
    accepted = []
    for position, draft in enumerate(drafts):
        p = probabilities[position]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[position, draft])
        if uniforms.random() * q_draft < float(p[draft]):  # probability min(1, p / q)
            accepted.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[position].double(), min=0.0)
        return Verification(accepted, draw(residual, uniforms))
    return Verification(accepted, draw(probabilities[len(drafts)], uniforms))


def draw(weights: torch.Tensor, uniforms: np.random.Generator) -> int:
    """A token in proportion to non-negative weights (not necessarily normalized)."""
    cumulative = torch.cumsum(weights, dim=0)
    total = float(cumulative[-1])
    if total <= 0.0:  # the residual vanished to rounding: p and q agree, so any kept token of p will do
        return int(torch.argmax(weights))
    index = int(torch.searchsorted(cumulative, torch.tensor([uniforms.random() * total], dtype=cumulative.dtype), right=True))
    return min(index, len(weights) - 1)
