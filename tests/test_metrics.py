"""The server's Prometheus metrics: a histogram fed counted observations exposes what prometheus_client's own
Histogram does for the same observations one at a time, and a step's outputs are recorded as each one alone would be."""

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.engine.counted_histogram import CountedHistogram
from pagedserve.engine.metrics import EngineMetrics

BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    """(sample name, labels) -> value of the metric family `name`, without the creation time."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            if family.name == name for s in family.samples if not s.name.endswith("_created")}


def test_counted_observations_expose_what_the_client_librarys_histogram_does():
    reference_registry, counted_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("pagedserve:x_seconds", "doc", ["model_name"], buckets=BUCKETS, registry=reference_registry).labels("m")
    counted = CountedHistogram("pagedserve:x_seconds", "doc", {"model_name": "m"}, BUCKETS, counted_registry)
    rng = random.Random(0)
    for _ in range(200):  # bounds themselves (which count in their own bucket), beyond the last, and in between
        value, count = rng.choice([0.001, 0.005, 1.0, 2.5, 0.0, rng.random() * 0.2]), rng.randrange(1, 5)
        for _ in range(count):
            reference.observe(value)
        counted.observe(value, count)
    expected, got = _samples(reference_registry, "pagedserve:x_seconds"), _samples(counted_registry, "pagedserve:x_seconds")
    assert got.keys() == expected.keys() and len(got) == len(BUCKETS) + 3  # the buckets, +Inf, count, sum
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_counted_histogram_refuses_buckets_out_of_order():
    with pytest.raises(ValueError, match="ascending"):
        CountedHistogram("pagedserve:y_seconds", "doc", {"model_name": "m"}, (0.1, 0.01), CollectorRegistry())


def test_a_steps_outputs_are_recorded_as_each_alone_would_be():
    """Requests arriving at different times, some sharing their previous step, one producing two tokens at once, one
    finishing: latencies and token counts against the ones worked out by hand."""
    metrics = EngineMetrics("m")
    for request_id, arrival in (("a", 0.0), ("b", 0.0), ("c", 0.5)):
        metrics.request_added(request_id, arrival, num_prompt_tokens=10)
    steps = [
        (1.0, [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [1])]),  # first tokens: TTFT 1.0, 1.0
        (1.25, [EngineCoreOutput("a", [2]), EngineCoreOutput("b", [2, 3]), EngineCoreOutput("c", [1])]),  # ITL 0.25 x2; TTFT 0.75
        (1.5, [EngineCoreOutput("a", [3], finish_reason="length"), EngineCoreOutput("c", [2]), EngineCoreOutput("gone", [1])]),
    ]
    for now, outputs in steps:
        metrics.record_outputs(outputs, None, now)

    def histogram(name):
        samples = _samples(metrics.registry, f"pagedserve:{name}")
        count = samples[(f"pagedserve:{name}_count", (("model_name", "m"),))]
        return count, samples[(f"pagedserve:{name}_sum", (("model_name", "m"),))]

    assert histogram("time_to_first_token_seconds") == (3, pytest.approx(2.75))
    assert histogram("inter_token_latency_seconds") == (4, pytest.approx(1.0))  # 0.25 x 4: a, b; then a, c
    assert histogram("e2e_request_latency_seconds") == (1, pytest.approx(1.5))
    tokens = _samples(metrics.registry, "pagedserve:generation_tokens")
    assert tokens[("pagedserve:generation_tokens_total", (("engine", "0"), ("model_name", "m")))] == 8
    assert metrics.total_generation_tokens == 8
    assert metrics.recent_itl.percentiles(1.5, (0.5,))["p50"] == pytest.approx(0.25, rel=0.05)
