"""Offline throughput: LLM.generate on a fixed set of prompts, optionally beside HF static batching
and the model's bare forward pass (the compute ceiling of this machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.benchmarks.datasets import BenchRequest, mixed_requests, random_requests
from pagedserve.benchmarks.report import print_table, write_json


def make_requests(args, vocab_size: int) -> list[BenchRequest]:
    if args.dataset == "mixed":
        return mixed_requests(args.num_prompts, vocab_size, seed=args.seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size, seed=args.seed)


def run_pagedserve(llm, requests: list[BenchRequest]) -> float:
    from pagedserve import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outputs, requests))
    return elapsed


def run_hf_static_batching(model_dir: str, requests: list[BenchRequest]) -> float:
    """Seconds of transformers' generate() on the requests, in a process of its own with the user's
    environment as it was before pagedserve set its OpenMP defaults (see hf_static_batching.py)."""
    import pagedserve

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests], f)
        f.flush()
        result = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_static_batching.py")), model_dir, f.name],
                                env=pagedserve.user_environment(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the HF baseline failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def measure_ceiling(llm, num_seqs: int, seq_len: int, repeats: int = 3) -> float:
    """Tokens/s of the bare model forward over num_seqs fresh sequences of seq_len tokens (no context,
    so attention is negligible), logits at each sequence's last token; best of repeats. seq_len 1
    runs as the engine runs decodes (one batched attention call), longer ones as prefills."""
    worker = llm.llm_engine.engine_core.worker
    model, kv_caches, block_size, device = worker.model, worker.kv_caches, worker.config.block_size, worker.device
    meta = _fresh_sequences_metadata(num_seqs, seq_len, block_size, device)
    input_ids = torch.randint(100, 1000, (num_seqs * seq_len,), device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            hidden = model(input_ids, positions, kv_caches, meta)
            model.compute_logits(hidden[seq_len - 1 :: seq_len])
            best = min(best, time.perf_counter() - start)
    return num_seqs * seq_len / best


def _fresh_sequences_metadata(num_seqs: int, seq_len: int, block_size: int, device):
    from pagedserve.executor.input_batch import fill_decode_metadata
    from pagedserve.layers.attention import AttentionMetadata, PrefillChunk

    blocks_per_seq = -(-seq_len // block_size)
    tables = [torch.arange(seq * blocks_per_seq, (seq + 1) * blocks_per_seq) for seq in range(num_seqs)]
    slots = torch.cat([torch.arange(seq_len) + table[0] * block_size for table in tables]).to(device)
    if seq_len == 1:
        meta = AttentionMetadata(slots, num_seqs, None, None, [])
        fill_decode_metadata(meta, [t.numpy() for t in tables], [1] * num_seqs, block_size, device)
        return meta
    prefills = [PrefillChunk(seq * seq_len, seq_len, seq_len, table.to(device)) for seq, table in enumerate(tables)]
    return AttentionMetadata(slots, 0, None, None, prefills)


def workload_ceiling(llm, requests: list[BenchRequest]) -> dict:
    """The physical limit for this workload: its prompt tokens at the bare prefill rate (4 x 128-token
    sequences) plus its output tokens at the bare decode rate (one token for each of the batch's sequences)."""
    prefill_rate = measure_ceiling(llm, num_seqs=4, seq_len=128)
    decode_rate = measure_ceiling(llm, num_seqs=min(len(requests), llm.llm_engine.config.max_num_seqs), seq_len=1)
    seconds = sum(len(r.prompt_token_ids) for r in requests) / prefill_rate + sum(r.output_len for r in requests) / decode_rate
    return {"prefill_tokens_per_s": prefill_rate, "decode_tokens_per_s": decode_rate, "seconds": seconds}


def run(args) -> dict:
    from pagedserve import LLM

    llm = LLM(args.model, **args.engine_overrides)
    vocab_size = llm.llm_engine.processor.vocab_size
    requests = make_requests(args, vocab_size)
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    num_output_tokens = sum(r.output_len for r in requests)
    elapsed = run_pagedserve(llm, requests)
    record = {
        "benchmark": "throughput", "dataset": args.dataset, "num_prompts": len(requests),
        "prompt_tokens": num_prompt_tokens, "output_tokens": num_output_tokens, "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed, "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed,
    }
    rows = [("requests/s", record["requests_per_s"]), ("total tokens/s", record["total_tokens_per_s"]),
            ("output tokens/s", record["output_tokens_per_s"]), ("elapsed s", elapsed)]
    if args.ceiling:
        ceiling = workload_ceiling(llm, requests)
        record["ceiling"] = ceiling
        record["ceiling_tokens_per_s"] = (num_prompt_tokens + num_output_tokens) / ceiling["seconds"]
        record["fraction_of_ceiling"] = ceiling["seconds"] / elapsed
        rows += [("bare forward, prefill tokens/s", ceiling["prefill_tokens_per_s"]),
                 ("bare forward, decode tokens/s (full batch)", ceiling["decode_tokens_per_s"]),
                 ("ceiling total tokens/s for this workload", record["ceiling_tokens_per_s"]),
                 ("fraction of ceiling", record["fraction_of_ceiling"])]
    if args.baseline == "hf":
        model_dir = str(llm.llm_engine.engine_core.worker.model_dir)
        del llm
        hf_elapsed = run_hf_static_batching(model_dir, requests)
        record["hf_total_tokens_per_s"] = (num_prompt_tokens + num_output_tokens) / hf_elapsed
        record["hf_output_tokens_per_s"] = num_output_tokens / hf_elapsed
        record["speedup_vs_hf"] = hf_elapsed / elapsed
        rows += [("HF static batching total tokens/s", record["hf_total_tokens_per_s"]),
                 ("speed-up vs HF", record["speedup_vs_hf"])]
    print_table(f"throughput ({args.dataset}, {len(requests)} prompts)", rows)
    write_json(args.json, record)
    return record
