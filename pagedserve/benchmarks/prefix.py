"""Prefix caching: 32 requests sharing a long prefix, TTFT and total time with caching on vs off."""

from __future__ import annotations

import random
import time

from pagedserve.benchmarks.report import mean, print_table, write_json
from pagedserve.benchmarks.timed_run import TimedRun
from pagedserve.sampling_params import SamplingParams


def _run(args, enable_prefix_caching: bool, prompts: list[list[int]]) -> tuple[float, float, int]:
    from pagedserve.engine.llm import LLM

    llm = LLM(args.model, enable_prefix_caching=enable_prefix_caching, **args.engine_overrides)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    llm.generate({"prompt_token_ids": [7] * 32}, params, use_tqdm=False)  # warm-up, shares nothing with the prompts
    run = TimedRun(llm.llm_engine)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        run.add(str(index), prompt, params)
    run.run_until_done()
    total = time.perf_counter() - start
    return mean([t.ttft for t in run.times.values()]), total, sum(t.num_cached_tokens for t in run.times.values())


def run(args) -> dict:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(16)] for _ in range(args.num_prompts)]
    ttft_on, total_on, cached_on = _run(args, True, prompts)
    ttft_off, total_off, cached_off = _run(args, False, prompts)
    record = {"benchmark": "prefix", "num_prompts": len(prompts), "prefix_len": args.prefix_len,
              "mean_ttft_cached_s": ttft_on, "mean_ttft_uncached_s": ttft_off, "ttft_ratio": ttft_on / ttft_off,
              "total_cached_s": total_on, "total_uncached_s": total_off, "total_ratio": total_on / total_off,
              "prompt_tokens": sum(len(p) for p in prompts), "cached_prompt_tokens": cached_on,
              "cached_prompt_tokens_uncached_run": cached_off}
    print_table(f"prefix caching ({len(prompts)} requests, {args.prefix_len}-token shared prefix)", [
        ("mean TTFT cached s", ttft_on), ("mean TTFT uncached s", ttft_off), ("TTFT cached / uncached", record["ttft_ratio"]),
        ("total cached s", total_on), ("total uncached s", total_off), ("total cached / uncached", record["total_ratio"]),
        ("prompt tokens from the cache", cached_on),
    ])
    write_json(args.json, record)
    return record
