"""Speculative decoding's scheduling policy: which drafts a step verifies, the lookahead slots a draft model writes
into, which requests are drafted for after a step, and each request's back-off when its drafts are mostly rejected.

Three kinds of drafts, three names: a request's *pending* drafts (proposed after its last step, kept here), the
drafts a step *verifies* (SchedulerOutput.drafts_to_verify) and the runner's new *proposals*
(ModelRunnerOutput.proposed_drafts), which become pending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from pagedserve.config import SpeculativeConfig
from pagedserve.core.contracts import SpecDecodingStats
from pagedserve.request import Request

# A pause lasts this many drafts' worth of tokens, doubling with each pause in a row up to 2**_MAX_DOUBLINGS times.
_PAUSE_DRAFTS = 8
_MAX_DOUBLINGS = 3


@dataclasses.dataclass
class _Acceptance:
    rate: float = 1.0  # running share of the request's draft tokens accepted (decaying average)
    paused_until: int = 0  # the output length before which it drafts no more
    num_pauses: int = 0  # pauses in a row, without a well-accepted draft between them


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # A draft model writes its proposals' K/V beyond the verified tokens: slots are held for them.
        self.num_lookahead_tokens = config.num_speculative_tokens if config.method == "draft_model" else 0
        self.stats = SpecDecodingStats()
        self._pending: dict[str, list[int]] = {}
        self._acceptance: dict[str, _Acceptance] = {}
        self._decodes_to_come = 0

    # ---- building a step ----------------------------------------------------------------------------

    def begin_step(self, running: Iterable[Request]) -> None:
        """Before the running requests are scheduled: counts the decodes among them."""
        self._decodes_to_come = sum(1 for request in running if request.num_tokens - request.num_computed_tokens == 1)

    def take_drafts(self, request: Request, token_budget: int) -> list[int]:
        """Called for each decode of the step, in order: the pending drafts it verifies, as far as the budget goes
        beyond one token for it and one for each decode after it (no decode is starved for a draft). None stay
        pending: after this step they are stale."""
        self._decodes_to_come -= 1
        drafts = self._pending.pop(request.request_id, None)
        if not drafts:
            return []
        return drafts[: max(token_budget - 1 - self._decodes_to_come, 0)]

    def lookahead_slots(self, request: Request, num_computed_after_step: int) -> int:
        """Slots to hold beyond the step's tokens for the draft model's proposals after it."""
        return self.num_lookahead_tokens if self.num_lookahead_tokens and self._has_room(request, num_computed_after_step) else 0

    def _has_room(self, request: Request, num_computed_after_step: int) -> bool:
        """No lookahead slots (and so no drafts) where none could be used: the request ends with its next token, or
        they would pass max_model_len. A request alone then always fits the cache."""
        max_tokens = request.sampling_params.max_tokens
        ends_next = max_tokens is not None and request.num_output_tokens + 1 >= max_tokens
        return not ends_next and num_computed_after_step + self.num_lookahead_tokens <= self.max_model_len

    def requests_to_draft_for(self, scheduled: Iterable[Request], num_running: int) -> set[str]:
        """After the step is built: the requests the runner drafts for once it has run. Those that will be decoding,
        unless the batch is too large for speculation to pay, their drafting is paused, or a draft model's slots
        could not be held for them."""
        limit = self.config.disable_by_batch_size
        if limit and num_running >= limit:
            return set()
        return {request.request_id for request in scheduled
                if request.num_computed_tokens + 1 >= request.num_tokens and not self._paused(request)
                and (not self.num_lookahead_tokens or self._has_room(request, request.num_computed_tokens))}

    # ---- after the step ---------------------------------------------------------------------------

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's verdict: counted, and the request's acceptance tracked (see _track)."""
        self.stats.observe(num_drafts, num_accepted)
        self._track(request, num_accepted / num_drafts)

    def proposed(self, request: Request, drafts: list[int] | None) -> None:
        """The runner's proposals for a request that goes on: pending for its next step, unless it is paused, cut to
        what it can still use (none past its max_tokens or the context)."""
        if not drafts or self._paused(request):
            return
        room = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        usable = drafts[: max(room - 1, 0)]
        if usable:
            self._pending[request.request_id] = usable

    def preempted(self, request_id: str) -> None:
        """The runner forgets what it knew of the request's drafts (a draft model's probabilities); so does this."""
        self._pending.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._acceptance.pop(request_id, None)

    def _paused(self, request: Request) -> bool:
        acceptance = self._acceptance.get(request.request_id)
        return acceptance is not None and request.num_output_tokens < acceptance.paused_until

    def _track(self, request: Request, rate: float) -> None:
        """Pause a request's drafting while its drafts are mostly rejected: every rejected draft token costs a
        slot in the step. The running rate weighs the latest draft as much as all before it, so a few failures
        pause it; each pause in a row lasts twice as long; after one it resumes just above the limit, so that
        one more failure pauses it again."""
        minimum = self.config.min_acceptance_rate
        acceptance = self._acceptance.setdefault(request.request_id, _Acceptance())
        acceptance.rate = 0.5 * acceptance.rate + 0.5 * rate
        if acceptance.rate >= minimum:
            if rate >= minimum:
                acceptance.num_pauses = 0
            return
        num_tokens = self.config.num_speculative_tokens * _PAUSE_DRAFTS * 2 ** min(acceptance.num_pauses, _MAX_DOUBLINGS)
        acceptance.paused_until = request.num_output_tokens + num_tokens
        acceptance.num_pauses += 1
        acceptance.rate = 1.5 * minimum

    def get_stats(self) -> SpecDecodingStats:
        return dataclasses.replace(self.stats, accepted_per_position=list(self.stats.accepted_per_position))
