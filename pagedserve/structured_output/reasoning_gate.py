"""A constrained request of a reasoning model (reasoning_parser): its reasoning is free and its structure holds the
answer after it. The rule is pagedserve/reasoning_format.py's, read off the tokens, so that the answer the front end
sets apart is the text the structure held:

- reasoning: no mask; the </think> token ends it, and the tokens after it are the answer's.
- opening (a format whose output has reasoning only where it begins with <think>): the first token decides. The mask
  is the structure's with <think> allowed beside it; <think> opens the reasoning, any other token is the answer's first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from pagedserve.reasoning_format import ReasoningFormat

REASONING, OPENING = "reasoning", "opening"


class ReasoningGate:
    def __init__(self, form: ReasoningFormat, load_tokenizer: Callable[[], object]) -> None:
        """load_tokenizer: the model's HF tokenizer (its markers' ids are read from it when first needed)."""
        self.form = form
        self._load_tokenizer = load_tokenizer

    @functools.cached_property
    def _markers(self) -> tuple[int, int]:
        return self.form.marker_ids(self._load_tokenizer())

    @property
    def first_phase(self) -> str:
        return REASONING if self.form.starts_inside else OPENING

    def advance(self, phase: str, token_ids: list[int]) -> tuple[str | None, list[int]]:
        """The phase after a request in `phase` gained token_ids (None: its answer has begun), and those of them that
        are the answer's."""
        start, end = self._markers
        if phase == OPENING:
            if token_ids[0] != start:
                return None, token_ids
            phase, token_ids = REASONING, token_ids[1:]
        if end in token_ids:
            return None, token_ids[token_ids.index(end) + 1:]
        return phase, []

    def drafts_to_verify(self, phase: str, drafts: list[int]) -> list[int]:
        """Of a request's drafts, those a step verifies with no mask: the reasoning's before its </think> (the model
        then samples that itself, and the structure masks every position after it); none while the first token
        decides."""
        if phase == OPENING:
            return []
        end = self._markers[1]
        return drafts[:drafts.index(end)] if end in drafts else drafts

    def allow_opening(self, rows: np.ndarray, row: int) -> None:
        """Allow <think> beside the structure's first tokens in a mask row (a bit per token, 32 to a word)."""
        start = self._markers[0]
        rows[row, start // 32] |= np.array(1 << (start % 32), dtype=np.uint32).view(np.int32)
