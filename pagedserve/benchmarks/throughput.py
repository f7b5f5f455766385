"""Offline throughput: LLM.generate on a fixed set of prompts, optionally beside HF static batching
and the model's bare forward pass (the compute ceiling of this machine)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.benchmarks.ceiling import ceiling_seconds, workload_ceiling
from pagedserve.benchmarks.datasets import BenchRequest, mixed_requests, random_requests
from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.executor.abstract import Executor


def make_requests(args, vocab_size: int, seed: int) -> list[BenchRequest]:
    if args.dataset == "mixed":
        return mixed_requests(args.num_prompts, vocab_size, seed=seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size, seed=seed)


def run_pagedserve(llm, requests: list[BenchRequest]) -> float:
    from pagedserve.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outputs, requests))
    return elapsed


class HFStaticBatching:
    """transformers' generate() on a benchmark's requests, in a process of its own with the user's environment as it was
    before pagedserve set its OpenMP defaults (see hf_static_batching.py). The model loads once; the process waits
    for each run's requests in between, so the runs beside it have the machine to themselves."""

    def __init__(self, model_dir: str) -> None:
        from pagedserve.openmp import environment_without_openmp_defaults

        self._errors = tempfile.TemporaryFile("w+")  # a file, so that a chatty stderr never fills a pipe and blocks it
        self._process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("hf_static_batching.py")), model_dir],
                                         env=environment_without_openmp_defaults(), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._errors, text=True)
        self._answer()  # loaded before any run is timed: loading beside a run would slow it

    def seconds(self, requests: list[BenchRequest]) -> float:
        """How long generate() took on these requests."""
        batch = [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests]
        try:
            self._process.stdin.write(json.dumps(batch) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # it has died: what it said is read below
        return float(self._answer())

    def _answer(self) -> str:
        answer = self._process.stdout.readline()
        if not answer:
            self._process.wait()
            self._errors.seek(0)
            raise RuntimeError(f"the HF baseline failed:\n{self._errors.read()[-2000:]}")
        return answer

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait()
        self._errors.close()


def _one_run(args, llm, vocab_size: int, repeat: int, hf: HFStaticBatching | None) -> dict:
    # Fresh prompts each repeat, so the prefix cache cannot turn later repeats into hits; the
    # ceiling and HF run right after ours on the same prompts, so each ratio compares the same
    # minutes of the machine.
    requests = make_requests(args, vocab_size, seed=args.seed + repeat)
    one = {"prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "output_tokens": sum(r.output_len for r in requests),
           "elapsed_s": run_pagedserve(llm, requests)}
    if args.ceiling:
        one["ceiling"] = workload_ceiling(llm, requests)
    if hf is not None:
        one["hf_elapsed_s"] = hf.seconds(requests)
    return one


def run(args) -> dict:
    from pagedserve.engine.llm import LLM

    llm = LLM(args.model, **args.engine_overrides)
    mapping_s = wait_for_kv_cache_mapping(llm)
    vocab_size = llm.llm_engine.model_info.vocab_size
    model_dir = llm.llm_engine.model_info.model_dir
    runs = []
    # A converted GGUF model's directory keeps most weights as GGUF blocks alone: transformers reads its export.
    hf = HFStaticBatching(Executor.transformers_checkpoint(model_dir)) if args.baseline == "hf" else None
    try:
        for repeat in range(args.repeats):
            runs.append(_one_run(args, llm, vocab_size, repeat, hf))
    finally:
        if hf is not None:
            hf.close()
    record, rows = summarize(args, runs)
    record["kv_cache_mapping_s"] = mapping_s
    rows.append(("KV cache mapping before the runs, s", mapping_s))
    print_table(f"throughput ({args.dataset}, {args.num_prompts} prompts"
                + (f", median of {args.repeats} runs)" if args.repeats > 1 else ")"), rows)
    write_json(args.json, record)
    return record


def wait_for_kv_cache_mapping(llm) -> float:
    """Seconds spent waiting while the idle engine maps its KV cache's pages (prefault_kv_cache), so the
    runs start from an engine as a server is before its first requests, and as vLLM's CPU backend is
    after writing its whole cache at start-up. With --no-prefault-kv-cache the runs pay the first
    touches of their blocks instead."""
    start = time.perf_counter()
    llm.llm_engine.call_utility("wait_for_kv_cache_mapping")
    return time.perf_counter() - start


def summarize(args, runs: list[dict]) -> tuple[dict, list]:
    """Each figure is the median over the runs (of per-run values: with --dataset mixed each repeat
    draws other lengths); ratios are medians of per-run ratios."""
    for one in runs:
        _add_run_figures(one, args.num_prompts)
    record = {
        "benchmark": "throughput", "dataset": args.dataset, "num_prompts": args.num_prompts, "repeats": len(runs),
        "prompt_tokens": runs[0]["prompt_tokens"], "output_tokens": runs[0]["output_tokens"],
        "elapsed_s": _median(runs, "elapsed_s"), "requests_per_s": _median(runs, "requests_per_s"),
        "total_tokens_per_s": _median(runs, "total_tokens_per_s"), "output_tokens_per_s": _median(runs, "output_tokens_per_s"),
        "runs": runs,
    }
    rows = [("requests/s", record["requests_per_s"]), ("total tokens/s", record["total_tokens_per_s"]),
            ("output tokens/s", record["output_tokens_per_s"]), ("elapsed s", record["elapsed_s"])]
    if len(runs) > 1:
        rows.append(("total tokens/s, each run", ", ".join(f"{one['total_tokens_per_s']:.1f}" for one in runs)))
    if "ceiling" in runs[0]:
        rows += _ceiling_figures(record, runs)
    if "hf_elapsed_s" in runs[0]:
        rows += _hf_figures(record, runs)
    return record, rows


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(one[key] for one in runs)


def _add_run_figures(one: dict, num_prompts: int) -> None:
    tokens = one["prompt_tokens"] + one["output_tokens"]
    one["requests_per_s"] = num_prompts / one["elapsed_s"]
    one["total_tokens_per_s"] = tokens / one["elapsed_s"]
    one["output_tokens_per_s"] = one["output_tokens"] / one["elapsed_s"]
    if "ceiling" in one:
        for key, in_context in (("fraction_of_ceiling", False), ("fraction_of_ceiling_in_context", True)):
            one[key] = ceiling_seconds(one["ceiling"], one["prompt_tokens"], one["output_tokens"], in_context) / one["elapsed_s"]
        one["fraction_of_replayed_ceiling"] = one["ceiling"]["replay_s"] / one["elapsed_s"]
    if "hf_elapsed_s" in one:
        one["hf_total_tokens_per_s"] = tokens / one["hf_elapsed_s"]
        one["hf_output_tokens_per_s"] = one["output_tokens"] / one["hf_elapsed_s"]
        one["speedup_vs_hf"] = one["hf_elapsed_s"] / one["elapsed_s"]


def _ceiling_figures(record: dict, runs: list[dict]) -> list:
    first = runs[0]["ceiling"]
    rates = {key: statistics.median(one["ceiling"][key] for one in runs) for key, value in first.items() if not isinstance(value, str)}
    # The same in every run of uniform lengths; with --dataset mixed the first run's (each run keeps its own).
    rates["decode_context"] = first["decode_context"]
    record["gemm_dtype"], record["gemm_products"] = first["gemm_dtype"], first["gemm_products"]
    tokens = record["prompt_tokens"] + record["output_tokens"]
    record["ceiling"] = rates
    record["ceiling_tokens_per_s"] = tokens / ceiling_seconds(rates, record["prompt_tokens"], record["output_tokens"])
    record["fraction_of_ceiling"] = _median(runs, "fraction_of_ceiling")
    record["ceiling_in_context_tokens_per_s"] = tokens / ceiling_seconds(rates, record["prompt_tokens"], record["output_tokens"], True)
    record["fraction_of_ceiling_in_context"] = _median(runs, "fraction_of_ceiling_in_context")
    record["fraction_of_replayed_ceiling"] = _median(runs, "fraction_of_replayed_ceiling")
    record["prefill_fraction_of_machine_limit"] = rates["prefill_tokens_per_s"] / rates["prefill_limit_tokens_per_s"]
    record["decode_fraction_of_machine_limit"] = rates["decode_tokens_per_s"] / rates["decode_limit_tokens_per_s"]
    return [("bare forward, prefill tokens/s", rates["prefill_tokens_per_s"]),
            ("bare forward, decode tokens/s (full batch)", rates["decode_tokens_per_s"]),
            ("machine limits: memory read GB/s; products GOP/s, by what the GEMMs multiply in",
             f"{rates['machine_read_gb_s']:.1f}; " + ", ".join(f"{product} {rates[f'machine_{product}_gop_s']:.0f}"
                                                           for product in record["gemm_products"].split(", "))),
            ("bare prefill, fraction of the machine's limit (its GEMMs at their products' rates)",
             record["prefill_fraction_of_machine_limit"]),
            ("bare decode, fraction of the machine's limit (its weights at the read rate, or its GEMMs)",
             record["decode_fraction_of_machine_limit"]),
            ("ceiling total tokens/s for this workload", record["ceiling_tokens_per_s"]),
            ("fraction of ceiling", record["fraction_of_ceiling"]),
            (f"bare decode tokens/s after {rates['decode_context']} tokens of context", rates["decode_tokens_per_s_in_context"]),
            ("ceiling with that attention, total tokens/s", record["ceiling_in_context_tokens_per_s"]),
            ("fraction of ceiling with attention", record["fraction_of_ceiling_in_context"]),
            ("bare forward replayed in full (the ceiling's passes, all timed), s", rates["replay_s"]),
            ("its decode passes, median / fastest", rates["replay_decode_spread"]),
            ("fraction of the replayed ceiling", record["fraction_of_replayed_ceiling"])]


def _hf_figures(record: dict, runs: list[dict]) -> list:
    for key in ("hf_total_tokens_per_s", "hf_output_tokens_per_s", "speedup_vs_hf"):
        record[key] = _median(runs, key)
    rows = [("HF static batching total tokens/s", record["hf_total_tokens_per_s"]), ("speed-up vs HF", record["speedup_vs_hf"])]
    if len(runs) > 1:
        rows.append(("speed-up vs HF, each run", ", ".join(f"{one['speedup_vs_hf']:.2f}x" for one in runs)))
    return rows
