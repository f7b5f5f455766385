"""Benchmarks of the KV cache manager and scheduler alone (no model)."""

from __future__ import annotations

import dataclasses
import random
import time

from pagedserve.benchmarks.output_path import STAGES, time_output_path
from pagedserve.benchmarks.report import percentile, print_table, write_json
from pagedserve.config import DecodeStallLimit, EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.step_time import uniform_step_shape
from pagedserve.executor.host_costs import time_input_preparation, time_sampled_bookkeeping, time_sampling_metadata
from pagedserve.executor.input_batch import RunnerRequests, RunnerRequestState
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def run_kv(args) -> dict:
    """Fill the cache with requests of mixed lengths: slots allocated vs tokens stored; and what the model's cache holds
    in kv_cache_memory for each kv_cache_dtype."""
    rng = random.Random(args.seed)
    block_size, num_blocks, max_model_len = args.block_size, args.num_blocks, args.max_model_len
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    stored, admitted = 0, 0
    while True:
        length = rng.randint(64, 2 * args.mean_len - 64)
        request = Request(str(admitted), [rng.randrange(100, 40000) for _ in range(length)], SamplingParams())
        if kv.allocate_slots(request, length) is None:
            break
        stored += length
        admitted += 1
    allocated = (num_blocks - kv.num_free_blocks) * block_size
    reservation = (num_blocks * block_size) // max_model_len
    record = {"benchmark": "kv", "block_size": block_size, "num_blocks": num_blocks, "mean_seq_len": stored / admitted,
              "slots_allocated": allocated, "tokens_stored": stored, "waste_pct": 100 * (allocated - stored) / allocated,
              "max_concurrent_requests": admitted, "max_concurrent_with_max_len_reservation": reservation}
    print_table("kv cache (mixed lengths)", [
        ("mean sequence length", record["mean_seq_len"]), ("slots allocated", allocated), ("tokens stored", stored),
        ("waste %", record["waste_pct"]), ("concurrent requests (paged)", admitted),
        (f"concurrent requests (reserve max_model_len={max_model_len})", reservation),
    ])
    record["capacity_by_dtype"] = capacity_by_dtype(args.model, args.kv_cache_memory, block_size, max_model_len)
    print_table(f"kv cache capacity ({args.model}, {args.kv_cache_memory / 2**30:g} GiB, max_model_len {max_model_len})", [
        (f"{dtype}: blocks, tokens, concurrency", f"{c['blocks']}, {c['tokens']}, {c['concurrency']:.2f}x")
        for dtype, c in record["capacity_by_dtype"].items()])
    write_json(args.json, record)
    return record


KV_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")


def capacity_by_dtype(model: str, kv_cache_memory: int, block_size: int, max_model_len: int) -> dict:
    """Blocks, tokens and requests of max_model_len a model's KV cache holds in kv_cache_memory bytes, per cache dtype
    (the engine's own layout: executor/worker.py)."""
    from pagedserve.executor.worker import kv_cache_blocks

    capacity = {}
    for dtype in KV_DTYPES:
        blocks = kv_cache_blocks(model, dtype, kv_cache_memory, block_size)
        capacity[dtype] = {"blocks": blocks, "tokens": blocks * block_size, "concurrency": blocks * block_size / max_model_len}
    return capacity


