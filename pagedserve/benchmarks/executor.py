"""The executor's own cost per step with several ranks: a step's scheduler output sent to every rank and
the sampled tokens sent back, timed with no model run (ModelRunner work excluded)."""

from __future__ import annotations

import statistics

from pagedserve.benchmarks.report import percentile, print_table, write_json


def run(args) -> dict:
    from pagedserve import LLM

    llm = LLM(args.model, **args.engine_overrides)
    try:
        seconds = llm.llm_engine.call_utility("time_step_messages", args.num_running, args.steps)
    finally:
        llm.llm_engine.shutdown()
    config = llm.llm_engine.config
    record = {"benchmark": "executor", "num_running": args.num_running, "steps": args.steps,
              "tensor_parallel_size": config.tensor_parallel_size, "pipeline_parallel_size": config.pipeline_parallel_size,
              "median_us_per_step": statistics.median(seconds) * 1e6, "p99_us_per_step": percentile(seconds, 99) * 1e6}
    print_table(f"executor messages per step ({config.world_size} ranks, {args.num_running} running decodes, no model)", [
        ("median us / step", record["median_us_per_step"]), ("p99 us / step", record["p99_us_per_step"]),
    ])
    write_json(args.json, record)
    return record
