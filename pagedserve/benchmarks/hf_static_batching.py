"""HF static batching as a plain transformers user runs it: one batch of every prompt, left padded,
generate to the longest output. Run as a script in its own process (throughput --baseline hf), so
that none of pagedserve's process settings (OpenMP wait policy, malloc settings) reach the baseline:
this file imports nothing of pagedserve, whose package __init__ would set them.

    python hf_static_batching.py MODEL_DIR REQUESTS_JSON  ->  prints the seconds generate() took

REQUESTS_JSON: [{"prompt_token_ids": [...], "output_len": N}, ...]
"""

import json
import sys
import time


def main(model_dir: str, requests_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with open(requests_path) as f:
        requests = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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
    print(time.perf_counter() - start)


if __name__ == "__main__":
    main(*sys.argv[1:3])
