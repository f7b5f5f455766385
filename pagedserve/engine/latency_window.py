"""Latency percentiles over a sliding window of the last seconds, for the web console: a Prometheus histogram's
buckets are cumulative since start, and keeping every observation would make each percentile a sort of tens of
thousands of them. So each observation is counted in a log-spaced bucket (each RELATIVE_WIDTH wider than the one
below), per second of its arrival; the window's total per bucket is kept as seconds come and go, and a percentile
is a walk over the buckets. A reported percentile is its bucket's geometric middle: within half a bucket's
relative width of the exact one."""

from __future__ import annotations

import math
from collections import deque

RELATIVE_WIDTH = 0.05
_SMALLEST_S = 1e-5  # latencies below this count in the first bucket, above _LARGEST_S in the last
_LARGEST_S = 1e4
_LOG_WIDTH = math.log1p(RELATIVE_WIDTH)
_NUM_BUCKETS = math.ceil(math.log(_LARGEST_S / _SMALLEST_S) / _LOG_WIDTH) + 1


def _bucket(seconds: float) -> int:
    if seconds <= _SMALLEST_S:
        return 0
    return min(_NUM_BUCKETS - 1, int(math.log(seconds / _SMALLEST_S) / _LOG_WIDTH))


def _middle(bucket: int) -> float:
    return _SMALLEST_S * math.exp((bucket + 0.5) * _LOG_WIDTH)


class RecentLatencies:
    """Latencies observed over the last window_s seconds, by the clock the caller passes (time.monotonic())."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._totals = [0] * _NUM_BUCKETS
        self._count = 0
        self._seconds: deque[tuple[int, dict[int, int]]] = deque()  # (whole second, bucket -> count), oldest first

    def observe(self, now: float, seconds: float, count: int = 1) -> None:
        """count observations of the same latency."""
        second = int(now)
        if not self._seconds or self._seconds[-1][0] != second:
            self._expire(now)
            self._seconds.append((second, {}))
        bucket = _bucket(seconds)
        counts = self._seconds[-1][1]
        counts[bucket] = counts.get(bucket, 0) + count
        self._totals[bucket] += count
        self._count += count

    def percentiles(self, now: float, quantiles: tuple[float, ...]) -> dict[str, float | None]:
        """{"p50": ...} for each quantile (nearest rank) of the latencies of the last window_s seconds; None: none."""
        self._expire(now)
        result: dict[str, float | None] = {f"p{round(q * 100)}": None for q in quantiles}
        if not self._count:
            return result
        ranks = sorted((min(self._count - 1, int(q * self._count)), f"p{round(q * 100)}") for q in quantiles)
        seen, next_rank = 0, 0
        for bucket, count in enumerate(self._totals):
            seen += count
            while next_rank < len(ranks) and ranks[next_rank][0] < seen:
                result[ranks[next_rank][1]] = _middle(bucket)
                next_rank += 1
            if next_rank == len(ranks):
                break
        return result

    def _expire(self, now: float) -> None:
        """Forget the seconds that left the window (a second is in it while any of it is)."""
        oldest = int(now - self.window_s)
        while self._seconds and self._seconds[0][0] < oldest:
            for bucket, count in self._seconds.popleft()[1].items():
                self._totals[bucket] -= count
                self._count -= count
