"""Random-weight models for measuring a mixture of experts: a Qwen3-MoE of the shape asked for, or (--dense) the dense
Qwen3 with the same parameters active per token (its MLP as wide as top_k experts together), saved as HF directories
with the default model's tokenizer, for `bench throughput --model DIR` (with `--baseline hf` beside it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.config import EngineConfig
from pagedserve.executor.abstract import Executor

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_HEAD_DIM = 64


def run(args) -> dict:
    import torch
    import transformers

    shape = {"num_hidden_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.hidden // _HEAD_DIM,
             "num_key_value_heads": max(1, args.hidden // _HEAD_DIM // 4), "head_dim": _HEAD_DIM, "vocab_size": 49152,
             "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": 1,
             "eos_token_id": 2, "initializer_range": 0.02, "use_sliding_window": False}
    if args.dense:
        config = transformers.Qwen3Config(intermediate_size=args.top_k * args.expert_width, **shape)
        model_class = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                                             moe_intermediate_size=args.expert_width, intermediate_size=args.top_k * args.expert_width,
                                             **shape)
        model_class = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(args.seed)
    model = model_class(config).eval()
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer_dir = Path(Executor.model_dir(EngineConfig()))
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    total = sum(p.numel() for p in model.parameters())
    expert_params = 0 if args.dense else 3 * args.hidden * args.expert_width * args.experts * args.layers
    active = total - expert_params * (1 - args.top_k / args.experts)
    record = {"benchmark": "moe-model", "out": str(out), "dense": args.dense, "layers": args.layers, "hidden": args.hidden,
              "experts": 0 if args.dense else args.experts, "expert_width": args.expert_width, "top_k": args.top_k,
              "parameters": total, "active_parameters_per_token": active}
    print_table(f"{'dense' if args.dense else 'mixture-of-experts'} model written to {out}", [
        ("parameters", total), ("active parameters per token", int(active))])
    write_json(args.json, record)
    return record
