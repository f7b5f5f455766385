"""Disaggregated prefill and decode against one instance: streams decoding while long prompts keep arriving, served
(a) by one server with every core, and (b) by `pagedserve proxy` over a prefill server and a decode server
(P2pConnector), each on its own share of the cores. The streams' inter-token latency is what disaggregation buys (no
prefill runs beside their decodes); the long prompts' time to first token and the output rate are its price."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random

from pagedserve.benchmarks.report import percentile, print_table, write_json
from pagedserve.benchmarks.serve import RequestResult, own_server, prompt_seed, send_one, server_metrics
from pagedserve.ports import free_port_range

MODEL_NAME = "pd"


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}


async def _load(url: str, args, rng: random.Random) -> tuple[list[RequestResult], list[RequestResult], float]:
    """(the streams' results, the long prompts' results, seconds of the run)."""
    import time

    import aiohttp

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, args.vocab_size) for _ in range(length)]

    streams = [_body(prompt(args.stream_input_len), args.stream_output_len) for _ in range(args.num_streams)]
    longs = [_body(prompt(args.long_prompt_len), args.long_output_len) for _ in range(args.num_long)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        stream_tasks = [asyncio.ensure_future(send_one(session, url, "completions", body, None)) for body in streams]
        long_tasks = []
        await asyncio.sleep(args.first_long_after)  # the streams are decoding
        for body in longs:
            long_tasks.append(asyncio.ensure_future(send_one(session, url, "completions", body, None)))
            await asyncio.sleep(args.long_interval)
        stream_results = await asyncio.gather(*stream_tasks)
        long_results = await asyncio.gather(*long_tasks)
        return stream_results, long_results, time.perf_counter() - start


def _figures(streams: list[RequestResult], longs: list[RequestResult], seconds: float) -> dict:
    itls = [gap for result in streams if result.success for gap in result.itls]
    long_ttfts = [result.ttft for result in longs if result.success]
    figures = {
        "failures": sum(not result.success for result in (*streams, *longs)),
        "errors": sorted({result.error for result in (*streams, *longs) if result.error})[:3],
        "stream_itl_p50_s": percentile(itls, 50), "stream_itl_p99_s": percentile(itls, 99),
        "stream_ttft_p50_s": percentile([r.ttft for r in streams if r.success], 50),
        "long_ttft_p50_s": percentile(long_ttfts, 50), "long_ttft_p99_s": percentile(long_ttfts, 99),
        # The streams' own rate, over the time until the last of them ended (the long prompts' arrivals set the run's length).
        "stream_output_tokens_per_s": sum(r.output_tokens for r in streams if r.success) / max(r.latency for r in streams if r.success),
        "run_s": seconds,
    }
    figures["stream_itl_p99_over_p50"] = figures["stream_itl_p99_s"] / figures["stream_itl_p50_s"]
    return figures


def _one_instance(args, seed: int) -> dict:
    with own_server(args.model, ["--served-model-name", MODEL_NAME, *args.server_args]) as url:
        streams, longs, seconds = asyncio.run(_load(url, args, random.Random(seed)))
    return _figures(streams, longs, seconds)


def _disaggregated(args, seed: int) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    prefill_cpus, decode_cpus = set(cpus[:half]), set(cpus[half:] or cpus[:half])
    ports = [free_port_range(8) for _ in range(2)]  # each engine's port, then its ranks'
    with contextlib.ExitStack() as stack:
        urls = []
        for role, port, share in (("kv_producer", ports[0], prefill_cpus), ("kv_consumer", ports[1], decode_cpus)):
            config = {"kv_connector": "P2pConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": port}}
            urls.append(stack.enter_context(own_server(
                args.model, ["--served-model-name", MODEL_NAME, "--num-threads", str(len(share)), "--kv-transfer-config",
                             json.dumps(config), *args.server_args], cpus=share)))
        proxy = stack.enter_context(own_server(None, ["--prefill", urls[0], "--decode", urls[1]], subcommand="proxy"))
        streams, longs, seconds = asyncio.run(_load(proxy, args, random.Random(seed)))
        figures = _figures(streams, longs, seconds)
        # Every request's prompt moves (the streams' too); a load's time runs from its admission, queueing included.
        metrics = server_metrics(urls[1])
        received, transfer_s = metrics["pagedserve:kv_transfer_received_tokens_total"], metrics["pagedserve:kv_transfer_seconds_sum"]
        figures["transferred_tokens"] = received
        figures["loads"] = metrics["pagedserve:kv_transfer_seconds_count"]
        figures["transfer_ms_per_prompt_token"] = 1000 * transfer_s / received if received else float("nan")
        figures["transferred_bytes"] = metrics["pagedserve:kv_transfer_received_bytes_total"]
        figures["transfer_mb_per_s"] = figures["transferred_bytes"] / transfer_s / 1e6 if transfer_s else float("nan")
    return figures


def run(args) -> dict:
    seed = prompt_seed(args.seed)
    arms = {"one_instance": _one_instance(args, seed), "disaggregated": _disaggregated(args, seed)}
    one, pd = arms["one_instance"], arms["disaggregated"]
    record = {"benchmark": "pd", "seed": seed, "num_streams": args.num_streams, "stream_input_len": args.stream_input_len,
              "stream_output_len": args.stream_output_len, "num_long": args.num_long, "long_prompt_len": args.long_prompt_len,
              "long_interval_s": args.long_interval, **arms,
              "long_ttft_p50_ratio": pd["long_ttft_p50_s"] / one["long_ttft_p50_s"],
              "stream_output_tokens_per_s_ratio": pd["stream_output_tokens_per_s"] / one["stream_output_tokens_per_s"]}
    rows = []
    for name, figures in (("one instance, every core", one), ("proxy + prefill + decode, a core share each", pd)):
        rows += [(f"{name}: stream ITL p50 / p99 s", f"{figures['stream_itl_p50_s']:.3f} / {figures['stream_itl_p99_s']:.3f}"),
                 (f"{name}: stream ITL p99 / p50", figures["stream_itl_p99_over_p50"]),
                 (f"{name}: long prompt TTFT p50 / p99 s", f"{figures['long_ttft_p50_s']:.2f} / {figures['long_ttft_p99_s']:.2f}"),
                 (f"{name}: the streams' output tokens/s", figures["stream_output_tokens_per_s"]),
                 (f"{name}: failures", figures["failures"])]
    rows += [("disaggregated: KV loads, prompt tokens moved", f"{pd['loads']:.0f}, {pd['transferred_tokens']:.0f}"),
             ("disaggregated: KV transfer ms per prompt token (MB/s)",
              f"{pd['transfer_ms_per_prompt_token']:.3f} ({pd['transfer_mb_per_s']:.0f})"),
             ("disaggregated / one instance: long TTFT p50", record["long_ttft_p50_ratio"]),
             ("disaggregated / one instance: the streams' output tokens/s", record["stream_output_tokens_per_s_ratio"])]
    print_table(f"disaggregated prefill and decode ({args.num_streams} streams of {args.stream_input_len} in / "
                f"{args.stream_output_len} out, {args.num_long} prompts of {args.long_prompt_len} arriving)", rows)
    write_json(args.json, record)
    return record
