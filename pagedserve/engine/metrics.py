"""Prometheus metrics and the periodic stats log line of the online server."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.core.contracts import EngineCoreOutput, SchedulerStats

logger = logging.getLogger("pagedserve.stats")

LOG_INTERVAL_S = 5.0
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class _RequestTiming:
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"pagedserve:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(f"pagedserve:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"pagedserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = Counter(
            "pagedserve:request_success", "Finished requests by finish reason", ["model_name", "finished_reason"], registry=self.registry
        )
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between successive output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self._timings: dict[str, _RequestTiming] = {}
        self._last = SchedulerStats()
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0
        self._last_log_time = time.monotonic()

    def request_added(self, engine_request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._timings[engine_request_id] = _RequestTiming(arrival, num_prompt_tokens)

    def request_removed(self, engine_request_id: str) -> None:
        self._timings.pop(engine_request_id, None)

    def request_stopped_by_string(self, engine_request_id: str, now: float) -> None:
        """A stop string (found in the front end) ended it: the core only sees an abort."""
        timing = self._timings.pop(engine_request_id, None)
        if timing is not None:
            self.e2e.observe(now - timing.arrival)
            self.request_success.labels(self.model_name, "stop").inc()

    def record_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None, now: float) -> None:
        for output in outputs:
            self._record_output(output, now)
        if stats is not None:
            self._record_scheduler_stats(stats)
        self._maybe_log(now)

    def _record_output(self, output: EngineCoreOutput, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None or not output.new_token_ids:
            return
        if timing.last_token_time is None:
            self.ttft.observe(now - timing.arrival)
            self.prompt_tokens.inc(timing.num_prompt_tokens)
            self._window_prompt_tokens += timing.num_prompt_tokens
        else:
            self.itl.observe(now - timing.last_token_time)
        timing.last_token_time = now
        self.generation_tokens.inc(len(output.new_token_ids))
        self._window_generation_tokens += len(output.new_token_ids)
        if output.finished:
            self.e2e.observe(now - timing.arrival)
            self.request_success.labels(self.model_name, output.finish_reason).inc()
            del self._timings[output.request_id]

    def _record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(max(stats.prefix_cache_queries - self._last.prefix_cache_queries, 0))
        self.prefix_cache_hits.inc(max(stats.prefix_cache_hits - self._last.prefix_cache_hits, 0))
        self.preemptions.inc(max(stats.num_preemptions - self._last.num_preemptions, 0))
        self._last = stats

    def _maybe_log(self, now: float) -> None:
        elapsed = now - self._last_log_time
        if elapsed < LOG_INTERVAL_S:
            return
        stats = self._last
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._window_prompt_tokens / elapsed, self._window_generation_tokens / elapsed, stats.num_running,
            stats.num_waiting, stats.kv_cache_usage * 100, hit_rate * 100, stats.num_preemptions,
        )
        self._window_prompt_tokens = self._window_generation_tokens = 0
        self._last_log_time = now
