"""How fast a decode step reads each KV cache dtype: the bare forward pass of a batch of decodes over long contexts
(ceiling.time_bare_passes: the model and its attention as the engine runs them, no scheduler or sampling), each dtype
on its own engine, the dtypes in turn for a few rounds so that the machine's drift falls on all of them alike."""

from __future__ import annotations

import statistics

from pagedserve.benchmarks.ceiling import time_bare_passes
from pagedserve.benchmarks.report import print_table, write_json

REFERENCE = "bfloat16"  # the target: 8-bit decode steps at long context no slower than a 16-bit cache's


def run(args) -> dict:
    from pagedserve.engine.llm import LLM

    dtypes = list(dict.fromkeys(args.kv_cache_dtype))
    passes: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    max_model_len = args.context + 16
    for _ in range(args.rounds):
        for dtype in dtypes:
            llm = LLM(args.model, kv_cache_dtype=dtype, max_model_len=max_model_len,
                      num_gpu_blocks_override=args.num_seqs * (-(-max_model_len // args.block_size)) + 1, block_size=args.block_size)
            passes[dtype] += time_bare_passes(llm, args.num_seqs, 1, args.passes, args.context)
            llm.llm_engine.shutdown()
    step_ms = {dtype: 1e3 * statistics.median(seconds) for dtype, seconds in passes.items()}
    results = {dtype: {"step_ms_median": step_ms[dtype], "step_ms_best": 1e3 * min(passes[dtype]),
                       "vs_" + REFERENCE: step_ms[dtype] / step_ms[REFERENCE] if REFERENCE in step_ms else None}
               for dtype in dtypes}
    record = {"benchmark": "kv-speed", "model": args.model, "num_seqs": args.num_seqs, "context": args.context,
              "passes": args.passes, "rounds": args.rounds, "results": results}
    rows = [(f"{dtype}: decode step ms (median, best)", f"{r['step_ms_median']:.1f}, {r['step_ms_best']:.1f}")
            for dtype, r in results.items()]
    rows += [(f"{dtype}: vs {REFERENCE}", f"{r['vs_' + REFERENCE]:.3f}x") for dtype, r in results.items()
             if r["vs_" + REFERENCE] is not None and dtype != REFERENCE]
    print_table(f"decode step, {args.num_seqs} sequences over {args.context}-token contexts ({args.model})", rows)
    write_json(args.json, record)
    return record
