"""Token-budget scheduler with chunked prefill and preemption by recompute (vLLM V1 semantics).

Each step hands out at most max_num_batched_tokens tokens: running requests first (a decode
takes one token, an unfinished prompt its next chunk), then waiting requests in policy order.
The step being built is a StepPlan; what else bounds it plugs in beside this loop: the time bound on
prompt work while streams decode (core/stall_bound.py) and speculative decoding's drafts
(core/draft_policy.py). Structured outputs plug in as the engine's grammar states
(structured_output/manager.py): a constrained request waits until its grammar has compiled, its drafts are cut to
what its grammar allows, each step carries the masks of the tokens it may sample, and its grammar follows the tokens
it gains. A KV connector plugs in at admission (how much of a prompt it finds outside) and when a request ends (whether
its blocks stay for another instance to read); one that loads while the engine runs parks the request and its
blocks in core/remote_kv.py until the load ends, and the scheduler takes that news before it plans each step.
"""

from __future__ import annotations

import logging

from pagedserve.config import DecodeStallLimit, SpeculativeConfig
from pagedserve.core.contracts import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pagedserve.core.draft_policy import DraftPolicy
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.remote_kv import RemoteKV
from pagedserve.core.request_queue import make_waiting_queue
from pagedserve.core.stall_bound import DecodeStallBound
from pagedserve.core.step_plan import StepPlan
from pagedserve.core.step_time import ExpertRouting, StepShape
from pagedserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_NO_DRAFTS: list[int] = []  # shared, never changed: a decode without drafts
_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        max_decode_stall: DecodeStallLimit | None = None,
        speculative: SpeculativeConfig | None = None,
        send_last_tokens: bool = False,
        structured_output=None,
        experts: ExpertRouting | None = None,
        max_loras: int | None = None,
        kv_connector=None,
    ) -> None:
        """structured_output: the engine's grammar states (a StructuredOutputManager), None without structured outputs.
        experts: a mixture of experts' routing, which the step-time model prices; None for a dense model.
        max_loras: most distinct LoRA adapters among the running requests (None: LoRA off).
        kv_connector: the scheduler's side of a KV connector (kv_transfer/base.KVConnectorScheduler), or None."""
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(policy)
        self.running: list[Request] = []
        # What the runner must forget, told with the next step: requests that ended, and requests preempted.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Prompt logprob positions already reported per request, so a recompute does not repeat them.
        self.num_prompt_logprobs_sent: dict[str, int] = {}
        self.stall_bound = DecodeStallBound(max_decode_stall, min_chunk_tokens=kv_cache_manager.block_size, experts=experts)
        # Pipeline parallelism: every decode carries its last token (SchedulerOutput.last_token_ids).
        self.send_last_tokens = send_last_tokens
        self.speculative = speculative
        self.drafts = DraftPolicy(speculative, max_model_len) if speculative else None
        self.structured_output = structured_output
        self.max_loras = max_loras
        self.kv_connector = kv_connector
        # Requests whose KV the connector loads while others run, and blocks it holds for other instances.
        self.remote_kv = RemoteKV(kv_cache_manager, kv_connector, kv_connector.transfer.kv_load_failure_policy) if kv_connector else None
        # Requests ended by the engine itself before they ran (a grammar that failed to compile), told with the next
        # step's outputs.
        self._ended_unscheduled: list[EngineCoreOutput] = []
        # Running requests a chunk left one prompt token short: that token is named a prompt chunk (_keep_prompt_tails).
        self._prompt_tails: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or self.remote_kv is not None and request.request_id in self.remote_kv.loading:
            raise ValueError(f"request_id {request.request_id!r} is already in use by a running request")
        self.requests[request.request_id] = request
        self.stall_bound.came_to_wait(request)
        self.waiting.add(request)
        if self.structured_output is not None:
            self.structured_output.add_request(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        finished = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_news_for_runner(self) -> bool:
        """Whether the runner must hear of finished or preempted requests even if nothing runs (as the next
        SchedulerOutput.needs_runner says), or the KV connector has news (loads that ended, holds to give back)."""
        return bool(self.finished_req_ids or self.preempted_req_ids) or self.kv_connector is not None and self.kv_connector.has_news()

    def get_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + (len(self.remote_kv.loading) if self.remote_kv else 0),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            spec=self.drafts.get_stats() if self.drafts else None,
            lora_running=_requests_per_adapter(self.running) if self.max_loras else {},
            lora_waiting=_requests_per_adapter(self.waiting) if self.max_loras else {},
            **(self.kv_connector.stats() if self.kv_connector else {}),
        )

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """How long a step of this shape took (to the stall bound's step-time models)."""
        self.stall_bound.observe(shape, seconds)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.remote_kv is not None:
            self._take_remote_kv_news()
        plan = StepPlan(self.max_num_batched_tokens, self.stall_bound.allowance(self.running, len(self.waiting), self.max_num_seqs),
                        self.long_prefill_token_threshold, self.send_last_tokens)
        if self.drafts:
            self.drafts.begin_step(self.running)
        # New prompts only when nothing was preempted: memory is tight, let the running ones finish.
        if not self._schedule_running(plan):
            self._schedule_waiting(plan)
        propose_for = set()
        if self.drafts:
            scheduled = (self.requests[request_id] for request_id in plan.num_scheduled_tokens)
            propose_for = self.drafts.requests_to_draft_for(scheduled, len(self.running))
        output = plan.build(self.finished_req_ids, self.preempted_req_ids, propose_for)
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        self.stall_bound.step_planned(output.prompt_chunks, self.requests, len(output.num_scheduled_tokens) == len(self.running))
        if output.prompt_chunks or self._prompt_tails:
            self._keep_prompt_tails(output)
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output, self.requests, self.kv_cache_manager.block_ids)
        if self.structured_output is not None and self.structured_output.has_constrained:
            output.grammar_bitmask = self.structured_output.bitmask(output, self.requests)
        return output

    def _keep_prompt_tails(self, output: SchedulerOutput) -> None:
        """The prompts this step leaves one token short, and those still short that it did not reach. That last token
        is planned as a decode is, but named among the prompt chunks of its step (which the time bound, a connector's
        saves and the web console read)."""
        scheduled, requests = output.num_scheduled_tokens, self.requests
        tails = {request_id for request_id in self._prompt_tails
                 if request_id not in scheduled and request_id in requests and requests[request_id].status is _RUNNING}
        for request_id, start, num_tokens, num_tokens_known in output.prompt_chunks:
            if start + num_tokens == num_tokens_known - 1:
                tails.add(request_id)
        self._prompt_tails = tails

    def _take_remote_kv_news(self) -> None:
        ready, failed = self.remote_kv.take_news()
        for request in reversed(ready):  # they waited for their KV: they go first
            self.waiting.add_front(request)
        for request in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._ended_unscheduled.append(self.remote_kv.failed_output(request))

    def _schedule_running(self, plan: StepPlan) -> bool:
        """Running requests in order, each its next token or chunk, preempting the least important when the cache
        is full. Returns whether any request was preempted. Runs for every running request each step: the plan takes
        runs of plain decodes in one pass, and only the others come through this loop."""
        kv = self.kv_cache_manager
        allocate_slots, req_to_blocks = kv.allocate_slots, kv.req_to_blocks
        drafts_policy = self.drafts
        prompt_tails = self._prompt_tails
        running = self.running
        preempted_any = False
        index = 0
        # Preemption removes only requests at or after the current one, so the index stays valid.
        while index < len(running) and plan.token_budget > 0:
            if drafts_policy is None and not prompt_tails:  # with drafts, every decode may verify some
                index = plan.take_plain_decodes(running, index, kv)
                if index == len(running) or plan.token_budget == 0:
                    break
            request = running[index]
            index += 1
            num_computed_tokens = request.num_computed_tokens
            num_new_tokens = len(request.all_token_ids) - num_computed_tokens
            drafts = _NO_DRAFTS
            is_prompt = num_new_tokens > 1
            if is_prompt:  # an unfinished prompt: chunk it (0: no time left in this step for it)
                num_new_tokens = plan.chunk_size(num_new_tokens, num_computed_tokens)
            elif num_new_tokens == 1 and drafts_policy is not None:
                drafts = drafts_policy.take_drafts(request, plan.token_budget)
                if drafts and self.structured_output is not None and self.structured_output.is_constrained(request.request_id):
                    drafts = self.structured_output.allowed_drafts(request.request_id, drafts)
                num_new_tokens += len(drafts)
            if num_new_tokens == 0:  # no time for its chunk, or its last step is still in the pipeline
                continue
            lookahead = drafts_policy.lookahead_slots(request, num_computed_tokens + num_new_tokens) if drafts_policy else 0
            new_blocks = allocate_slots(request, num_new_tokens, None, lookahead)
            if new_blocks is None:
                preempted_any = True
                new_blocks = self._preempt_until_it_fits(request, num_new_tokens, lookahead, index - 1)
                if new_blocks is None:  # it preempted itself
                    break
            num_blocks = len(req_to_blocks[request.request_id]) if new_blocks else 0
            # A chunk of one token too: the budget can leave room for just one, or a chunk one token short of the prompt.
            if is_prompt or (not drafts and request.request_id in prompt_tails):
                plan.add_chunk(request, num_new_tokens, new_blocks, num_blocks)
            else:
                plan.add_decode(request, drafts, new_blocks, num_blocks)
        return preempted_any

    def _preempt_until_it_fits(self, request: Request, num_new_tokens: int, lookahead: int, index: int) -> list | None:
        """Preempt requests not yet scheduled in this step until running[index]'s new tokens fit; its new blocks, or
        None once it was preempted itself."""
        while True:
            if self._preempt_one(first_candidate=index) is request:
                return None
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, None, lookahead)
            if new_blocks is not None:
                return new_blocks

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Waiting requests in policy order, while the budget, the cache, max_num_seqs and max_loras allow."""
        skipped = []
        adapters: set[int] | None = None  # the running requests' adapters, gathered once a waiting request names one
        while len(self.waiting) > 0 and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            must_wait = self._sibling_is_prefilling(request) or not self._grammar_ready(request)
            if request.is_finished:  # its grammar failed to compile
                self.waiting.pop()
                continue
            if must_wait:
                # Wait for the sibling's prompt blocks (then reuse them from the prefix cache), or for the grammar.
                skipped.append(self.waiting.pop())
                continue
            if request.lora_id:
                if adapters is None:
                    adapters = {running.lora_id for running in self.running if running.lora_id}
                if request.lora_id not in adapters and len(adapters) >= (self.max_loras or 0):
                    # The requests after it wait too, as behind a prompt that does not fit: the running adapters'
                    # requests end, and its adapter then joins, however many more requests the running ones receive.
                    break
            if not self._admit(plan, request):
                break
            if request.lora_id:
                adapters.add(request.lora_id)
        for request in reversed(skipped):
            self.waiting.add_front(request)

    def _admit(self, plan: StepPlan, request: Request) -> bool:
        """Start the waiting request at the head of the queue with its first chunk, if the step and the cache have
        room for it (or, with its KV to load while others run, let it wait for that); returns whether they had."""
        computed_blocks, num_external_tokens = None, 0  # external: found by the KV connector beyond the local hit
        if self.remote_kv is not None and self.remote_kv.holds_blocks(request):
            num_computed_tokens = request.num_computed_tokens  # its KV arrived from outside into its blocks
        else:
            computed_blocks, num_local_tokens = self.kv_cache_manager.get_computed_blocks(request)
            load_async = False
            if self.kv_connector is not None:
                num_external_tokens, load_async = self.kv_connector.get_num_new_matched_tokens(request, num_local_tokens)
                num_external_tokens = num_external_tokens or 0
            if load_async and num_external_tokens:
                if not self.remote_kv.admit(request, computed_blocks, num_local_tokens, num_external_tokens):
                    return False
                self.waiting.pop()
                return True
            num_computed_tokens = num_local_tokens + num_external_tokens
        num_new_tokens = plan.chunk_size(request.num_tokens - num_computed_tokens, num_computed_tokens)
        if num_new_tokens == 0:  # no time left in this step
            return False
        lookahead = self.drafts.lookahead_slots(request, num_computed_tokens + num_new_tokens) if self.drafts else 0
        while self.kv_cache_manager.allocate_slots(request, num_external_tokens + num_new_tokens, computed_blocks, lookahead) is None:
            if not self._preempt_a_waiting_request(request):
                return False
        self.waiting.pop()
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        request.num_computed_tokens = num_computed_tokens
        block_ids = self.kv_cache_manager.block_ids(request.request_id)
        if self.kv_connector is not None:
            self.kv_connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add_new_request(request, num_new_tokens, block_ids,
                             self.num_prompt_logprobs_sent.get(request.request_id, 0))
        return True

    def _grammar_ready(self, request: Request) -> bool:
        """Whether the request's structure (if any) has compiled. One that failed to compile ends the request (the
        front end compiled it before, so only a fault of the engine's own gets here), its end told with the next
        outputs."""
        if self.structured_output is None:
            return True
        try:
            return self.structured_output.is_ready(request)
        except ValueError as exc:
            logger.error("request %s ended: its structure did not compile in the engine: %s", request.request_id, exc)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._ended_unscheduled.append(EngineCoreOutput(request.request_id, [], finish_reason=request.status.finish_reason))
            return False

    def _sibling_is_prefilling(self, request: Request) -> bool:
        """True while another sample of the same request has prompt tokens left after this step, or waits for them to load
        (counts already include this step; blocks computed within it are cached, as K/V are written
        before attention reads them)."""
        if request.group_id is None or not self.kv_cache_manager.enable_caching:
            return False
        if self.remote_kv is not None and any(other.group_id == request.group_id for other in self.remote_kv.loading.values()):
            return True  # its prompt's KV is arriving from outside for a sibling
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
        self._take_back_blocks(victim)
        victim.status = RequestStatus.PREEMPTED
        self.stall_bound.came_to_wait(victim)
        self.preempted_req_ids.add(victim.request_id)
        if self.drafts:
            self.drafts.preempted(victim.request_id)
        self._requeue_preempted(victim)
        return victim

    def _preempt_a_waiting_request(self, head: Request) -> bool:
        """With nothing running, blocks that waiting requests hold (their KV loaded from outside) come free only when
        those requests run: two that each need a block the other holds would wait forever. So the last of them behind
        the head gives its blocks up (it loads or computes its KV again when admitted). Returns whether one did."""
        if self.running or self.remote_kv is None:
            return False
        holders = [request for request in self.waiting if request is not head and self.remote_kv.holds_blocks(request)]
        if not holders:
            return False
        self._take_back_blocks(holders[-1])
        return True

    def _take_back_blocks(self, victim: Request) -> None:
        """A preemption: the request's blocks go back and its KV is computed (or loaded) again when it is admitted."""
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue_preempted(self, victim: Request) -> None:
        """Back to the front of the waiting queue, behind the requests there whose KV arrived from outside: those hold
        their blocks, of no use to anyone until they run, and a request preempted again and again ahead of them would
        never let them run (nor give their blocks back)."""
        holding = []
        while self.remote_kv is not None and len(self.waiting) > 0 and self.remote_kv.holds_blocks(self.waiting.peek()):
            holding.append(self.waiting.pop())
        self.waiting.add_front(victim)
        for request in reversed(holding):
            self.waiting.add_front(request)

    # ---- after the model ran ---------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = self._ended_unscheduled
        self._ended_unscheduled = []
        if scheduler_output.kv_connector_metadata is not None:
            self.kv_connector.step_done(scheduler_output.kv_connector_metadata)
        structured = self.structured_output if self.structured_output is not None and self.structured_output.has_constrained else None
        if (structured is None and not scheduler_output.drafts_to_verify and not runner_output.logprobs
                and not runner_output.prompt_logprobs and not runner_output.proposed_drafts):
            stopped = self._append_sampled_tokens(runner_output.sampled_token_ids, outputs)
        else:
            stopped = self._append_step_news(scheduler_output, runner_output, structured, outputs)
        if runner_output.pooled:
            stopped += self._finish_pooled(runner_output.pooled, outputs)
        for request, index in stopped:
            self.running.remove(request)
            kv_transfer_params = self._free_request(request)
            if kv_transfer_params is not None:
                outputs[index].kv_transfer_params = kv_transfer_params
        return outputs

    def _append_sampled_tokens(self, sampled_token_ids: dict[str, int], outputs: list[EngineCoreOutput]) -> list[tuple[Request, int]]:
        """A step whose requests gained only their sampled tokens (no drafts, logprobs or grammars): each one's token
        appended and its output made, in one pass; nearly every step of a busy engine is one. Returns the requests
        that finished, each with the index of its output."""
        stopped: list[tuple[Request, int]] = []
        get_request, max_model_len, add_output, running = self.requests.get, self.max_model_len, outputs.append, _RUNNING
        for request_id, token_id in sampled_token_ids.items():
            request = get_request(request_id)
            if request is None or request.status is not running:
                continue  # aborted (or, with steps in flight, preempted) while the step ran
            tokens = request.all_token_ids
            tokens.append(token_id)
            num_tokens = len(tokens)
            # Only a stop token or a length limit can end it (Request.stop_token_ids): the full test runs for those.
            if ((token_id in request.stop_token_ids or num_tokens >= max_model_len or num_tokens >= request.max_num_tokens_by_params)
                    and request.finish_if_stopped(max_model_len)):
                stopped.append((request, len(outputs)))
                add_output(EngineCoreOutput(request_id, [token_id], None, None, request.status.finish_reason, request.stop_reason,
                                            request.num_cached_tokens))
            else:
                add_output(EngineCoreOutput(request_id, [token_id], None, None, None, None, request.num_cached_tokens))
        return stopped

    def _append_step_news(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, structured,
                          outputs: list[EngineCoreOutput]) -> list[tuple[Request, int]]:
        """Each scheduled request's news from the step (its accepted drafts, sampled token, logprobs, prompt logprobs,
        its grammar's verdict) appended to it and to outputs. Returns the requests that finished, each with the index
        of its output. Lookups are hoisted, and the logprob and draft maps are read only when the step produced any."""
        stopped: list[tuple[Request, int]] = []  # each with the index its last output gets (a finishing request has new tokens)
        get_request, get_sampled = self.requests.get, runner_output.sampled_token_ids.get
        logprobs, prompt_logprobs_of = runner_output.logprobs, runner_output.prompt_logprobs
        verified, proposed_drafts = scheduler_output.drafts_to_verify, runner_output.proposed_drafts
        max_model_len = self.max_model_len
        for request_id in scheduler_output.num_scheduled_tokens:
            request = get_request(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # aborted (or, with steps in flight, preempted) while the step ran
            token_id = get_sampled(request_id)
            finish_reason = None
            if token_id is None:  # a prompt chunk that does not reach the prompt's end
                new_token_ids = []
            elif verified and request_id in verified:
                new_token_ids = []
                finish_reason = self._append_verified(request, verified[request_id], runner_output, new_token_ids)
            else:
                new_token_ids = [token_id]
                if request.append_output_token(token_id, max_model_len):
                    finish_reason = request.status.finish_reason
            if structured is not None and new_token_ids and not structured.accept(request_id, new_token_ids):
                finish_reason = self._end_off_grammar(request, new_token_ids)
            if finish_reason is not None:
                stopped.append((request, len(outputs)))
            elif proposed_drafts and token_id is not None:
                self.drafts.proposed(request, proposed_drafts.get(request_id))
            prompt_logprobs = prompt_logprobs_of.get(request_id) if prompt_logprobs_of else None
            if prompt_logprobs is not None:
                self.num_prompt_logprobs_sent[request_id] = self.num_prompt_logprobs_sent.get(request_id, 0) + len(prompt_logprobs.ranks)
            elif not new_token_ids:
                continue
            token_logprobs = logprobs.get(request_id) if logprobs else None
            if token_logprobs is not None and len(token_logprobs.ranks) > len(new_token_ids):  # a stop inside verified drafts
                token_logprobs = token_logprobs.head(len(new_token_ids))
            outputs.append(EngineCoreOutput(request_id, new_token_ids, token_logprobs, prompt_logprobs, finish_reason, request.stop_reason,
                                            request.num_cached_tokens))
        return stopped

    def _finish_pooled(self, pooled: dict[str, bytes], outputs: list[EngineCoreOutput]) -> list[tuple[Request, int]]:
        """Runner pooling: a request whose prompt's vector came is done, its one output carrying the vector."""
        stopped: list[tuple[Request, int]] = []
        for request_id, vector in pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # aborted while the step ran
            request.status = RequestStatus.FINISHED_STOPPED
            stopped.append((request, len(outputs)))
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=request.status.finish_reason,
                                            num_cached_tokens=request.num_cached_tokens, pooled=vector))
        return stopped

    def _append_verified(self, request: Request, drafts: list[int], runner_output: ModelRunnerOutput,
                         new_token_ids: list[int]) -> str | None:
        """Append a verification's accepted drafts and its sampled token, stopping at a stop token or a length
        limit; roll num_computed_tokens back over the rejected drafts and give back the blocks only they used.
        Returns the finish reason, if it finished."""
        accepted = runner_output.accepted_token_ids.get(request.request_id, [])
        self.drafts.verified(request, len(drafts), len(accepted))
        for token in (*accepted, runner_output.sampled_token_ids[request.request_id]):
            new_token_ids.append(token)
            if request.append_output_token(token, self.max_model_len):
                return request.status.finish_reason
        # K/V is computed for the last known token's predecessors only: rejected drafts' slots are free again.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.trim(request)
        return None

    def _end_off_grammar(self, request: Request, new_token_ids: list[int]) -> str:
        """A token its grammar refused (the masks allow none such): the request cannot go on under its structure."""
        logger.error("request %s ended: its grammar refused a token of %s", request.request_id, new_token_ids)
        request.status = RequestStatus.FINISHED_ABORTED
        return request.status.finish_reason

    def _free_request(self, request: Request) -> dict | None:
        """Forget a finished request; returns the kv_transfer_params its client gets (with a KV connector)."""
        if self.structured_output is not None:
            self.structured_output.remove(request.request_id)
        params = None
        if self.kv_connector is not None:
            hold, params = self.kv_connector.request_finished(request, self.kv_cache_manager.block_ids(request.request_id))
            self.remote_kv.free(request, hold)
        else:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.num_prompt_logprobs_sent.pop(request.request_id, None)
        if self.drafts:
            self.drafts.finished(request.request_id)
        del self.requests[request.request_id]
        return params


def _requests_per_adapter(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
