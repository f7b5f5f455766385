"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a request's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min). Free to compute, and right wherever the output
copies its prompt or itself."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedserve.spec_decode.proposer import DraftInput, Proposal


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftInput]) -> list[Proposal]:
        return [Proposal(self.lookup(request.token_ids)) for request in requests]

    def lookup(self, token_ids: list[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            # Every earlier n-gram against the last one at once; the last one itself is not a candidate.
            earlier = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((earlier == tokens[-n:]).all(axis=1))
            if matches.size:
                start = matches[-1] + n
                return tokens[start : start + self.k].tolist()
        return []
