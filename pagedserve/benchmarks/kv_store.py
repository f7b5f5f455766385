"""The shared KV store's worth: the time to first token of a long prompt on a fresh engine, computed, against loaded
from a SharedStorageConnector directory that an earlier engine filled (each engine new, as after a restart)."""

from __future__ import annotations

import random
import tempfile
import time

from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.sampling_params import SamplingParams


def _ttft(args, prompt: list[int], store: str | None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens not computed) of the prompt on a new engine."""
    from pagedserve.engine.llm import LLM

    connector = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": store}}
    llm = LLM(args.model, kv_transfer_config=connector if store else None, **args.engine_overrides)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": [7] * 32}, params, use_tqdm=False)  # warm-up, shares nothing with the prompt
    start = time.perf_counter()
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    llm.llm_engine.shutdown()
    return seconds, output.num_cached_tokens


def run(args) -> dict:
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    with tempfile.TemporaryDirectory(prefix="pagedserve-kv-store-") as store:
        computed, _ = _ttft(args, prompt, None)
        saving, _ = _ttft(args, prompt, store)  # computes it, and fills the store
        loaded, loaded_tokens = _ttft(args, prompt, store)
    record = {"benchmark": "kv-store", "prompt_len": args.prompt_len, "ttft_computed_s": computed, "ttft_computed_and_saved_s": saving,
              "ttft_loaded_s": loaded, "loaded_tokens": loaded_tokens, "ttft_ratio": loaded / computed}
    print_table(f"shared KV store ({args.prompt_len}-token prompt, a fresh engine each time)", [
        ("TTFT computed s", computed), ("TTFT computed and saved s", saving), ("TTFT loaded from the store s", loaded),
        ("prompt tokens loaded", loaded_tokens), ("loaded / computed", record["ttft_ratio"])])
    write_json(args.json, record)
    return record
