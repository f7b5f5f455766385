"""Serving benchmark: an asyncio + aiohttp streaming client against any OpenAI-compatible server.

Definitions follow the standard serving benchmarks: TTFT = send -> first content token;
ITL = gaps between successive streamed chunks; TPOT = (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from pagedserve import envs
from pagedserve.benchmarks.datasets import BenchRequest, chat_requests, mixed_requests, random_requests
from pagedserve.benchmarks.health_probe import health_probe
from pagedserve.benchmarks.report import mean, percentile, print_table, write_json
from pagedserve.ports import free_port


@dataclass
class RequestResult:
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class Sampling:
    """What every request of a run asks of the sampler; None: the server's default."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seeded: bool = False  # each request its own seed
    structure: str = "none"  # a STRUCTURES name: the JSON schema every output follows, if any

    def fields(self) -> dict:
        return {name: value for name, value in vars(self).items() if value is not None and name not in ("seeded", "structure")}


# What an agent asks for: an answer with a confidence and its sources.
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "sources": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["answer", "confidence", "sources"]}
def response_format(structure: str, rng: random.Random) -> dict | None:
    """none: unconstrained; json-schema: ANSWER_SCHEMA (compiled once, then cached); json-schema-distinct: a schema that
    differs by an optional field of its own, so that every request's compiles cold."""
    if structure == "none":
        return None
    schema = ANSWER_SCHEMA
    if structure == "json-schema-distinct":
        schema = {**schema, "properties": {**schema["properties"], f"note_{rng.randrange(2**62)}": {"type": "string"}}}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def request_body(endpoint: str, model: str, request: BenchRequest, sampling: Sampling, rng: random.Random) -> dict:
    body = {"model": model, "max_tokens": request.output_len, "stream": True, "ignore_eos": request.ignore_eos,
            "stream_options": {"include_usage": True}, **sampling.fields()}
    if sampling.seeded:
        body["seed"] = rng.randrange(2**31)
    structure = response_format(sampling.structure, rng)
    if structure is not None:  # a structure ends where it is complete, whatever the dataset asks
        body.update(response_format=structure, ignore_eos=False)
    if endpoint == "chat":
        return body | {"messages": request.as_messages(rng)}
    return body | {"prompt": request.as_prompt()}


def content_of(payload: dict) -> str:
    """The text a streamed chunk carries: a completion's text, or a chat delta's content (not its role)."""
    texts = []
    for choice in payload.get("choices") or []:
        texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(texts)


# Times a request is sent again after its connection closed before any answer.
_UNANSWERED_RESENDS = 2


async def post_answered(session, url: str, body: dict, headers: dict):
    """The response to a POST, sent again on another connection where the one it went on closed or broke before any
    answer (a server may let a kept-alive connection go just as the client reuses it, as llama.cpp's does: the request
    then never reached it, or only in part). A timeout is not sent again (the server may be at work on it), nor is
    anything that fails once the answer has begun: those are the run's failures."""
    import aiohttp

    for resends_left in range(_UNANSWERED_RESENDS, -1, -1):
        try:
            return await session.post(url, json=body, headers=headers)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if not resends_left:
                raise


async def send_one(session, url: str, endpoint: str, body: dict, api_key: str | None) -> RequestResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult()
    start = last = time.perf_counter()
    chunks_with_text = 0
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    try:
        async with await post_answered(session, url + path, body, headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw_line in response.content:
                line = raw_line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                now = time.perf_counter()
                if payload.get("usage"):
                    result.output_tokens = payload["usage"]["completion_tokens"]
                if content_of(payload):
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    chunks_with_text += 1
                    last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks_with_text
        result.success = chunks_with_text > 0
    except Exception as exc:  # a failure is a figure of the benchmark, not a crash of it
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def arrival_gap(rng: random.Random, request_rate: float, burstiness: float = 1.0) -> float:
    """Seconds before the next request is sent: gamma-distributed with mean 1/request_rate, as vLLM's benchmark draws
    them (burstiness 1: a Poisson process; below 1 the requests come in clumps with long pauses between them, above 1
    more evenly); none at rate inf."""
    if request_rate == float("inf"):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))


async def run_load(url: str, models: list[str], requests: list[BenchRequest], request_rate: float, max_concurrency: int | None,
                   api_key: str | None, seed: int, endpoint: str = "completions", sampling: Sampling | None = None,
                   burstiness: float = 1.0) -> tuple[list[RequestResult], float]:
    """models: the names the requests are sent to, in turn."""
    import aiohttp

    rng = random.Random(seed)
    bodies = [request_body(endpoint, models[index % len(models)], request, sampling or Sampling(), rng)
              for index, request in enumerate(requests)]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(requests), desc="requests", unit="req")
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def limited(body):
            async with limit:
                result = await send_one(session, url, endpoint, body, api_key)
            progress.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if request_rate != float("inf"):
                await asyncio.sleep(arrival_gap(rng, request_rate, burstiness))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return results, duration


PERCENTILES = (50, 90, 99)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [gap for r in ok for gap in r.itls],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "e2el": [r.latency for r in ok],
    }
    summary = {
        "completed": len(ok), "failures": len(results) - len(ok), "duration_s": duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration, "requests_per_s": len(ok) / duration,
    }
    for name, values in series.items():
        summary[f"{name}_mean_s"] = mean(values)
        summary.update({f"{name}_p{q}_s": percentile(values, q) for q in PERCENTILES})
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


def summarize_health(probe: dict) -> dict:
    """The /health probe's latencies during a run: how long a load balancer's check waits on the loaded server."""
    latencies = probe["latencies"]
    return {"health_probes": len(latencies), "health_failures": probe["failures"],
            **{f"health_p{q}_s": percentile(latencies, q) for q in (50, 99)},
            "health_max_s": max(latencies, default=float("nan"))}


