"""How far the GEMM precisions take the model from float32 GEMMs: bfloat16 GEMMs (dtype bfloat16), int8 ones
(quantization int8, between float32 or bfloat16 activations), and dtype auto (on a GGUF model, its blocks multiply input
rounded to 8 bits per 32 values; bfloat16 GEMMs besides where the processor has them). Where the GEMMs multiply in
bfloat16, the prompts' attention multiplies in bfloat16 pairs too (on AVX-512 BF16), and its cost is counted in.
Measured as the KV cache dtypes are (kv_accuracy.compare): perplexity over the shipped English passages, logprob
differences, greedy agreement over chat prompts. Prompt chunks larger than the row counts the blocks take run on the
dense weights: a small --chunk scores the text on the blocks too."""

from __future__ import annotations

from pagedserve.benchmarks.kv_accuracy import compare

# label -> engine settings; the first is the reference.
VARIANTS = {"float32": {"dtype": "float32"}, "auto": {"dtype": "auto"}, "bfloat16": {"dtype": "bfloat16"},
            "int8": {"dtype": "float32", "quantization": "int8"}, "int8, bfloat16": {"dtype": "bfloat16", "quantization": "int8"}}


def run(args) -> dict:
    variants = {label: {**VARIANTS[label], "max_num_batched_tokens": args.chunk, "long_prefill_token_threshold": args.chunk}
                for label in ["float32", *(label for label in args.variants if label != "float32")]}
    return compare(args, variants, "gemm-accuracy", "GEMM precision accuracy", {"chunk": args.chunk})
