"""Speculative decoding on vs off, side by side: a streaming client against two servers (without, then with
speculation) asking to repeat or lightly edit English passages at several concurrencies, and the offline
random-token throughput workload with and without it (where drafts rarely match: the cost of trying)."""

from __future__ import annotations

import asyncio
import json
import time

from pagedserve.benchmarks.datasets import copy_requests, random_requests
from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.benchmarks.serve import Sampling, first_model, own_server, run_load, server_metrics, summarize
from pagedserve.benchmarks.throughput import run_pagedserve


def spec_counters(url: str) -> tuple[float, float]:
    """(drafts, accepted tokens) so far, from the server's /metrics (zeros without speculation)."""
    metrics = server_metrics(url)
    return metrics.get("pagedserve:spec_decode_num_drafts_total", 0.0), metrics.get("pagedserve:spec_decode_num_accepted_tokens_total", 0.0)


def mean_accepted_length(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Tokens one verification yields on average (its accepted drafts and the token sampled after them)."""
    drafts = after[0] - before[0]
    return 1 + (after[1] - before[1]) / drafts if drafts else None


def run_copy_workload(args, spec_json: str | None) -> list[dict]:
    server_args = [*args.server_args, *(["--speculative-config", spec_json] if spec_json else [])]
    rows = []
    with own_server(args.model, server_args) as url:
        model = first_model(url, None)
        for concurrency in args.concurrency:
            requests = copy_requests(max(args.requests_per_user * concurrency, args.requests_per_user), seed=args.seed + concurrency)
            before = spec_counters(url)
            results, duration = asyncio.run(run_load(url, [model], requests, float("inf"), concurrency, None, args.seed, "chat",
                                                     Sampling(temperature=0.0)))
            summary = summarize(results, duration)
            rows.append({"speculation": spec_json is not None, "concurrency": concurrency,
                         "mean_accepted_length": mean_accepted_length(before, spec_counters(url)), **summary})
    return rows


def run_random_throughput(args, spec: dict | None) -> dict:
    from pagedserve.engine.llm import LLM

    llm = LLM(args.model, **({"speculative_config": spec} if spec else {}))
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, llm.get_tokenizer().vocab_size, seed=args.seed)
    run_pagedserve(llm, requests[:4])  # the first steps of a fresh engine pay one-time costs
    elapsed = run_pagedserve(llm, requests)
    stats = llm.llm_engine.get_stats().spec
    result = {"speculation": spec is not None, "output_tokens_per_s": args.num_prompts * args.output_len / elapsed,
              "drafts": stats.num_drafts if stats else 0,
              "mean_accepted_length": 1 + stats.num_accepted_tokens / stats.num_drafts if stats and stats.num_drafts else None}
    del llm
    time.sleep(1)  # the engine's memory goes back before the next one loads
    return result


def run(args) -> dict:
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    spec_json = json.dumps(spec)
    # Off, then on: each setting's server runs alone.
    rows = run_copy_workload(args, None) + run_copy_workload(args, spec_json)
    record = {"benchmark": "spec", "speculative_config": spec, "copy": rows}
    for concurrency in args.concurrency:
        off, on = (next(r for r in rows if r["concurrency"] == concurrency and r["speculation"] == flag) for flag in (False, True))
        print_table(f"spec: copy workload, {concurrency} concurrent user(s), greedy, n-gram k={args.num_speculative_tokens}", [
            ("output tokens/s off", off["output_tokens_per_s"]), ("output tokens/s on", on["output_tokens_per_s"]),
            ("speed-up", on["output_tokens_per_s"] / off["output_tokens_per_s"]),
            ("TPOT mean s off", off["tpot_mean_s"]), ("TPOT mean s on", on["tpot_mean_s"]),
            ("mean accepted length", on["mean_accepted_length"] or 0.0), ("failures", off["failures"] + on["failures"]),
        ])
    if args.random_throughput:
        off, on = run_random_throughput(args, None), run_random_throughput(args, spec)
        record["random_throughput"] = [off, on]
        print_table(f"spec: random-token throughput ({args.num_prompts} x {args.input_len} in / {args.output_len} out)", [
            ("output tokens/s off", off["output_tokens_per_s"]), ("output tokens/s on", on["output_tokens_per_s"]),
            ("ratio on/off", on["output_tokens_per_s"] / off["output_tokens_per_s"]), ("drafts verified", on["drafts"]),
            ("mean accepted length", on["mean_accepted_length"] or 0.0),
        ])
    write_json(args.json, record)
    return record
