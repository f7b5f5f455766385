"""HF static batching as a plain transformers user runs it: one batch of every prompt, left padded,
generate to the longest output. Run as a script in its own process (throughput --baseline hf), so
that none of pagedserve's process settings (OpenMP wait policy, malloc settings) reach the baseline:
this file imports nothing of pagedserve, whose package __init__ would set them.

    python hf_static_batching.py MODEL_DIR

loads the model once and says "ready", then reads batches from stdin, one JSON line each,
[{"prompt_token_ids": [...], "output_len": N}, ...], and answers each with a line: the seconds generate() took.
It waits on stdin between batches, so a benchmark's own runs in between have the machine to themselves.
"""

import json
import sys
import time


def main(model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print("ready", flush=True)
    for line in sys.stdin:
        print(generate_seconds(model, json.loads(line)), flush=True)


def generate_seconds(model, requests: list[dict]) -> float:
    import torch

    max_len = max(len(r["prompt_token_ids"]) for r in requests)
    input_ids = torch.zeros(len(requests), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, r in enumerate(requests):
        prompt = r["prompt_token_ids"]
        input_ids[row, max_len - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, max_len - len(prompt):] = 1
    max_new = max(r["output_len"] for r in requests)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                       pad_token_id=0)
    return time.perf_counter() - start


if __name__ == "__main__":
    main(sys.argv[1])
