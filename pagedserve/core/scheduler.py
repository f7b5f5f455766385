"""Token-budget scheduler with chunked prefill and preemption by recompute (vLLM V1 semantics).

Each step hands out at most max_num_batched_tokens tokens: running requests first (a decode
takes one token, an unfinished prompt its next chunk), then waiting requests in policy order.
While requests decode, the prompt tokens a step takes on are also bounded in time (max_decode_stall):
a model of step times, fit to the steps the engine runs (core/step_time.py), says how many fit.
"""

from __future__ import annotations

import dataclasses

from pagedserve.config import SpeculativeConfig
from pagedserve.core.contracts import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunningRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request_queue import make_waiting_queue
from pagedserve.core.step_time import StepShape, StepTimeModel, chunk_attention_pairs
from pagedserve.request import Request, RequestStatus

# The share of a step's time limit the scheduler plans to fill (the step-time model errs by ~5-10% a step).
_PLANNING_MARGIN = 0.9


class PrefillAllowance:
    """The seconds of prompt work a step may still take on while streams decode. The first chunk of a step
    always gets min_tokens, so prompts progress however tight the limit."""

    def __init__(self, model: StepTimeModel, seconds: float, min_tokens: int) -> None:
        self.model = model
        self.seconds = seconds
        self.min_tokens = min_tokens
        self.granted = False

    def take(self, num_tokens: int, context_len: int) -> int:
        """How many of num_tokens prompt tokens after context_len fit; they are then spent."""
        allowed = self.model.max_chunk(self.seconds, context_len, num_tokens)
        if allowed == 0 and not self.granted:
            allowed = min(num_tokens, self.min_tokens)
        if allowed:
            self.seconds -= self.model.prefill_cost(allowed, context_len)
            self.granted = True
        return allowed


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        max_decode_stall: tuple[str, float] | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.num_preemptions = 0
        # Prompt logprob positions already reported per request, so a recompute does not repeat them.
        self.num_prompt_logprobs_sent: dict[str, int] = {}
        self.max_decode_stall = max_decode_stall  # ("x", multiple of the decode-only step) or ("s", seconds); None: off
        self.step_time = StepTimeModel()
        self.decode_step_time = StepTimeModel()  # decode-only steps alone: the yardstick of a stall
        # Set under pipeline parallelism: every decode carries its last token (SchedulerOutput.last_token_ids).
        self.send_last_tokens = False
        self.speculative = speculative
        # A draft model writes its proposals' K/V beyond the verified tokens: slots are held for them.
        self.num_lookahead_tokens = speculative.num_speculative_tokens if speculative and speculative.method == "draft_model" else 0
        self._without_draft_slots: set[str] = set()  # this step's requests that got no lookahead slots (_lookahead)
        self.spec_stats = SpecDecodingStats() if speculative else None

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use by a running request")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        finished = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            spec=dataclasses.replace(self.spec_stats, accepted_per_position=list(self.spec_stats.accepted_per_position))
            if self.spec_stats else None,
        )

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        running_reqs: list[RunningRequestData] = []
        preempted_any = False
        allowance = self._prefill_allowance()
        decode_tokens = prefill_tokens = 0
        attention_pairs = 0.0
        last_token_ids: dict[str, tuple[int, int]] = {}
        spec_token_ids: dict[str, list[int]] = {}
        self._without_draft_slots.clear()

        index = 0
        allocate_slots = self.kv_cache_manager.allocate_slots
        # Drafts only take budget that the decodes after them do not need: no decode is starved for a draft.
        decodes_to_come = sum(1 for r in self.running if len(r.all_token_ids) - r.num_computed_tokens == 1) if self.speculative else 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = len(request.all_token_ids) - request.num_computed_tokens
            if num_new_tokens == 0:  # its last step is still in the pipeline: its next token is not known yet
                index += 1
                continue
            drafts = request.spec_token_ids
            if num_new_tokens > 1:  # an unfinished prompt: chunk it
                num_new_tokens = self._chunk_size(num_new_tokens, token_budget, request.num_computed_tokens, allowance)
                if num_new_tokens == 0:  # no time left in this step for its chunk
                    index += 1
                    continue
            else:
                decodes_to_come -= 1
                if drafts:  # a decode that verifies its drafts too, as far as the budget goes; the rest are stale after it
                    request.spec_token_ids = []
                    drafts = drafts[: max(token_budget - 1 - decodes_to_come, 0)]
                    num_new_tokens += len(drafts)
            new_blocks = None
            while True:
                lookahead = self._lookahead(request, request.num_computed_tokens, num_new_tokens)
                new_blocks = allocate_slots(request, num_new_tokens, None, lookahead)
                if new_blocks is not None:
                    break
                victim = self._preempt_one(first_candidate=index)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            if new_blocks:
                num_blocks = len(self.kv_cache_manager.req_to_blocks[request.request_id])
                running_reqs.append(RunningRequestData(request.request_id, [b.block_id for b in new_blocks], num_blocks - len(new_blocks)))
            num_scheduled_tokens[request.request_id] = num_new_tokens
            if drafts:
                spec_token_ids[request.request_id] = drafts
                request.spec_token_ids = []
            if num_new_tokens == 1 or drafts:
                decode_tokens += num_new_tokens
                attention_pairs += num_new_tokens * (request.num_computed_tokens + 1)
                if self.send_last_tokens:
                    last_token_ids[request.request_id] = (len(request.all_token_ids) - 1, request.all_token_ids[-1])
            else:
                prefill_tokens += num_new_tokens
                attention_pairs += chunk_attention_pairs(num_new_tokens, request.num_computed_tokens)
            request.num_computed_tokens += num_new_tokens
            token_budget -= num_new_tokens
            index += 1

        # New prompts only when nothing was preempted: memory is tight, let the running ones finish.
        if not preempted_any:
            token_budget, new_tokens, new_pairs = self._schedule_waiting(token_budget, num_scheduled_tokens, new_reqs, allowance)
            prefill_tokens += new_tokens
            attention_pairs += new_pairs

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_running_reqs=running_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            shape=StepShape(decode_tokens, prefill_tokens, attention_pairs),
            last_token_ids=last_token_ids,
            spec_token_ids=spec_token_ids,
            propose_for=self._propose_for(num_scheduled_tokens) if self.speculative else set(),
        )
        self.finished_req_ids = set()
        return output

    def _lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Slots held beyond this step's tokens for the draft model's proposals after it. None where no draft could
        be used (the request ends with its next token) or they would pass max_model_len: then a request alone
        always fits the cache, and it is not drafted for after this step."""
        k = self.num_lookahead_tokens
        if not k:
            return 0
        max_tokens = request.sampling_params.max_tokens
        if (max_tokens is not None and request.num_output_tokens + 1 >= max_tokens) or (
                num_computed_tokens + num_new_tokens + k > self.max_model_len):
            self._without_draft_slots.add(request.request_id)
            return 0
        return k

    def _propose_for(self, num_scheduled_tokens: dict[str, int]) -> set[str]:
        """The requests the runner drafts for after this step: those that will be decoding, unless the batch is
        too large for speculation to pay, or a request's drafts have been accepted too rarely (_track_acceptance)."""
        limit = self.speculative.disable_by_batch_size
        if limit and len(self.running) >= limit:
            return set()
        chosen = set()
        for request_id in num_scheduled_tokens:
            request = self.requests[request_id]
            if (request.num_computed_tokens + 1 >= request.num_tokens and request.num_output_tokens >= request.spec_paused_until
                    and request_id not in self._without_draft_slots):
                chosen.add(request_id)
        return chosen

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """How long a step of this shape took (to the step-time model)."""
        if shape.decode_tokens or shape.prefill_tokens:
            self.step_time.observe(shape, seconds)
        if shape.decode_tokens and not shape.prefill_tokens:
            self.decode_step_time.observe(shape, seconds)

    def _decode_only_seconds(self, shape: StepShape) -> float:
        # Fit to decode-only steps alone where there are enough: the fit over all steps is dominated by the
        # steps with prompts, and misjudges by 10-20% the decode-only step a stall is measured against.
        model = self.decode_step_time if self.decode_step_time.num_observations >= 3 else self.step_time
        return model.predict(shape)

    def _prefill_allowance(self) -> PrefillAllowance | None:
        """What bounds this step's prompt work in time: None when nothing does (no limit set, the model not yet
        fit, no request decoding, so that no stream waits for the prompts, or no prompt to bound)."""
        if self.max_decode_stall is None or not self.step_time.ready:
            return None
        decode_tokens, pairs, prompt_work = 0, 0.0, bool(self.waiting)
        for request in self.running:
            if len(request.all_token_ids) - request.num_computed_tokens == 1:
                decode_tokens += 1
                pairs += request.num_computed_tokens + 1
            else:
                prompt_work = True
        if not decode_tokens or not prompt_work:
            return None
        decode_only = self._decode_only_seconds(StepShape(decode_tokens, 0, pairs))
        kind, value = self.max_decode_stall
        if kind == "x":
            # The decode-only step of the batch these prompts are joining, not of the few streams that may be
            # decoding when they arrive: the waiting requests decode too, as soon as their prompts are in.
            batch = min(len(self.running) + len(self.waiting), self.max_num_seqs)
            target = value * self._decode_only_seconds(StepShape(batch, 0, pairs * batch / decode_tokens))
        else:
            target = value
        # Planned a little under the limit: a plan at the limit overshoots it about half the time.
        return PrefillAllowance(self.step_time, _PLANNING_MARGIN * target - decode_only, min_tokens=self.kv_cache_manager.block_size)

    def _schedule_waiting(self, token_budget: int, num_scheduled_tokens: dict, new_reqs: list,
                          allowance: PrefillAllowance | None) -> tuple[int, int, float]:
        """-> (token budget left, prompt tokens scheduled, their attention pairs)."""
        skipped = []
        prefill_tokens, attention_pairs = 0, 0.0
        while len(self.waiting) > 0 and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if self._sibling_is_prefilling(request):
                # Wait for the sibling's prompt blocks, then reuse them from the prefix cache.
                skipped.append(self.waiting.pop())
                continue
            computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._chunk_size(request.num_tokens - num_computed_tokens, token_budget, num_computed_tokens, allowance)
            if num_new_tokens == 0:  # no time left in this step
                break
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks,
                                                              self._lookahead(request, num_computed_tokens, num_new_tokens))
            if new_blocks is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            request.num_computed_tokens = num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.block_ids(request.request_id),
                    num_computed_tokens=num_computed_tokens,
                    prompt_logprobs_start=self.num_prompt_logprobs_sent.get(request.request_id, 0),
                )
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            prefill_tokens += num_new_tokens
            attention_pairs += chunk_attention_pairs(num_new_tokens, num_computed_tokens)
            request.num_computed_tokens += num_new_tokens
            token_budget -= num_new_tokens
        for request in reversed(skipped):
            self.waiting.add_front(request)
        return token_budget, prefill_tokens, attention_pairs

    def _chunk_size(self, num_remaining_tokens: int, token_budget: int, context_len: int, allowance: PrefillAllowance | None) -> int:
        num_tokens = min(num_remaining_tokens, token_budget)
        if self.long_prefill_token_threshold > 0:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        if allowance is not None:
            num_tokens = allowance.take(num_tokens, context_len)
        return num_tokens

    def _sibling_is_prefilling(self, request: Request) -> bool:
        """True while another sample of the same request has prompt tokens left after this step
        (counts already include this step; blocks computed within it are cached, as K/V are written
        before attention reads them)."""
        if request.group_id is None or not self.kv_cache_manager.enable_caching:
            return False
        return any(
            other.group_id == request.group_id and other.num_computed_tokens < other.num_prompt_tokens for other in self.running
        )

    def _preempt_one(self, first_candidate: int) -> Request:
        """Free the running request that matters least (lowest priority, then the latest arrival) among
        those not yet scheduled in this step: running[first_candidate:], the current one included."""
        candidates = self.running[first_candidate:]
        if self.policy == "priority":
            victim = max(candidates, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = max(candidates, key=lambda r: r.arrival_time)
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # the runner forgets what it knew of them (a draft model's probabilities)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(victim.request_id)
        self.waiting.add_front(victim)
        return victim

    # ---- after the model ran ---------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # Runs for every scheduled request each step (256 at a time in `bench sched`): lookups are
        # hoisted, and the logprob maps are read only when the step produced any.
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        get_request, get_sampled = self.requests.get, runner_output.sampled_token_ids.get
        logprobs, prompt_logprobs_of = runner_output.logprobs, runner_output.prompt_logprobs
        spec_token_ids, accepted_of = scheduler_output.spec_token_ids, runner_output.accepted_token_ids
        proposals = runner_output.spec_token_ids
        max_model_len = self.max_model_len
        for request_id in scheduler_output.num_scheduled_tokens:
            request = get_request(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or, with steps in flight, preempted) while the step ran
            new_token_ids = []
            finish_reason = None
            token_id = get_sampled(request_id)
            if token_id is not None:
                if spec_token_ids and request_id in spec_token_ids:
                    finish_reason = self._apply_verified(request, spec_token_ids[request_id], accepted_of.get(request_id, []), token_id,
                                                         new_token_ids)
                else:
                    request.append_output_token(token_id)
                    new_token_ids.append(token_id)
                    if request.check_stop(max_model_len):
                        finish_reason = request.status.finish_reason
                if finish_reason is not None:
                    stopped.append(request)
                elif proposals and request.num_output_tokens >= request.spec_paused_until:  # not paused by this step's verdict
                    request.spec_token_ids = self._usable_drafts(request, proposals.get(request_id))
            prompt_logprobs = prompt_logprobs_of.get(request_id) if prompt_logprobs_of else None
            if prompt_logprobs is not None:
                sent = self.num_prompt_logprobs_sent.get(request_id, 0)
                self.num_prompt_logprobs_sent[request_id] = sent + len(prompt_logprobs.ranks)
            elif not new_token_ids:
                continue
            token_logprobs = logprobs.get(request_id) if logprobs else None
            if token_logprobs is not None and len(token_logprobs.ranks) > len(new_token_ids):  # a stop inside verified drafts
                token_logprobs = token_logprobs.head(len(new_token_ids))
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    token_logprobs,
                    prompt_logprobs,
                    finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                )
            )
        for request in stopped:
            self.running.remove(request)
            self._free_request(request)
        return outputs

    def _apply_verified(self, request: Request, drafts: list[int], accepted: list[int], token_id: int, new_token_ids: list) -> str | None:
        """Append a verification's accepted drafts and its sampled token, stopping at a stop token or a length
        limit; roll num_computed_tokens back over the rejected drafts and give back the blocks only they used.
        Returns the finish reason, if it finished."""
        self.spec_stats.observe(len(drafts), len(accepted))
        self._track_acceptance(request, len(accepted) / len(drafts))
        for token in (*accepted, token_id):
            request.append_output_token(token)
            new_token_ids.append(token)
            if request.check_stop(self.max_model_len):
                return request.status.finish_reason
        # K/V is computed for the last known token's predecessors only: rejected drafts' slots are free again.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.trim(request)
        return None

    def _track_acceptance(self, request: Request, rate: float) -> None:
        """Pause a request's drafting while its drafts are mostly rejected: every rejected draft token costs a
        slot in the step. The running rate weighs the latest draft as much as all before it, so a few failures
        pause it; each pause in a row lasts twice as long (from 8 drafts' worth of tokens up to 64); after one
        it resumes just above the limit, so that one more failure pauses it again."""
        minimum = self.speculative.min_acceptance_rate
        request.spec_acceptance = 0.5 * request.spec_acceptance + 0.5 * rate
        if request.spec_acceptance >= minimum:
            if rate >= minimum:
                request.spec_num_pauses = 0
            return
        num_tokens = self.speculative.num_speculative_tokens * 8 * 2 ** min(request.spec_num_pauses, 3)
        request.spec_paused_until = request.num_output_tokens + num_tokens
        request.spec_num_pauses += 1
        request.spec_acceptance = 1.5 * minimum

    def _usable_drafts(self, request: Request, drafts: list[int] | None) -> list[int]:
        """Drafts the request can still use: none past its max_tokens or the context."""
        if not drafts:
            return []
        room = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        return drafts[: max(room - 1, 0)]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.num_prompt_logprobs_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