def run_sched(args) -> dict:
    """Microseconds per schedule() + update_from_output() with many running decodes and a waiting queue, under the
    engine's default time bound on prompt work (its step-time model fit to warm-up-like steps). The runner's output,
    which the bench makes up between the two, is not timed. Then the step's other host work at the same batch, each part
    on its own: the runner's input preparation, sampling metadata and record of the sampled tokens, and the outputs' way
    to the clients."""
    rng = random.Random(args.seed)
    kv = KVCacheManager(args.num_blocks, 16, enable_caching=True)
    scheduler = Scheduler(kv, max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=args.num_running,
                          max_decode_stall=DecodeStallLimit.parse(EngineConfig.max_decode_stall))
    for num_seqs, seq_len, context in ((1, 1, 128), (64, 1, 128), (256, 1, 1024), (1, 128, 0), (8, 128, 0), (1, 512, 0)):
        scheduler.observe_step(uniform_step_shape(num_seqs, seq_len, context), 1e-3 * (1 + num_seqs * seq_len / 64))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4000)
    for index in range(args.num_running + 64):
        scheduler.add_request(Request(str(index), [rng.randrange(100, 40000) for _ in range(128)], params))
    while len(scheduler.running) < args.num_running or any(request.num_tokens - request.num_computed_tokens > 1
                                                           for request in scheduler.running):
        _step(scheduler)  # prefill as many as may run; the rest waits
    durations = []
    for _ in range(args.steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        runner_output = _runner_output(scheduler, output)
        updating = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        durations.append(scheduled - start + time.perf_counter() - updating)
    median_us, p99_us = _median_and_p99_us(durations)
    record = {"benchmark": "sched", "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
              "median_us_per_step": median_us, "p99_us_per_step": p99_us}
    requests, output = _runner_requests(scheduler)
    sampling_ids, sampled = list(output.num_scheduled_tokens), _sampled(requests, list(output.num_scheduled_tokens))
    for name, durations in (("prepare_inputs", time_input_preparation(requests, output.num_scheduled_tokens, kv.block_size, args.steps)),
                            ("sampling_metadata_greedy", time_sampling_metadata(requests, sampling_ids, args.steps)),
                            ("sampling_metadata_sampled", time_sampling_metadata(sampled, sampling_ids, args.steps)),
                            ("sampled_bookkeeping", time_sampled_bookkeeping(requests, output.num_scheduled_tokens, args.steps))):
        record[f"{name}_median_us"], record[f"{name}_p99_us"] = _median_and_p99_us(durations)
    for stage, durations in time_output_path(args.model, len(sampling_ids), args.steps, args.seed).items():
        record[f"output_{stage}_median_us"], record[f"output_{stage}_p99_us"] = _median_and_p99_us(durations)
    print_table("scheduler + KV manager step (no model)", [
        ("running requests", record["num_running"]), ("waiting requests", record["num_waiting"]),
        ("median us / step", median_us), ("p99 us / step", p99_us),
        ("runner input preparation, median / p99 us", f"{record['prepare_inputs_median_us']:.0f} / {record['prepare_inputs_p99_us']:.0f}"),
        ("runner sampling metadata, greedy, median / p99 us",
         f"{record['sampling_metadata_greedy_median_us']:.0f} / {record['sampling_metadata_greedy_p99_us']:.0f}"),
        ("runner sampling metadata, temperature 1, median / p99 us",
         f"{record['sampling_metadata_sampled_median_us']:.0f} / {record['sampling_metadata_sampled_p99_us']:.0f}"),
        ("runner's record of the sampled tokens, median / p99 us",
         f"{record['sampled_bookkeeping_median_us']:.0f} / {record['sampled_bookkeeping_p99_us']:.0f}"),
        *((f"the step's outputs: {label}, median / p99 us",
           f"{record[f'output_{stage}_median_us']:.0f} / {record[f'output_{stage}_p99_us']:.0f}")
          for stage, label in STAGES.items()),
    ])
    write_json(args.json, record)
    return record


def _step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    scheduler.update_from_output(output, _runner_output(scheduler, output))


def _runner_output(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """A token for each request the step brings to the end of its known tokens."""
    requests = scheduler.requests
    return ModelRunnerOutput(sampled_token_ids={request_id: 7 for request_id in output.num_scheduled_tokens
                                                if requests[request_id].num_computed_tokens == requests[request_id].num_tokens})


def _median_and_p99_us(durations: list[float]) -> tuple[float, float]:
    return percentile(durations, 50) * 1e6, percentile(durations, 99) * 1e6


def _runner_requests(scheduler: Scheduler) -> tuple[RunnerRequests, SchedulerOutput]:
    """The scheduler's next step (every running request's decode), and the runner's copy of each request in it."""
    output = scheduler.schedule()
    kv = scheduler.kv_cache_manager
    requests = RunnerRequests()
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        requests.add(RunnerRequestState(request_id, list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                                        kv.block_ids(request_id)), request.num_computed_tokens - num_tokens)
    return requests, output


def _sampled(requests: RunnerRequests, request_ids: list[str]) -> RunnerRequests:
    """The same requests, drawing at temperature 1."""
    sampled = RunnerRequests()
    for state in requests.of(request_ids):
        sampled.add(dataclasses.replace(state, sampling_params=dataclasses.replace(state.sampling_params, temperature=1.0)),
                    requests.num_computed_of(state.request_id))
    return sampled
