"""What a proposer is given and gives back; the runner picks the proposer the speculative config names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.sampling_params import SamplingParams


@dataclass
class DraftInput:
    """One request to draft for, after the step that sampled its last token."""

    token_ids: list[int]  # prompt and outputs, all known
    block_ids: list[int]  # its block table, with slots held beyond its tokens for a draft model's K/V
    params: SamplingParams
    # (key, counter) of each draft position (layers/sampling_rule.py): a draft model draws with them.
    draw_keys: list[tuple[int, int]]


@dataclass
class Proposal:
    token_ids: list[int]  # may be fewer than k, or none
    probabilities: torch.Tensor | None = None  # [len(token_ids), V] the distributions they were drawn from; None: point masses


class Proposer(Protocol):
    k: int  # drafts per request, at most

    def propose(self, requests: list[DraftInput]) -> list[Proposal]: ...
