"""The physical limit of a workload on this machine: the model's bare forward pass (no scheduler, no
sampling, no host work), at full batch, timed right where the engine runs, on its own cache; and how near that pass
comes to the machine's own limits (machine_limits)."""

from __future__ import annotations

import statistics

import torch

from pagedserve.benchmarks import machine, worker_probes
from pagedserve.benchmarks.datasets import BenchRequest

# The bare prefill pass: a few prompts of the default workload's length.
PREFILL_SEQS, PREFILL_LEN = 4, 128


def measure_ceiling(llm, num_seqs: int, seq_len: int, repeats: int = 3, context: int = 0) -> float:
    """Tokens/s of the bare model forward over num_seqs sequences of seq_len new tokens after `context`
    tokens already in the cache (0: fresh sequences, so attention is negligible), logits at each
    sequence's last token; best of repeats."""
    return num_seqs * seq_len / min(time_bare_passes(llm, num_seqs, seq_len, repeats, context))


def time_bare_passes(llm, num_seqs: int, seq_len: int, passes: int, context: int = 0) -> list[float]:
    """Seconds of each of `passes` bare forward passes (see measure_ceiling), timed on rank 0 (through the
    engine's collective_rpc): seq_len 1 runs as the engine runs decodes (one batched attention call), longer
    ones as prefill chunks, through the engine's attention backend. The context's K/V are whatever the blocks
    hold: attention reads them at the cost it would pay for real ones. The passes write K/V into any block, so
    the engine must be idle, and its prefix cache is emptied after."""
    engine = llm.llm_engine
    stats = engine.get_stats()
    if stats.num_running or stats.num_waiting:
        raise RuntimeError("the bare forward pass must be timed on an idle engine")
    seconds = engine.call_utility("collective_rpc", worker_probes.time_forward_passes, num_seqs, seq_len, passes, context)[0]
    engine.call_utility("reset_prefix_cache")
    return seconds


def mean_decode_context(requests: list[BenchRequest]) -> int:
    """Tokens in the cache at a request's average decode step (its prompt and half its output), averaged."""
    return round(sum(len(r.prompt_token_ids) + r.output_len / 2 for r in requests) / len(requests))


def workload_ceiling(llm, requests: list[BenchRequest]) -> dict:
    """The bare forward's rates for this workload: prompt tokens at the bare prefill rate (4 x 128-token
    sequences), output tokens at the bare decode rate of the whole batch (one token for each sequence),
    and at that rate after the workload's mean context, so with the attention a decode cannot skip;
    and the replayed ceiling (replay_seconds)."""
    prefill_rate = measure_ceiling(llm, num_seqs=PREFILL_SEQS, seq_len=PREFILL_LEN)
    batch = decode_batch(llm, requests)
    engine = llm.llm_engine
    fits = engine.model_info.num_blocks // batch * engine.config.block_size - 1  # every sequence's blocks in the cache
    context = min(mean_decode_context(requests), engine.max_model_len - 1, fits)
    # A decode step is short, so take the best of more of them: one slow moment of the machine must not
    # pass for the limit.
    rates = {"prefill_tokens_per_s": prefill_rate, "decode_tokens_per_s": measure_ceiling(llm, num_seqs=batch, seq_len=1, repeats=10),
             "decode_context": context,
             "decode_tokens_per_s_in_context": measure_ceiling(llm, num_seqs=batch, seq_len=1, repeats=10, context=context)}
    return rates | replay_seconds(llm, requests) | machine_limits(llm, batch)


# Bytes read and products timed for the machine's limits: more than its caches hold, a product of prefill size.
_READ_MIB, _MATMUL_SIZE, _LIMIT_REPEATS = 512, 1024, 3


