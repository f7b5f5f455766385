"""Drive an LLMEngine step by step and time each request's tokens (offline TTFT and ITL)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestTimes:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class TimedRun:
    """Add requests now or at a later step; every step records when each request received tokens."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.times: dict[str, RequestTimes] = {}
        self.step_times: list[float] = []

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
        self.times[request_id] = RequestTimes(time.perf_counter())

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        self.step_times.append(now)
        for output in outputs:
            new_tokens = sum(len(c.token_ids) for c in output.outputs)
            times = self.times[output.request_id]
            times.token_times.extend([now] * min(new_tokens, 1))
            times.num_cached_tokens = max(times.num_cached_tokens, output.num_cached_tokens)

    def run_until_done(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
