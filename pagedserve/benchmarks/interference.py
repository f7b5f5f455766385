"""Interference: 16 decoding streams while a long prompt arrives; their inter-token latency during its
prefill, three ways: the default stall-free scheduling (prompt tokens per step bounded in time), fixed
small chunks per step (no time bound), and the whole prompt in one step."""

from __future__ import annotations

import random

from pagedserve.benchmarks.report import percentile, print_table, write_json
from pagedserve.benchmarks.timed_run import TimedRun
from pagedserve.sampling_params import SamplingParams

# How each arm sets the engine up: (stall-free time bound on, chunk cap on, budget for the whole prompt).
ARMS = {"stall_free": (True, False, False), "chunked": (False, True, False), "whole": (False, False, True)}


def _run(args, arm: str) -> dict:
    from pagedserve.engine.llm import LLM

    rng = random.Random(args.seed)
    overrides = dict(args.engine_overrides)
    time_bound, chunk_cap, whole_prompt = ARMS[arm]
    if not time_bound:
        overrides["max_decode_stall"] = "off"
    if chunk_cap:
        overrides["long_prefill_token_threshold"] = args.chunk_size
    if whole_prompt:
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
    streams = [times for rid, times in run.times.items() if rid != "long"]
    # Gaps before the long prompt arrived are decode-only steps: the yardstick of a stall.
    decode_only = [b - a for times in streams for a, b in zip(times.token_times, times.token_times[1:]) if b <= long_arrival]
    itls = [b - a for times in streams for a, b in zip(times.token_times, times.token_times[1:])
            if b > long_arrival and a < prefill_end]
    for rid in list(run.times):
        llm.llm_engine.abort_request(rid)
    return {"decode_only_itl_p50_s": percentile(decode_only, 50), "itl_p50_s": percentile(itls, 50),
            "itl_p99_s": percentile(itls, 99), "prefill_s": prefill_end - long_arrival}


def run(args) -> dict:
    arms = {arm: _run(args, arm) for arm in ARMS}
    record = {"benchmark": "interference", "long_prompt_len": args.long_prompt_len, "chunk_size": args.chunk_size, **arms,
              **{f"{arm}_p99_over_p50": figures["itl_p99_s"] / figures["itl_p50_s"] for arm, figures in arms.items()},
              **{f"{arm}_p99_over_decode_only": figures["itl_p99_s"] / figures["decode_only_itl_p50_s"]
                 for arm, figures in arms.items()}}
    names = {"stall_free": "stall-free (defaults)", "chunked": f"chunks of {args.chunk_size}, no time bound",
             "whole": "whole prompt in one step"}
    rows = []
    for arm, figures in arms.items():
        rows += [(f"{names[arm]}: decode-only ITL p50 s", figures["decode_only_itl_p50_s"]),
                 (f"{names[arm]}: ITL p50 / p99 s", f"{figures['itl_p50_s']:.3f} / {figures['itl_p99_s']:.3f}"),
                 (f"{names[arm]}: ITL p99 / p50", record[f"{arm}_p99_over_p50"]),
                 (f"{names[arm]}: ITL p99 / decode-only p50", record[f"{arm}_p99_over_decode_only"]),
                 (f"{names[arm]}: long prefill s", figures["prefill_s"])]
    print_table(f"interference (16 streams, {args.long_prompt_len}-token prompt arrives)", rows)
    write_json(args.json, record)
    return record
