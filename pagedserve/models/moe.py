"""Mixtures of experts in the Llama family: Mixtral, Qwen2-MoE (with a gated shared expert), Qwen3-MoE and OLMoE.
Their decoder layers are the family's, with the MLP of some or all layers replaced by a router over experts
(layers/fused_moe.py). What differs between them is read from their config here, once."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layers.fused_moe import EXPERT_PARTS, FusedMoE
from pagedserve.layers.linear import Linear
from pagedserve.models.mlp import GatedMLP, hidden_activation

# Checkpoint tensors of one expert: (the experts' module, the expert's index, the part); and of every expert at once,
# stacked (transformers' own layout, which its GGUF reader produces).
_EXPERT_TENSOR = re.compile(rf"^(.*\.mlp\.experts)\.(\d+)\.({'|'.join(EXPERT_PARTS)})\.weight$")
_STACKED_EXPERTS_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top_k weights scaled to sum to one
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_step: int = 1  # every sparse_step-th layer is a mixture...
    dense_layers: frozenset[int] = frozenset()  # ...but these, which keep the dense MLP

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def moe_shape(hf_config) -> MoEShape | None:
    """The model's mixture, as its config describes it; None for a dense model."""
    model_type = hf_config.model_type
    # config.json says num_experts; some transformers versions resolve it to num_local_experts.
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    if model_type == "mixtral":
        return MoEShape(num_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size, True)
    if model_type == "olmoe":
        return MoEShape(num_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size, bool(hf_config.norm_topk_prob))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if not num_experts:
            return None
        return MoEShape(num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                        bool(hf_config.norm_topk_prob), getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
                        hf_config.decoder_sparse_step, frozenset(hf_config.mlp_only_layers or ()))
    return None


class MoEBlock(nn.Module):
    """Router (gate), experts, and the shared expert with its sigmoid gate where the model has one. Named as the
    checkpoints name them (mlp.gate, mlp.experts, mlp.shared_expert, mlp.shared_expert_gate)."""

    def __init__(self, hf_config, shape: MoEShape) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.gate = Linear(hidden, shape.num_experts, bias=False)  # every rank routes every token itself
        self.gate.routes = True
        self.experts = FusedMoE(shape.num_experts, shape.top_k, hidden, shape.intermediate_size, shape.renormalize)
        self.shared_expert = None
        if shape.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, shape.shared_intermediate_size, hidden_activation(hf_config))
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
            self.shared_expert_gate.routes = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def layer_mlp(hf_config, layer: int) -> nn.Module:
    """The MLP of decoder layer `layer`: a mixture where the model has one there, else the dense gated MLP."""
    shape = moe_shape(hf_config)
    if shape is not None and shape.is_sparse(layer):
        return MoEBlock(hf_config, shape)
    return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hidden_activation(hf_config), getattr(hf_config, "mlp_bias", False))


def checkpoint_alias(name: str) -> str:
    """Mixtral calls its mixture block_sparse_moe; ours is mlp, as the other models call theirs."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def expert_tensor(name: str) -> tuple[str, int | None, str] | None:
    """(the experts' module, the expert, gate/up/down) for one expert's checkpoint tensor; (module, None, gate_up or
    down) for every expert's, stacked; else None."""
    match = _EXPERT_TENSOR.match(name)
    if match is not None:
        return match.group(1), int(match.group(2)), EXPERT_PARTS[match.group(3)]
    match = _STACKED_EXPERTS_TENSOR.match(name)
    if match is not None:
        return match.group(1), None, "down" if match.group(2) == "down_proj" else "gate_up"
    return None


def expert_load_key(module_name: str, expert: int, part: str) -> str:
    """How loading records one expert's part (gate, up or down) as loaded."""
    return f"{module_name}#{expert}.{part}"


def expected_expert_loads(module_name: str, experts: FusedMoE) -> list[str]:
    """What loading every expert this rank holds of `experts` marks loaded."""
    return [expert_load_key(module_name, expert, part) for expert in experts.local_experts for part in ("gate", "up", "down")]


def parallel_shape_problems(hf_config, tensor_parallel_size: int, expert_parallel: bool = False,
                            data_parallel_size: int = 1) -> list[str]:
    """What in the model's mixture a tensor-parallel split (of its experts' features, or with expert parallelism of
    its experts, over the data-parallel cores' ranks too when data_parallel_size > 1) cannot divide."""
    shape = moe_shape(hf_config)
    problems = []
    if shape is None:
        return problems
    if shape.shared_intermediate_size % tensor_parallel_size:
        problems.append(f"shared_expert_intermediate_size ({shape.shared_intermediate_size}) is not divisible by "
                        f"tensor_parallel_size ({tensor_parallel_size})")
    expert_ranks = tensor_parallel_size * data_parallel_size
    if expert_parallel and shape.num_experts % expert_ranks:
        ranks = f"tensor_parallel_size ({tensor_parallel_size})" + (
            f" x data_parallel_size ({data_parallel_size})" if data_parallel_size > 1 else "")
        problems.append(f"num_experts ({shape.num_experts}) is not divisible by {ranks}: expert parallelism spreads the "
                        "experts over those ranks")
    if not expert_parallel and shape.intermediate_size % tensor_parallel_size:
        problems.append(f"the experts' intermediate size ({shape.intermediate_size}) is not divisible by tensor_parallel_size "
                        f"({tensor_parallel_size})")
    if hf_config.model_type == "olmoe" and tensor_parallel_size > hf_config.num_key_value_heads:
        problems.append(f"OLMoE normalizes k across all KV heads, which tensor_parallel_size ({tensor_parallel_size}) above "
                        f"num_key_value_heads ({hf_config.num_key_value_heads}) would replicate")
    return problems
