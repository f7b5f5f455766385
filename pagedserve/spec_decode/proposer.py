"""What a proposer is given and gives back; the runner picks the proposer the speculative config names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams


@dataclass
class DraftInput:
    """One request to draft for, after the step that sampled its last token."""

    token_ids: list[int]  # prompt and outputs, all known
    block_ids: list[int]  # its block table, with slots held beyond its tokens for a draft model's K/V
    params: SamplingParams
    uniforms: np.random.Generator  # its random numbers for this draft (keyed like its sampling draws)


@dataclass
class Proposal:
    token_ids: list[int]  # may be fewer than k, or none
    probabilities: torch.Tensor | None = None  # [len(token_ids), V] the distributions they were drawn from; None: point masses


class Proposer(Protocol):
    def propose(self, requests: list[DraftInput]) -> list[Proposal]: ...
