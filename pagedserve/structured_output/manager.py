"""The engine core's grammar states (the scheduler side of vLLM's split). A constrained request's grammar compiles in
a thread, off the step loop, and the scheduler admits the request once it has; its matcher then follows every token
the request gains. Each step, the rows of the masks the runner applies before sampling: one for each position a
constrained request samples, drafts included (their prefix that the grammar allows is all a step verifies). With a
reasoning model's format (reasoning_parser), a request's grammar follows only its answer: its reasoning goes unmasked
(reasoning_gate.py)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.core.contracts import GrammarBitmask, SchedulerOutput
from pagedserve.reasoning_format import ReasoningFormat
from pagedserve.request import Request
from pagedserve.structured_output.grammar_compiler import GrammarCompiler, StructureError
from pagedserve.structured_output.reasoning_gate import OPENING, REASONING, ReasoningGate

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, reasoning: ReasoningFormat | None = None) -> None:
        """reasoning: where the model's output holds its reasoning, which no grammar constrains (None: no reasoning)."""
        self.compiler = compiler
        self._gate = ReasoningGate(reasoning, compiler.tokenizer) if reasoning is not None else None
        self._phases: dict[str, str] = {}  # request id -> reasoning phase, until its answer begins
        self.words_per_row = -(-compiler.vocab_size // 32)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, Future] = {}
        self._matchers: dict[str, object] = {}  # request id -> xgrammar.GrammarMatcher

    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            self._compiling[request.request_id] = self._pool.submit(self.compiler.compile, spec)

    def is_ready(self, request: Request) -> bool:
        """Whether the request can be scheduled as far as its grammar goes: unconstrained, or its grammar compiled.
        Raises StructureError when the grammar failed to compile."""
        future = self._compiling.get(request.request_id)
        if future is None:
            return True
        if not future.done():
            return False
        del self._compiling[request.request_id]
        import xgrammar as xgr  # loaded with the first grammar (the compile thread imported it)

        self._matchers[request.request_id] = xgr.GrammarMatcher(future.result())  # it can step back over any number of tokens
        if self._gate is not None:
            self._phases[request.request_id] = self._gate.first_phase
        return True

    def remove(self, request_id: str) -> None:
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()
        self._matchers.pop(request_id, None)
        self._phases.pop(request_id, None)

    @property
    def has_constrained(self) -> bool:
        return bool(self._matchers)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def allowed_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The prefix of a constrained request's drafts that its grammar allows (the rest could never be accepted)."""
        phase = self._phases.get(request_id)
        if phase is not None:
            return self._gate.drafts_to_verify(phase, drafts)
        matcher = self._matchers[request_id]
        num_allowed = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_allowed += 1
        if num_allowed:
            matcher.rollback(num_allowed)
        return drafts[:num_allowed]

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance a request's grammar over the tokens it gained; False if the grammar refused one (the request
        cannot go on under its structure)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        phase = self._phases.get(request_id)
        if phase is not None and token_ids:
            phase, token_ids = self._gate.advance(phase, token_ids)
            if phase is None:
                del self._phases[request_id]
            else:
                self._phases[request_id] = phase
        return all(matcher.accept_token(token_id) for token_id in token_ids)

    def bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The mask rows of the step's constrained requests that sample in it (a prompt chunk short of the prompt's
        end samples nothing, a reasoning goes unmasked), after the step's scheduling advanced their num_computed_tokens."""
        import torch  # xgrammar fills torch tensors; loaded with the first grammar

        scheduled, verified = scheduler_output.num_scheduled_tokens, scheduler_output.drafts_to_verify
        constrained = [request_id for request_id in self._matchers if request_id in scheduled
                       and requests[request_id].num_computed_tokens >= requests[request_id].num_tokens
                       and self._phases.get(request_id) != REASONING]
        if not constrained:
            return None
        num_rows = sum(1 + len(verified.get(request_id, ())) for request_id in constrained)
        rows = torch.empty((num_rows, self.words_per_row), dtype=torch.int32)
        row = 0
        for request_id in constrained:
            matcher, drafts = self._matchers[request_id], verified.get(request_id, ())
            if self._phases.get(request_id) == OPENING:  # no drafts: its first token decides
                matcher.fill_next_token_bitmask(rows, row)
                self._gate.allow_opening(rows.numpy(), row)
                row += 1
                continue
            for token_id in (*drafts, None):
                matcher.fill_next_token_bitmask(rows, row)
                row += 1
                if token_id is not None:
                    matcher.accept_token(token_id)  # allowed: drafts were cut to their allowed prefix
            if drafts:
                matcher.rollback(len(drafts))
        return GrammarBitmask(constrained, rows.numpy().tobytes(), self.words_per_row)  # rows: a fresh contiguous tensor

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["StructuredOutputManager", "StructureError"]