def median_summary(repeats: list[dict]) -> dict:
    """One run's summary, or the median of each figure over repeated runs (failures: their sum; the
    runs themselves under "repeats")."""
    if len(repeats) == 1:
        return repeats[0]
    merged = {key: statistics.median(one[key] for one in repeats) for key, value in repeats[0].items() if isinstance(value, float)}
    merged["completed"] = sum(one["completed"] for one in repeats)
    merged["failures"] = sum(one["failures"] for one in repeats)
    for count in ("health_probes", "health_failures"):
        if count in repeats[0]:
            merged[count] = sum(one[count] for one in repeats)
    merged["errors"] = sorted({error for one in repeats for error in one["errors"]})[:5]
    merged["repeats"] = repeats
    return merged


@contextlib.contextmanager
def own_server(model: str | None, extra_args: list[str], subcommand: str = "serve", cpus: set[int] | None = None):
    """A `pagedserve serve` (or another HTTP subcommand: proxy) of its own, on a free port; cpus: the only processors
    it and its children may run on."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", subcommand, "--port", str(port), *extra_args]
    if subcommand == "serve":
        command += ["--model", model, "--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, envs.PAGEDSERVE_LOG_LEVEL: "WARNING"},
                               preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _wait_healthy(url: str, process, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        time.sleep(0.25)
    raise RuntimeError("the server did not become healthy")


def make_requests(args, seed: int) -> list[BenchRequest]:
    if args.dataset == "mixed":
        return mixed_requests(args.num_prompts, args.vocab_size, seed=seed)
    if args.dataset == "chat":
        return chat_requests(args.num_prompts, seed=seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, seed=seed)


def workload_name(args) -> str:
    shape = f"input {args.input_len}, output {args.output_len}" if args.dataset == "random" else f"{args.dataset} dataset"
    return f"{args.num_prompts} requests, {shape}, {args.endpoint}"


def prompt_seed(seed: int | None) -> int:
    """The seed of an invocation's prompts: the one given, or a new one, so that a second invocation against a
    server that stays up sends prompts its prefix cache has not seen."""
    return seed if seed is not None else random.SystemRandom().randrange(2**31)


def run(args) -> dict:
    rates = [float(rate) for rate in args.request_rate]
    concurrencies = args.max_concurrency or [None]
    temperatures = args.temperature
    structures = getattr(args, "structure", ["none"])
    records = []
    seed = prompt_seed(args.seed)
    seeds = itertools.count(seed)
    with (contextlib.nullcontext(args.base_url) if args.base_url else own_server(args.model, args.server_args)) as url:
        models = args.served_model or [first_model(url, args.api_key)]
        for structure, temperature, rate, concurrency in itertools.product(structures, temperatures, rates, concurrencies):
            sampling = Sampling(temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty, args.frequency_penalty,
                                args.presence_penalty, args.seeded, structure)
            repeats = []
            for _ in range(args.repeats):
                # Fresh prompts for each run: a server's prefix cache must not turn later runs into cache hits.
                requests = make_requests(args, seed=next(seeds))
                with _probing(url, args.health_interval) as probe:
                    results, duration = asyncio.run(run_load(url, models, requests, rate, concurrency, args.api_key, seed,
                                                             args.endpoint, sampling, args.burstiness))
                repeats.append(summarize(results, duration) | (summarize_health(probe) if probe else {}))
            summary = {"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": concurrency, **sampling.fields(),
                       "seeded": sampling.seeded,
                       "structure": structure, **median_summary(repeats)}
            records.append(summary)
            title = f"serve ({workload_name(args)}, temperature {temperature:g}, rate {rate}"
            title += f", burstiness {args.burstiness:g}" if args.burstiness != 1.0 and rate != float("inf") else ""
            title += f", structure {structure}" if structure != "none" else ""
            title += f", max concurrency {concurrency}" if concurrency else ""
            print_table(title + (f", median of {len(repeats)} runs)" if len(repeats) > 1 else ")"), [
                ("output tokens/s", summary["output_tokens_per_s"]), ("TTFT p50 s", summary["ttft_p50_s"]),
                ("TTFT p99 s", summary["ttft_p99_s"]), ("TPOT mean s", summary["tpot_mean_s"]),
                ("ITL p50 s", summary["itl_p50_s"]), ("ITL p99 s", summary["itl_p99_s"]),
                ("failures", summary["failures"]), ("duration s", summary["duration_s"]),
                *([("/health p50 s", summary["health_p50_s"]), ("/health p99 s", summary["health_p99_s"]),
                   ("/health max s", summary["health_max_s"]), ("/health probes (failed)",
                                                                f"{summary['health_probes']} ({summary['health_failures']})")]
                  if "health_p50_s" in summary else []),
                *([("output tokens/s, each run", ", ".join(f"{one['output_tokens_per_s']:.1f}" for one in repeats))]
                  if len(repeats) > 1 else []),
            ])
    record = {"benchmark": "serve", "label": args.label or ("pagedserve" if not args.base_url else args.base_url),
              "base_url": args.base_url, "served_models": models, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len,
              "dataset": args.dataset, "endpoint": args.endpoint, "seed": seed, "runs": records}
    write_json(args.json, record)
    return record


def _probing(url: str, interval_s: float):
    """The /health probe during one run, when an interval is set."""
    return health_probe(url, interval_s) if interval_s > 0 else contextlib.nullcontext(None)


def server_metrics(url: str) -> dict[str, float]:
    """The server's /metrics: each sample's name (a counter's with its _total) -> its value, summed over label sets (a
    data-parallel server's engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def first_model(url: str, api_key: str | None) -> str:
    import urllib.request

    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"][0]["id"]
