"""The engine core's grammar states (the scheduler side of vLLM's split). A constrained request's grammar compiles in
a thread, off the step loop, and the scheduler admits the request once it has; its matcher then follows every token
the request gains. Each step, the rows of the masks the runner applies before sampling: one for each position a
constrained request samples, drafts included (their prefix that the grammar allows is all a step verifies)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.core.contracts import GrammarBitmask, SchedulerOutput
from pagedserve.request import Request
from pagedserve.structured_output.grammar_compiler import GrammarCompiler, StructureError

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
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
        return True

    def remove(self, request_id: str) -> None:
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()
        self._matchers.pop(request_id, None)

    @property
    def has_constrained(self) -> bool:
        return bool(self._matchers)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def allowed_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The prefix of a constrained request's drafts that its grammar allows (the rest could never be accepted)."""
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
        return all(matcher.accept_token(token_id) for token_id in token_ids)

    def bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The mask rows of the step's constrained requests that sample in it (a prompt chunk short of the prompt's
        end samples nothing), after the step's scheduling advanced their num_computed_tokens."""
        import torch  # xgrammar fills torch tensors; loaded with the first grammar

        scheduled, verified = scheduler_output.num_scheduled_tokens, scheduler_output.drafts_to_verify
        constrained = [request_id for request_id in self._matchers if request_id in scheduled
                       and requests[request_id].num_computed_tokens >= requests[request_id].num_tokens]
        if not constrained:
            return None
        num_rows = sum(1 + len(verified.get(request_id, ())) for request_id in constrained)
        rows = torch.empty((num_rows, self.words_per_row), dtype=torch.int32)
        row = 0
        for request_id in constrained:
            matcher, drafts = self._matchers[request_id], verified.get(request_id, ())
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
