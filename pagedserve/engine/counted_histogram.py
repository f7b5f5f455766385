"""A Prometheus histogram that takes one value with a count of observations. A step's outputs mostly share their
latencies (their previous tokens came from the same step), so the server counts each distinct value once per step;
prometheus_client's Histogram takes a lock and walks its buckets for every single observation. The values reach
Prometheus through the client library's own collector interface and exposition."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class CountedHistogram:
    """One labelled series of a histogram (Prometheus' bucket rule: a value counts in the first bucket whose upper
    bound is at least the value)."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError(f"buckets must be in ascending order, got {list(buckets)}")
        self._name, self._documentation = name, documentation
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._upper_bounds = [*buckets, math.inf]
        self._le = [floatToGoString(bound) for bound in self._upper_bounds]
        self._counts = [0] * len(self._upper_bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """count observations of value."""
        self._counts[bisect_left(self._upper_bounds, value)] += count
        self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)
        family.add_metric(self._label_values, list(zip(self._le, accumulate(self._counts))), self._sum)
        yield family
