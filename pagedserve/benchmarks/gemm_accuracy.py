"""How far the GEMM precisions take the model from float32 GEMMs: bfloat16 GEMMs (dtype bfloat16) and int8 ones
(quantization int8, between float32 or bfloat16 activations), measured as the KV cache dtypes are (kv_accuracy.compare):
perplexity over the shipped English passages, logprob differences, greedy agreement over chat prompts."""

from __future__ import annotations

from pagedserve.benchmarks.kv_accuracy import compare

# label -> engine settings; the first is the reference.
VARIANTS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
            "int8": {"dtype": "float32", "quantization": "int8"}, "int8, bfloat16": {"dtype": "bfloat16", "quantization": "int8"}}


def run(args) -> dict:
    variants = {label: {**VARIANTS[label], "max_num_batched_tokens": args.chunk, "long_prefill_token_threshold": args.chunk}
                for label in ["float32", *(label for label in args.variants if label != "float32")]}
    return compare(args, variants, "gemm-accuracy", "GEMM precision accuracy", {"chunk": args.chunk})
