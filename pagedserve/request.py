"""Request: the engine-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time

from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # admitted, its blocks allocated, its prompt's KV arriving from outside
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_UNBOUNDED = float("inf")

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Tokens so far (prompt + outputs) and how many of them have KV in the cache."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # Samples of one n>1 request share a group: siblings wait for the first prefill to reuse its blocks.
        self.group_id = group_id
        self.lora_request = lora_request
        # The adapter's id, 0 for the base model: the scheduler bounds a step's adapters by it, the prefix cache keys
        # the request's blocks by it (K/V computed under one adapter's weights is not another's).
        self.lora_id = lora_request.lora_int_id if lora_request is not None else 0
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 until known
        self.num_preemptions = 0
        # The stall bound's step numbers: how many steps were planned when this request last came to wait (arrived, or
        # was preempted), and the step that last finished its prompt (whose output brings its first token after it).
        self.came_after_step = 0
        self.prompt_done_step = 0
        self.stop_reason: int | str | None = None
        # What can end the request with a token: a stop token, or the token count at which max_tokens ends it
        # (max_model_len is the scheduler's to apply). No other token can, so the scheduler's path for every token
        # of every step tests these two and calls finish_if_stopped only when one holds.
        self.stop_token_ids = sampling_params.all_stop_token_ids()
        max_tokens = sampling_params.max_tokens
        self.max_num_tokens_by_params = len(self.prompt_token_ids) + max_tokens if max_tokens is not None else _UNBOUNDED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skips_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int, max_model_len: int) -> bool:
        """Append a new token, then set a finished status if the request must stop with it. Returns True if it did."""
        self.all_token_ids.append(token_id)
        return self.finish_if_stopped(max_model_len)

    def finish_if_stopped(self, max_model_len: int) -> bool:
        """Set a finished status if the request must stop with its last token. Returns True if it did."""
        all_token_ids = self.all_token_ids
        token_id, num_tokens = all_token_ids[-1], len(all_token_ids)
        if token_id in self.stop_token_ids:
            params = self.sampling_params
            if num_tokens - len(self.prompt_token_ids) >= params.min_tokens:
                self.status = RequestStatus.FINISHED_STOPPED
                if token_id not in params.eos_token_ids or params.ignore_eos:
                    self.stop_reason = token_id
                return True
        if num_tokens >= max_model_len or num_tokens >= self.max_num_tokens_by_params:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
