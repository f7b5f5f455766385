"""How far an 8-bit (or 16-bit) KV cache takes the model from a float32 one, each cache on the same attention
backend (and, through compare, how far any engine settings take it from others'): perplexity over the shipped English
passages (prefilled in chunks, so that most positions attend to context read back from the cache), the largest
difference of those positions' logprobs from float32's, and greedy agreement over the chat prompts of the benchmark
data (tokens before the first divergence from float32's answer)."""

from __future__ import annotations

import math
import statistics

from pagedserve.benchmarks.datasets import chat_requests, passages
from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.sampling_params import SamplingParams

REFERENCE = "float32"


def run(args) -> dict:
    dtypes = [REFERENCE] + [dtype for dtype in args.kv_cache_dtype if dtype != REFERENCE]
    variants = {dtype: {"kv_cache_dtype": dtype, "attention_backend": "torch", "max_num_batched_tokens": args.chunk,
                        "long_prefill_token_threshold": args.chunk} for dtype in dtypes}
    return compare(args, variants, "kv-accuracy", "KV cache accuracy", {"chunk": args.chunk})


def compare(args, variants: dict[str, dict], benchmark: str, title: str, settings: dict) -> dict:
    """Each variant's engine (settings as LLM keywords, without prefix caching) against the first one's: perplexity over
    the passages, logprob differences at each of their positions, and greedy agreement over the chat prompts."""
    from pagedserve.engine.llm import LLM

    results, reference = {}, None
    for label, engine_settings in variants.items():
        llm = LLM(args.model, enable_prefix_caching=False, **engine_settings)
        tokenizer = llm.get_tokenizer()
        windows = text_windows(tokenizer, args.window)
        logprobs = prompt_logprobs(llm, windows)
        prompts = [tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
                   for r in chat_requests(args.num_prompts, seed=args.seed)]
        answers = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len),
                                                                  use_tqdm=False)]
        llm.llm_engine.shutdown()
        if reference is None:
            reference = (logprobs, answers)
        results[label] = summarize(logprobs, answers, *reference)
    record = {"benchmark": benchmark, "model": args.model, "window": args.window, **settings,
              "num_prompts": args.num_prompts, "output_len": args.output_len, "num_text_tokens": len(reference[0]),
              "results": results}
    first = next(iter(variants))
    rows = []
    for label, result in results.items():
        rows += [(f"{label}: perplexity", result["perplexity"]),
                 (f"{label}: perplexity vs {first} %", result["perplexity_change_pct"]),
                 (f"{label}: largest logprob difference", result["max_logprob_diff"]),
                 (f"{label}: mean logprob difference", result["mean_logprob_diff"]),
                 (f"{label}: greedy answers identical", f"{result['identical_answers']} of {args.num_prompts}"),
                 (f"{label}: tokens before divergence (mean)", result["mean_tokens_before_divergence"])]
    print_table(f"{title} ({record['num_text_tokens']} tokens of text, {args.num_prompts} chat prompts)", rows)
    write_json(args.json, record)
    return record


def text_windows(tokenizer, window: int) -> list[list[int]]:
    """The passages as token ids, cut into windows of window tokens (the last one whatever is left)."""
    ids = tokenizer("\n\n".join(passages()), add_special_tokens=False).input_ids
    return [ids[start:start + window] for start in range(0, len(ids), window) if len(ids) - start > 1]


def prompt_logprobs(llm, windows: list[list[int]]) -> list[float]:
    """The logprob of each window's tokens after its first, as the model gives them."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    values = []
    for window, output in zip(windows, outputs):
        for token, position in zip(window[1:], output.prompt_logprobs[1:]):
            values.append(position[token].logprob)
    return values


def summarize(logprobs: list[float], answers: list[list[int]], reference_logprobs: list[float], reference_answers: list[list[int]]) -> dict:
    perplexity = math.exp(-statistics.fmean(logprobs))
    reference_perplexity = math.exp(-statistics.fmean(reference_logprobs))
    agreement = [first_divergence(ours, theirs) for ours, theirs in zip(answers, reference_answers)]
    return {"perplexity": perplexity, "perplexity_change_pct": 100 * (perplexity / reference_perplexity - 1),
            "max_logprob_diff": max(abs(a - b) for a, b in zip(logprobs, reference_logprobs)),
            "mean_logprob_diff": statistics.fmean(abs(a - b) for a, b in zip(logprobs, reference_logprobs)),
            "identical_answers": sum(a == max(len(x), len(y)) for a, x, y in zip(agreement, answers, reference_answers)),
            "mean_tokens_before_divergence": statistics.fmean(agreement), "tokens_before_divergence": agreement}


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    """Tokens the two answers share before they differ (the shorter's length if one is the other's start)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
