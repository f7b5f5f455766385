"""One engine step as the scheduler builds it: what is left of its token budget and of its time for prompt work,
what it carries (its shape, for the step-time model), and the parts of the SchedulerOutput it becomes."""

from __future__ import annotations

from itertools import islice

from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.contracts import NewRequestData, RunningRequestData, SchedulerOutput
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.stall_bound import PrefillAllowance
from pagedserve.core.step_time import ShapeTally
from pagedserve.request import Request


class StepPlan:
    """Requests join the step through add_decode, add_chunk and add_new_request; each advances the request's
    num_computed_tokens past what the step computes and spends the budget."""

    def __init__(self, token_budget: int, allowance: PrefillAllowance | None = None, long_prefill_token_threshold: int = 0,
                 send_last_tokens: bool = False) -> None:
        self.max_num_tokens = token_budget
        self.token_budget = token_budget
        self.allowance = allowance
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # Pipeline parallelism: every decode carries its last token to the stages that did not sample it.
        self.send_last_tokens = send_last_tokens
        self.tally = ShapeTally()
        # Plain decodes are tallied once, when the step is built.
        self.num_plain_decodes = 0
        self.plain_decode_context_lens = 0
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.running_reqs: list[RunningRequestData] = []
        self.last_token_ids: dict[str, tuple[int, int]] = {}
        self.drafts_to_verify: dict[str, list[int]] = {}
        self.prompt_chunks: list[tuple[str, int, int, int]] = []

    def chunk_size(self, num_remaining_tokens: int, context_len: int) -> int:
        """How many of a prompt's remaining tokens after context_len this step can take: 0 when it has no time left."""
        num_tokens = min(num_remaining_tokens, self.token_budget)
        if self.long_prefill_token_threshold > 0:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        if self.allowance is not None:
            num_tokens = self.allowance.take(num_tokens, context_len)
        return num_tokens

    def add_decode(self, request: Request, drafts: list[int], new_blocks: list[KVCacheBlock], num_blocks: int) -> None:
        """A running request's next token, and the drafts it verifies with it. num_blocks: the blocks it now holds."""
        request_id = request.request_id
        num_tokens = 1 + len(drafts)
        if drafts:
            self.drafts_to_verify[request_id] = drafts
        if self.send_last_tokens:
            self.last_token_ids[request_id] = (len(request.all_token_ids) - 1, request.all_token_ids[-1])
        self.tally.add_decode(num_tokens, request.num_computed_tokens)
        if new_blocks:
            self._describe_new_blocks(request_id, new_blocks, num_blocks)
        # As _schedule, inlined: every decode of every step passes here.
        self.num_scheduled_tokens[request_id] = num_tokens
        request.num_computed_tokens += num_tokens
        self.token_budget -= num_tokens

    def take_plain_decodes(self, running: list[Request], start: int, kv: KVCacheManager) -> int:
        """Schedule running[start:]'s next tokens while each is a plain decode (one token, no drafts) whose slot the
        cache has or can give (a new block), and budget is left. What nearly every request does in nearly every step,
        so each costs one pass of this loop. Returns the index of the first request not taken: not a plain decode, or
        one the cache has no block for (the scheduler preempts for it)."""
        scheduled, last_token_ids = self.num_scheduled_tokens, self.last_token_ids if self.send_last_tokens else None
        capacity, allocate_slots = kv.slot_capacity.get, kv.allocate_slots
        end = min(len(running), start + self.token_budget)
        context_lens = 0
        index = start
        for request in islice(running, start, end):
            context_len = request.num_computed_tokens
            request_id = request.request_id
            if len(request.all_token_ids) - context_len != 1:
                break
            if context_len >= capacity(request_id, 0):  # its blocks are full
                new_blocks = allocate_slots(request, 1)
                if new_blocks is None:
                    break
                self._describe_new_blocks(request_id, new_blocks, len(kv.req_to_blocks[request_id]))
            if last_token_ids is not None:
                last_token_ids[request_id] = (context_len, request.all_token_ids[-1])
            scheduled[request_id] = 1
            request.num_computed_tokens = context_len + 1
            context_lens += context_len
            index += 1
        self.num_plain_decodes += index - start
        self.plain_decode_context_lens += context_lens
        self.token_budget -= index - start
        return index

    def add_chunk(self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock], num_blocks: int) -> None:
        """The next chunk of a running request's prompt."""
        self.tally.add_chunk(num_tokens, request.num_computed_tokens)
        if new_blocks:
            self._describe_new_blocks(request.request_id, new_blocks, num_blocks)
        self._schedule(request, num_tokens)

    def add_new_request(self, request: Request, num_tokens: int, block_ids: list[int], prompt_logprobs_start: int) -> None:
        """A request the runner has not seen (or must rebuild after preemption), with its first chunk; its
        num_computed_tokens counts its prefix-cache hit."""
        self.new_reqs.append(NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            prompt_logprobs_start=prompt_logprobs_start,
            lora_request=request.lora_request,
        ))
        self.tally.add_chunk(num_tokens, request.num_computed_tokens)
        self._schedule(request, num_tokens)

    def _describe_new_blocks(self, request_id: str, new_blocks: list[KVCacheBlock], num_blocks: int) -> None:
        """Only running requests that got blocks are described: the runner knows the rest."""
        block_ids = [block.block_id for block in new_blocks]
        self.running_reqs.append(RunningRequestData(request_id, block_ids, num_blocks - len(new_blocks)))

    def _schedule(self, request: Request, num_tokens: int) -> None:
        """A prompt chunk (decodes take the paths above)."""
        self.prompt_chunks.append((request.request_id, request.num_computed_tokens, num_tokens, len(request.all_token_ids)))
        self.num_scheduled_tokens[request.request_id] = num_tokens
        request.num_computed_tokens += num_tokens
        self.token_budget -= num_tokens

    def build(self, finished_req_ids: set[str], preempted_req_ids: set[str], propose_for: set[str]) -> SchedulerOutput:
        self.tally.add_decodes(self.num_plain_decodes, self.plain_decode_context_lens)
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_running_reqs=self.running_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_tokens - self.token_budget,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            shape=self.tally.shape(),
            last_token_ids=self.last_token_ids,
            drafts_to_verify=self.drafts_to_verify,
            propose_for=propose_for,
            prompt_chunks=self.prompt_chunks,
            stall_limit_s=None if self.allowance is None else self.allowance.limit_seconds,
        )
