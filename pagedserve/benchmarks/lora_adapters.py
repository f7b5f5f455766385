"""Random-weight LoRA adapters of a model, written as PEFT directories (adapter_config.json and
adapter_model.safetensors, under the names peft gives the weights), for serving them with --lora-modules and
spreading `bench serve --served-model` over them."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.config import EngineConfig
from pagedserve.executor.abstract import Executor

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target, from the model's config.json."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def run(args) -> dict:
    import torch
    from safetensors.torch import save_file

    model_dir = Path(Executor.model_dir(EngineConfig(model=args.model)))
    config = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(args.seed)
    out, written, adapter_bytes = Path(args.out), [], 0
    for index in range(args.count):
        directory = out / f"lora-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in TARGETS:
                in_features, out_features = shapes[target]
                part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(args.rank, in_features, generator=generator) / in_features**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, args.rank, generator=generator) * 0.01
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(TARGETS),
            "bias": "none", "base_model_name_or_path": args.model}, indent=2))
        adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        written.append(str(directory))
    record = {"benchmark": "lora-adapters", "model": args.model, "adapters": written, "rank": args.rank,
              "bytes_per_adapter": adapter_bytes}
    print_table(f"{args.count} LoRA adapters of rank {args.rank} written under {out}", [
        ("adapters", " ".join(f"lora-{i}={path}" for i, path in enumerate(written))), ("bytes per adapter", adapter_bytes)])
    write_json(args.json, record)
    return record
