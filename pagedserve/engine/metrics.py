"""Prometheus metrics and the periodic stats log line of the online server."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedserve.core.contracts import EngineCoreOutput, SchedulerStats, SpecDecodingStats
from pagedserve.engine.counted_histogram import CountedHistogram
from pagedserve.engine.latency_window import RecentLatencies

logger = logging.getLogger("pagedserve.stats")

LOG_INTERVAL_S = 5.0
RECENT_LATENCY_WINDOW_S = 60.0
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class _RequestTiming:
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None


class EngineMetrics:
    """The server's metrics. What an engine core reports (its queues, cache, preemptions) and the tokens it
    produced carry an `engine` label: one per data-parallel core, "0" with one core."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        engines = [str(index) for index in range(num_engines)]

        def gauge(name, doc):
            metric = Gauge(f"pagedserve:{name}", doc, [*labels, "engine"], registry=self.registry)
            return [metric.labels(model_name, engine) for engine in engines]

        def counter(name, doc):
            metric = Counter(f"pagedserve:{name}", doc, [*labels, "engine"], registry=self.registry)
            return [metric.labels(model_name, engine) for engine in engines]

        def histogram(name, doc):
            return CountedHistogram(f"pagedserve:{name}", doc, {"model_name": model_name}, _LATENCY_BUCKETS, self.registry)

        self.num_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified (one per request per step)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_per_position = Counter(
            "pagedserve:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position of a draft (0: the first)",
            [*labels, "engine", "position"], registry=self.registry)
        self.expert_tokens = Counter(
            "pagedserve:moe_expert_tokens", "Tokens routed to each expert of each mixture-of-experts layer",
            [*labels, "engine", "layer", "expert"], registry=self.registry)
        self._expert_tokens_seen: dict[tuple[int, int], list[int]] = {}  # (engine, layer) -> counts already added
        self.kv_received_tokens = counter("kv_transfer_received_tokens", "Prompt tokens whose KV a KV connector loaded")
        self.kv_sent_tokens = counter("kv_transfer_sent_tokens", "Prompt tokens whose KV a KV connector saved for others")
        self.kv_received_bytes = counter("kv_transfer_received_bytes", "Bytes of KV a KV connector loaded from other instances")
        self.kv_sent_bytes = counter("kv_transfer_sent_bytes", "Bytes of KV other instances read from this one's KV connector")
        self.kv_load_failures = counter("kv_transfer_load_failures", "Prompts whose KV could not be loaded from another instance")
        self.kv_transfer_time = histogram("kv_transfer_seconds", "Time to load a prompt's KV from another instance")
        self.lora_running = Gauge("pagedserve:lora_requests_running", "Requests running with each LoRA adapter",
                                  [*labels, "engine", "lora_name"], registry=self.registry)
        self.lora_waiting = Gauge("pagedserve:lora_requests_waiting", "Requests waiting with each LoRA adapter",
                                  [*labels, "engine", "lora_name"], registry=self.registry)
        self.lora_adapters = Gauge("pagedserve:lora_adapters_loaded", "LoRA adapters the server serves", labels,
                                   registry=self.registry).labels(model_name)
        self.request_success = Counter(
            "pagedserve:request_success", "Finished requests by finish reason", ["model_name", "finished_reason"], registry=self.registry
        )
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between successive output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.recent_ttft = RecentLatencies(RECENT_LATENCY_WINDOW_S)  # the web console's percentiles
        self.recent_itl = RecentLatencies(RECENT_LATENCY_WINDOW_S)
        self.total_generation_tokens = 0  # since start, all engines: the web console's generation rate
        self._timings: dict[str, _RequestTiming] = {}
        self._last = [SchedulerStats() for _ in engines]
        self._window_prompt_tokens = 0
        self._window_generation_tokens = 0
        self._last_log_time = time.monotonic()
        self._logged_spec = (0, 0)  # (drafts, accepted tokens) at the last log line

    def request_added(self, engine_request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._timings[engine_request_id] = _RequestTiming(arrival, num_prompt_tokens)

    def request_aborted(self, engine_request_id: str) -> None:
        """Ended before it finished (the client went away or stopped it, or the server ended it)."""
        if self._timings.pop(engine_request_id, None) is not None:
            self.request_success.labels(self.model_name, "abort").inc()

    def record_expert_tokens(self, engine: int, layers: dict[int, list[int]]) -> None:
        """Each layer's tokens routed to each expert since the engine started (counts that only grow)."""
        for layer, counts in layers.items():
            seen = self._expert_tokens_seen.setdefault((engine, layer), [0] * len(counts))
            for expert, (count, before) in enumerate(zip(counts, seen)):
                if count > before:
                    self.expert_tokens.labels(self.model_name, str(engine), str(layer), str(expert)).inc(count - before)
                    seen[expert] = count

    @property
    def latest_stats(self) -> list[SchedulerStats]:
        """Each engine core's scheduler state as of its last step."""
        return self._last

    def request_stopped_by_string(self, engine_request_id: str, now: float) -> None:
        """A stop string (found in the front end) ended it: the core only sees an abort."""
        timing = self._timings.pop(engine_request_id, None)
        if timing is not None:
            self.e2e.observe(now - timing.arrival)
            self.request_success.labels(self.model_name, "stop").inc()

    def record_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None, now: float, engine: int = 0) -> None:
        # Runs for every output of every step. The outputs whose previous tokens came from one step share their
        # inter-token latency: each distinct latency is observed once, with its count.
        timings, num_generated = self._timings, 0
        outputs_by_previous_time: dict[float, int] = {}
        for output in outputs:
            timing = timings.get(output.request_id)
            if timing is None:
                continue
            if not output.new_token_ids:
                if output.pooled is not None:  # an embedding: its prompt's one output, the request done
                    self._record_pooled(timing, now, engine)
                    del timings[output.request_id]
                continue
            num_generated += len(output.new_token_ids)
            previous = timing.last_token_time
            if previous is None:
                self._record_first_token(timing, now, engine)
            else:
                outputs_by_previous_time[previous] = outputs_by_previous_time.get(previous, 0) + 1
            timing.last_token_time = now
            if output.finish_reason is not None:
                self.e2e.observe(now - timing.arrival)
                self.request_success.labels(self.model_name, output.finish_reason).inc()
                del timings[output.request_id]
        for previous, count in outputs_by_previous_time.items():
            self.itl.observe(now - previous, count)
            self.recent_itl.observe(now, now - previous, count)
        if num_generated:
            self.generation_tokens[engine].inc(num_generated)
            self._window_generation_tokens += num_generated
            self.total_generation_tokens += num_generated
        if stats is not None:
            self._record_scheduler_stats(stats, engine)
        self._maybe_log(now)

    def _record_first_token(self, timing: _RequestTiming, now: float, engine: int) -> None:
        self.ttft.observe(now - timing.arrival)
        self.recent_ttft.observe(now, now - timing.arrival)
        self.prompt_tokens[engine].inc(timing.num_prompt_tokens)
        self._window_prompt_tokens += timing.num_prompt_tokens

    def _record_pooled(self, timing: _RequestTiming, now: float, engine: int) -> None:
        """Runner pooling: a request's prompt tokens and latency, counted when its vector comes (there is no first
        token to time)."""
        self.prompt_tokens[engine].inc(timing.num_prompt_tokens)
        self._window_prompt_tokens += timing.num_prompt_tokens
        self.e2e.observe(now - timing.arrival)
        self.request_success.labels(self.model_name, "stop").inc()

    def _record_scheduler_stats(self, stats: SchedulerStats, engine: int) -> None:
        # Every step brings these; most steps change few of them, and each metric's update takes a lock.
        last = self._last[engine]
        for gauge, value, before in ((self.num_running, stats.num_running, last.num_running),
                                     (self.num_waiting, stats.num_waiting, last.num_waiting),
                                     (self.kv_cache_usage, stats.kv_cache_usage, last.kv_cache_usage)):
            if value != before:
                gauge[engine].set(value)
        _count_up(self.prefix_cache_queries[engine], stats.prefix_cache_queries, last.prefix_cache_queries)
        _count_up(self.prefix_cache_hits[engine], stats.prefix_cache_hits, last.prefix_cache_hits)
        _count_up(self.preemptions[engine], stats.num_preemptions, last.num_preemptions)
        _count_up(self.kv_received_tokens[engine], stats.kv_received_tokens, last.kv_received_tokens)
        _count_up(self.kv_sent_tokens[engine], stats.kv_sent_tokens, last.kv_sent_tokens)
        _count_up(self.kv_received_bytes[engine], stats.kv_received_bytes, last.kv_received_bytes)
        _count_up(self.kv_sent_bytes[engine], stats.kv_sent_bytes, last.kv_sent_bytes)
        _count_up(self.kv_load_failures[engine], stats.kv_load_failures, last.kv_load_failures)
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_time.observe(seconds)
        if stats.spec is not None:
            self._record_spec_stats(stats.spec, last.spec, engine)
        for gauge, counts, before in ((self.lora_running, stats.lora_running, last.lora_running),
                                      (self.lora_waiting, stats.lora_waiting, last.lora_waiting)):
            for name in before.keys() | counts.keys():  # an adapter whose requests all ended goes to 0
                gauge.labels(self.model_name, str(engine), name).set(counts.get(name, 0))
        self._last[engine] = stats

    def _record_spec_stats(self, spec: SpecDecodingStats, last: SpecDecodingStats | None, engine: int) -> None:
        last = last or SpecDecodingStats()
        _count_up(self.spec_drafts[engine], spec.num_drafts, last.num_drafts)
        _count_up(self.spec_draft_tokens[engine], spec.num_draft_tokens, last.num_draft_tokens)
        _count_up(self.spec_accepted_tokens[engine], spec.num_accepted_tokens, last.num_accepted_tokens)
        for position, accepted in enumerate(spec.accepted_per_position):
            before = last.accepted_per_position[position] if position < len(last.accepted_per_position) else 0
            _count_up(self.spec_accepted_per_position.labels(self.model_name, str(engine), str(position)), accepted, before)

    def _maybe_log(self, now: float) -> None:
        elapsed = now - self._last_log_time
        if elapsed < LOG_INTERVAL_S:
            return
        engines = self._last
        stats = SchedulerStats(
            num_running=sum(s.num_running for s in engines), num_waiting=sum(s.num_waiting for s in engines),
            kv_cache_usage=sum(s.kv_cache_usage for s in engines) / len(engines),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in engines),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in engines), num_preemptions=sum(s.num_preemptions for s in engines),
        )
        hit_rate = stats.prefix_cache_hit_rate or 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._window_prompt_tokens / elapsed, self._window_generation_tokens / elapsed, stats.num_running,
            stats.num_waiting, stats.kv_cache_usage * 100, hit_rate * 100, stats.num_preemptions,
        )
        self._log_spec_stats([s.spec for s in engines if s.spec is not None])
        self._window_prompt_tokens = self._window_generation_tokens = 0
        self._last_log_time = now

    def _log_spec_stats(self, specs: list[SpecDecodingStats]) -> None:
        """Mean accepted length since the last line: tokens a verification step yields, the sampled one included."""
        if not specs:
            return
        drafts, accepted = sum(s.num_drafts for s in specs), sum(s.num_accepted_tokens for s in specs)
        new_drafts, new_accepted = drafts - self._logged_spec[0], accepted - self._logged_spec[1]
        self._logged_spec = (drafts, accepted)
        if new_drafts:
            draft_tokens = sum(s.num_draft_tokens for s in specs)
            logger.info("Speculative decoding: mean accepted length %.2f, acceptance rate %.1f%% overall (%d drafts)",
                        1 + new_accepted / new_drafts, 100 * accepted / max(draft_tokens, 1), drafts)


def _count_up(counter, total: float, before: float) -> None:
    """Add to counter what a running total of the core grew by since the last step."""
    if total > before:
        counter.inc(total - before)
