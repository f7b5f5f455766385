"""A `/health` probe beside a load, as a load balancer's would be: one GET on a new connection every interval, each
one's latency recorded. It runs in a process of its own so that the load client's own work (parsing hundreds of
streams) does not delay the probe and count against the server."""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing
import time
import urllib.parse

# A probe that gets no answer within this is recorded at this latency, as a failure.
PROBE_TIMEOUT_S = 10.0


def probe_once(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[float, int]:
    """Seconds one GET /health took on a new connection, and its status (0: no answer)."""
    parts = urllib.parse.urlsplit(url)
    start = time.perf_counter()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request("GET", "/health", headers={"Connection": "close"})
        response = connection.getresponse()
        response.read()
        status = response.status
    except OSError:
        status = 0
    finally:
        connection.close()
    return time.perf_counter() - start, status


# How long the probe's process may take to start and probe once before the load goes ahead without waiting for it.
_START_TIMEOUT_S = 60.0


def _probe_until_stopped(url: str, interval_s: float, started, stop, results) -> None:
    latencies, failures = [], 0
    next_at = time.perf_counter()
    while True:
        seconds, status = probe_once(url)
        latencies.append(seconds)
        failures += status != 200
        started.set()  # the first probe is in: the load may begin
        next_at = max(next_at + interval_s, time.perf_counter())
        if stop.wait(max(0.0, next_at - time.perf_counter())):
            break
    results.send((latencies, failures))


@contextlib.contextmanager
def health_probe(url: str, interval_s: float):
    """Probe url's /health every interval_s while the block runs; yields a dict that holds, after the block,
    "latencies" (seconds, one per probe) and "failures" (probes without a 200)."""
    context = multiprocessing.get_context("spawn")
    started, stop = context.Event(), context.Event()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_probe_until_stopped, args=(url, interval_s, started, stop, sender), daemon=True)
    process.start()
    # A new interpreter's start takes a CPU for a while: over, and the first probe in, by the time the load begins,
    # so that it slows neither the server's first steps nor the load's client.
    started.wait(_START_TIMEOUT_S)
    outcome: dict = {"latencies": [], "failures": 0}
    try:
        yield outcome
    finally:
        stop.set()
        if receiver.poll(PROBE_TIMEOUT_S + 5):
            outcome["latencies"], outcome["failures"] = receiver.recv()
        process.join(5)
