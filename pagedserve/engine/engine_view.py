"""What the web console shows of the engine, sampled for each viewer: the engine cores' scheduler state as of their
last step, token rates, TTFT and ITL percentiles over a sliding window, and the steps that ran since the viewer's
last sample (what each carried, how long it took against its time limit, its prompt chunks).

The engine's only cost is what it already sends each step (a StepRecord beside its outputs), kept here in a bounded
ring; every figure is computed when a viewer samples, so an engine nobody watches computes none of them."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.core.contracts import StepRecord
from pagedserve.engine.metrics import RECENT_LATENCY_WINDOW_S, EngineMetrics

_QUANTILES = (0.5, 0.9, 0.99)
_PROMPT_PREVIEW_CHARS = 160


@dataclass
class ViewerCursor:
    """Where one viewer's last sample left off: the last step it was sent, when (seconds since the epoch, as the
    steps' ended_at), and the generated tokens so far, for its rates."""

    last_step: int = 0
    at: float = 0.0
    generation_tokens: int = 0


class EngineView:
    """prompt_of(engine request id) -> its prompt text (or None); asked only when show_prompts is set."""

    def __init__(self, metrics: EngineMetrics, prompt_of: Callable[[str], str | None], show_prompts: bool = False,
                 max_steps: int = 1024) -> None:
        self.metrics = metrics
        self.prompt_of = prompt_of
        self.show_prompts = show_prompts
        self._steps: deque[tuple[int, int, StepRecord]] = deque(maxlen=max_steps)  # (number, engine, record)
        self._num_steps = 0
        self._prompts: dict[str, str] = {}  # engine request id -> prompt preview, for the chunks of the ring's steps

    def record_step(self, engine: int, step: StepRecord) -> None:
        self._num_steps += 1
        self._steps.append((self._num_steps, engine, step))
        if self.show_prompts:
            for request_id, *_ in step.prompt_chunks:
                if request_id not in self._prompts and (prompt := self.prompt_of(request_id)) is not None:
                    self._prompts[request_id] = prompt[-_PROMPT_PREVIEW_CHARS:]
            if len(self._prompts) > 4 * self._steps.maxlen:
                self._forget_old_prompts()

    def new_cursor(self) -> ViewerCursor:
        """A viewer starting now: its first sample carries the steps still in the ring."""
        return ViewerCursor(self._steps[0][0] - 1 if self._steps else self._num_steps, time.time(), self.metrics.total_generation_tokens)

    def sample(self, cursor: ViewerCursor) -> dict:
        """The viewer's next sample (a JSON object), advancing its cursor. The prompt rate counts the prompt tokens the
        engine computed in the steps that ended since the viewer's last sample (prefix-cache hits are not computed); the
        generation rate, the tokens that reached the front end."""
        now, metrics = time.time(), self.metrics
        new_steps = [(number, engine, step) for number, engine, step in self._steps if number > cursor.last_step]
        elapsed = max(now - cursor.at, 1e-9)
        prompt_tokens = sum(step.prefill_tokens for _, _, step in new_steps if step.ended_at > cursor.at)
        rates = {"prompt_tokens_per_s": prompt_tokens / elapsed,
                 "generation_tokens_per_s": (metrics.total_generation_tokens - cursor.generation_tokens) / elapsed}
        cursor.at, cursor.generation_tokens, cursor.last_step = now, metrics.total_generation_tokens, self._num_steps
        latency_clock = time.monotonic()  # what the metrics time their observations with
        return {"time": now, "engines": [self._describe_stats(stats) for stats in metrics.latest_stats], **rates,
                "ttft_s": metrics.recent_ttft.percentiles(latency_clock, _QUANTILES),
                "itl_s": metrics.recent_itl.percentiles(latency_clock, _QUANTILES),
                "latency_window_s": RECENT_LATENCY_WINDOW_S, "steps": [self._describe(*entry) for entry in new_steps]}

    @staticmethod
    def _describe_stats(stats) -> dict:
        return {"running": stats.num_running, "waiting": stats.num_waiting, "kv_cache_usage": stats.kv_cache_usage,
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                "preemptions": stats.num_preemptions}

    def _describe(self, number: int, engine: int, step: StepRecord) -> dict:
        chunks = []
        for request_id, start, num_tokens, num_known in step.prompt_chunks:
            chunk = {"request_id": request_id, "start": start, "tokens": num_tokens, "of": num_known}
            if self.show_prompts:
                chunk["prompt"] = self._prompts.get(request_id)
            chunks.append(chunk)
        return {"number": number, "engine": engine, "ended_at": step.ended_at, "seconds": step.seconds,
                "decode_tokens": step.decode_tokens, "prefill_tokens": step.prefill_tokens,
                "stall_limit_s": step.stall_limit_s, "chunks": chunks}

    def _forget_old_prompts(self) -> None:
        in_ring = {request_id for _, _, step in self._steps for request_id, *_ in step.prompt_chunks}
        self._prompts = {request_id: prompt for request_id, prompt in self._prompts.items() if request_id in in_ring}
