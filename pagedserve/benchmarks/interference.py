"""Interference: 16 decoding streams while a long prompt arrives; their inter-token latency
during its prefill, with chunked prefill (small per-step chunks) vs the whole prompt in one step."""

from __future__ import annotations

import random

from pagedserve.benchmarks.report import percentile, print_table, write_json
from pagedserve.benchmarks.timed_run import TimedRun
from pagedserve.sampling_params import SamplingParams


def _run(args, chunked: bool) -> dict:
    from pagedserve import LLM

    rng = random.Random(args.seed)
    overrides = dict(args.engine_overrides)
    if chunked:
        overrides["long_prefill_token_threshold"] = args.chunk_size
    else:
        overrides["max_num_batched_tokens"] = max(overrides.get("max_num_batched_tokens", 0), args.long_prompt_len + 64)
    llm = LLM(args.model, **overrides)
    run = TimedRun(llm.llm_engine)
    stream_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
    for index in range(16):
        run.add(f"stream{index}", [rng.randrange(100, 40000) for _ in range(64)], stream_params)
    for _ in range(8):  # the streams are decoding
        run.step()
    run.add("long", [rng.randrange(100, 40000) for _ in range(args.long_prompt_len)], SamplingParams(temperature=0, max_tokens=1))
    long_arrival = run.times["long"].arrival
    while not run.times["long"].token_times:
        run.step()
    prefill_end = run.times["long"].token_times[0]
    itls = [
        b - a
        for rid, times in run.times.items() if rid != "long"
        for a, b in zip(times.token_times, times.token_times[1:])
        if b > long_arrival and a < prefill_end
    ]
    for rid in list(run.times):
        llm.llm_engine.abort_request(rid)
    return {"itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99), "prefill_s": prefill_end - long_arrival}


def run(args) -> dict:
    chunked, whole = _run(args, True), _run(args, False)
    record = {"benchmark": "interference", "long_prompt_len": args.long_prompt_len, "chunk_size": args.chunk_size,
              "chunked": chunked, "unchunked": whole, "chunked_p99_over_p50": chunked["itl_p99_s"] / chunked["itl_p50_s"]}
    print_table(f"interference (16 streams, {args.long_prompt_len}-token prompt arrives)", [
        (f"ITL p50 s, chunked ({args.chunk_size}/step)", chunked["itl_p50_s"]), ("ITL p99 s, chunked", chunked["itl_p99_s"]),
        ("p99 / p50, chunked", record["chunked_p99_over_p50"]), ("long prefill s, chunked", chunked["prefill_s"]),
        ("ITL p50 s, whole prompt in one step", whole["itl_p50_s"]), ("ITL p99 s, whole prompt", whole["itl_p99_s"]),
        ("long prefill s, whole prompt", whole["prefill_s"]),
    ])
    write_json(args.json, record)
    return record
