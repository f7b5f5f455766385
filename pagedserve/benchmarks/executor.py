"""The executor's own cost per step with several ranks: a step's scheduler output sent to every rank and
the sampled tokens sent back, timed with no model run (each rank's steps answered at once)."""

from __future__ import annotations

import statistics
import time

from pagedserve.benchmarks import worker_probes
from pagedserve.benchmarks.report import percentile, print_table, write_json
from pagedserve.core.contracts import ModelRunnerOutput, RunningRequestData, SchedulerOutput


def run(args) -> dict:
    from pagedserve.engine.llm import LLM

    llm = LLM(args.model, **args.engine_overrides)
    config = llm.llm_engine.config
    try:
        if config.executor_backend == "uni":
            raise ValueError("the executor's per-step messages are timed only with several ranks (distributed_executor_backend mp)")
        seconds = time_step_messages(llm.llm_engine, args.num_running, args.steps)
    finally:
        llm.llm_engine.shutdown()
    record = {"benchmark": "executor", "num_running": args.num_running, "steps": args.steps,
              "tensor_parallel_size": config.tensor_parallel_size, "pipeline_parallel_size": config.pipeline_parallel_size,
              "median_us_per_step": statistics.median(seconds) * 1e6, "p99_us_per_step": percentile(seconds, 99) * 1e6}
    print_table(f"executor messages per step ({config.world_size} ranks, {args.num_running} running decodes, no model)", [
        ("median us / step", record["median_us_per_step"]), ("p99 us / step", record["p99_us_per_step"]),
    ])
    write_json(args.json, record)
    return record


def time_step_messages(engine, num_running: int, steps: int) -> list[float]:
    """Seconds of each of `steps` round trips of a step's messages between the engine core's executor and its ranks,
    without the model: a step of num_running decodes (a sixteenth of them with a new block) one way, their sampled
    tokens back from the output rank."""
    ids = [f"request-{index}" for index in range(num_running)]
    scheduler_output = SchedulerOutput([], [RunningRequestData(i, [7]) for i in ids[::16]], dict.fromkeys(ids, 1), num_running)
    reply = ModelRunnerOutput(sampled_token_ids=dict.fromkeys(ids, 1234))
    executor = engine.client.engine_core.executor  # the offline engine runs its core in this process
    engine.call_utility("collective_rpc", worker_probes.answer_steps_with, reply)
    seconds = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            executor.execute_model(scheduler_output)
            seconds.append(time.perf_counter() - start)
    finally:
        engine.call_utility("collective_rpc", worker_probes.run_steps_on_the_model)
    return seconds