def machine_limits(llm, decode_rows: int) -> dict:
    """The machine's own limits for each kind of step, from its memory read rate and its rate of products in what each
    GEMM multiplies in (all measured now): a prefill token needs its GEMMs' products (a sequence's last token the
    lm_head's too); a decode step of decode_rows rows reads the weights its GEMMs take at that size, and multiplies,
    whichever takes longer. Attention and the rest are left out: these are limits no engine beats."""
    work = llm.llm_engine.call_utility("collective_rpc", worker_probes.gemm_work, decode_rows, PREFILL_SEQS * PREFILL_LEN)[0]
    read_gb_s = machine.read_bandwidth_gb_s(_READ_MIB * 2**20, _LIMIT_REPEATS)
    steps = ("prefill", "decode")
    products = {product for step in steps for part in ("flops_per_token", "lm_head_flops_per_row") for product in work[part][step]}
    rates = {product: _product_rate(product) for product in sorted(products)}

    def seconds(flops_by_product: dict[str, int], count: float) -> float:
        return sum(count * flops / (rates[product] * 1e9) for product, flops in flops_by_product.items())

    prefill_token_s = seconds(work["flops_per_token"]["prefill"], 1) + seconds(work["lm_head_flops_per_row"]["prefill"], 1 / PREFILL_LEN)
    decode_flops = work["flops_per_token"]["decode"], work["lm_head_flops_per_row"]["decode"]
    decode_step_s = max(work["decode_weight_bytes"] / (read_gb_s * 1e9), sum(seconds(flops, decode_rows) for flops in decode_flops))
    return {"gemm_dtype": work["gemm_dtype"], "gemm_products": ", ".join(rates), "machine_read_gb_s": read_gb_s,
            **{f"machine_{product}_gop_s": rate for product, rate in rates.items()},
            "prefill_limit_tokens_per_s": 1 / prefill_token_s, "decode_limit_tokens_per_s": decode_rows / decode_step_s}


def _product_rate(product: str) -> float:
    """The machine's rate (G multiply-adds x 2 a second) of GEMM products in this dtype; int8's the better of torch's
    int8 GEMM and the vector units' own byte products (machine.int8_gop_s)."""
    if product == "int8":
        return machine.int8_gop_s(_MATMUL_SIZE, _LIMIT_REPEATS)
    return machine.matmul_gflop_s(getattr(torch, product), _MATMUL_SIZE, _LIMIT_REPEATS)


def decode_batch(llm, requests: list[BenchRequest]) -> int:
    return min(len(requests), llm.llm_engine.config.max_num_seqs)


def replay_seconds(llm, requests: list[BenchRequest]) -> dict:
    """The same bare passes the ceiling counts (the prompt tokens as 4 x 128-token prefills, the output
    tokens as decode steps of the whole batch, no context), all run and timed in full rather than
    extrapolated from the best one. A shared machine's speed drifts within minutes; a run of ours
    pays that drift, a best-of-10 pass does not, so this is the ceiling at the speed the machine had
    right after the run. Also the spread of its decode passes (median over fastest)."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    batch = decode_batch(llm, requests)
    prefill_passes = -(-prompt_tokens // (PREFILL_SEQS * PREFILL_LEN))
    decode_passes = -(-output_tokens // batch)
    prefill = time_bare_passes(llm, PREFILL_SEQS, PREFILL_LEN, prefill_passes)
    decode = time_bare_passes(llm, batch, 1, decode_passes)
    # Scaled to the workload's exact token counts (the last pass of each kind may be a partial one).
    seconds = (sum(prefill) * prompt_tokens / (prefill_passes * PREFILL_SEQS * PREFILL_LEN)
               + sum(decode) * output_tokens / (decode_passes * batch))
    return {"replay_s": seconds, "replay_decode_spread": statistics.median(decode) / min(decode)}


def ceiling_seconds(rates: dict, prompt_tokens: int, output_tokens: int, in_context: bool = False) -> float:
    """The least time the bare forward needs for these tokens: the limit no engine on this machine beats."""
    decode_rate = rates["decode_tokens_per_s_in_context" if in_context else "decode_tokens_per_s"]
    return prompt_tokens / rates["prefill_tokens_per_s"] + output_tokens / decode_rate
