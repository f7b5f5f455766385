"""A mixture-of-experts layer: a router picks top_k experts per token, and the experts (SiLU-gated MLPs) run as one
GEMM pair per expert over the tokens routed to it, their outputs weighted and added in place.

Under tensor parallelism every rank holds every expert's share of the intermediate features (as the dense MLP
splits them: gate and up by output rows, down by input columns); with expert parallelism instead, each rank of the
tensor-parallel group holds some of the experts whole (expert_placement). Either way every rank routes every token
(the group's ranks hold the same activations), runs what it holds of the experts those tokens chose, and the
partial sums are all-reduced once after all experts ran: a token's hidden state is all that crosses between ranks.

Expert parallelism over data-parallel engine cores (distributed/parallel_state.py's ExpertGroups) spreads the experts
over every rank of every core. Each core has tokens of its own, so a layer first gathers every core's tokens with
their routing, runs its experts over all of them, and each core's rows of the partial outputs are summed over all
ranks; the cores step together, one that has no tokens joining with none (join_without_tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedserve.distributed.parallel_state import expert_groups, rank_info, tp_all_reduce
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.gemm import pack_weight, packed_linear
from pagedserve.layers.linear import QuantizedWeight, block_columns, split_evenly

# Checkpoint names of an expert's three matrices -> which of ours: Mixtral's w1/w3/w2, and the gate/up/down of others.
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]): the softmax over all experts in float32, its top_k, and,
    where the model says so, those renormalized to sum to one."""
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_placement(num_experts: int, num_ranks: int, rank: int) -> range:
    """The experts a rank holds under expert parallelism: a contiguous block of num_experts / num_ranks. The one place
    that decides it, so that a placement balanced by the experts' measured load can take its place."""
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) is not divisible by the {num_ranks} ranks of expert parallelism")
    per_rank = num_experts // num_ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


ExpertWeight = torch.Tensor | QuantizedWeight


def _multiply(x: torch.Tensor, weight: ExpertWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T in out_dtype: a dense (or oneDNN-packed) weight multiplies in its dtype, GGUF blocks in float32."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x.float()).to(out_dtype)
    return packed_linear(x, weight, None, out_dtype)


def fused_experts(x: torch.Tensor, w13: Sequence[ExpertWeight], w2: Sequence[ExpertWeight], weights: torch.Tensor,
                  ids: torch.Tensor, act: nn.Module, counts: list[int] | None = None) -> torch.Tensor:
    """sum over each token's experts e of weights * down_e(silu(gate_e(x)) * up_e(x)), in increasing expert order.
    x [T, H]; w13[e] [2 * I, H] (gate rows, then up) and w2[e] [H, I], as tensors, packed for oneDNN (pack_weight) or
    GGUF blocks; weights, ids [T, top_k], an id of len(w13) standing for an expert this rank does not hold (its pairs
    are skipped); counts: the pairs of each expert here, where the caller has counted them already. The experts multiply
    in their weights' dtype; the sum is x's."""
    top_k, num_experts = ids.shape[1], len(w13)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # the (token, slot) pairs grouped by expert
    if counts is None:
        counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start:start + count]
        gate_up = w13[expert]
        hidden = act(_multiply(x[rows], gate_up, x.dtype if isinstance(gate_up, QuantizedWeight) else gate_up.dtype))
        expert_out = _multiply(hidden, w2[expert], x.dtype) * pair_weights[start:start + count]
        out.index_add_(0, rows, expert_out.to(out.dtype))  # the float32 routing weights widen a half-precision product
        start += count
    return out


class FusedMoE(nn.Module):
    """num_experts experts of intermediate_size features each: this rank's share of every expert's features, or, with
    expert parallelism, its experts whole (local_experts, by their global ids)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        info = rank_info()
        self.hidden_size = hidden_size
        self.over_cores = expert_groups()
        self.expert_parallel = self.over_cores is not None or (info.expert_parallel and info.tp_size > 1)
        if self.over_cores is not None:
            self.local_experts = expert_placement(num_experts, self.over_cores.size, self.over_cores.rank)
            self.intermediate_range = (0, intermediate_size)
        elif self.expert_parallel:
            self.local_experts = expert_placement(num_experts, info.tp_size, info.tp_rank)
            self.intermediate_range = (0, intermediate_size)
        else:
            self.local_experts = range(num_experts)
            self.intermediate_range = split_evenly(intermediate_size, "the experts' intermediate size")
        # Global expert id -> its index here, or len(local_experts) where another rank holds it.
        local_ids = torch.full((num_experts,), len(self.local_experts), dtype=torch.int64)
        local_ids[list(self.local_experts)] = torch.arange(len(self.local_experts))
        self.register_buffer("local_ids", local_ids, persistent=False)
        # Tokens routed to each expert (global ids) since the last reset: what /metrics reports per layer and expert.
        self.register_buffer("routed", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        local_intermediate = self.intermediate_range[1]
        self.w13 = nn.Parameter(torch.empty(len(self.local_experts), 2 * local_intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(self.local_experts), hidden_size, local_intermediate), requires_grad=False)
        self.act_fn = SiluAndMul()

    # Each local expert's (gate-up, down) as the forward pass multiplies them: packed for the engine's GEMMs, or GGUF
    # blocks. Either way the loaded weights are let go: unlike a dense layer's, they are most of a mixture's memory.
    packed: tuple[list[ExpertWeight], list[ExpertWeight]] | None = None

    def pack(self, dtype: torch.dtype, onednn: bool) -> None:
        """Multiply in dtype (bfloat16 where the engine runs its GEMMs so), each expert's matrices reordered for oneDNN
        where onednn; nothing to do for experts that run on their GGUF blocks."""
        if self.packed is None:
            self.packed = ([pack_weight(weight, dtype, onednn) for weight in self.w13],
                           [pack_weight(weight, dtype, onednn) for weight in self.w2])
        self._release_loaded_weights()

    def use_blocks(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gate_up_type: int, down_type: int,
                   kernels) -> bool:
        """Run every expert on its GGUF blocks (uint8 [E, rows, bytes per row]: gate and up [E, I, .] in gate_up_type,
        down [E, H, .] in down_type), this rank's share of them; False (and nothing changed) where the share would cut a
        block."""
        start, length = self.intermediate_range
        columns = block_columns(self.intermediate_range, kernels.gguf_block_shape(down_type))
        if columns is None:
            return False
        experts = list(self.local_experts)
        self.packed = ([QuantizedWeight(torch.cat([gate[e].narrow(0, start, length), up[e].narrow(0, start, length)]), gate_up_type,
                                        kernels) for e in experts],
                       [QuantizedWeight(down[e].narrow(1, *columns), down_type, kernels) for e in experts])
        self._release_loaded_weights()
        return True

    @property
    def on_blocks(self) -> bool:
        """Whether the experts run on GGUF blocks (use_blocks): their checkpoint's float tensors are not read."""
        return bool(self.block_weights())

    def block_weights(self) -> list[QuantizedWeight]:
        """The experts' weights that run on GGUF blocks (none before use_blocks)."""
        return [] if self.packed is None else [w for part in self.packed for w in part if isinstance(w, QuantizedWeight)]

    def _release_loaded_weights(self) -> None:
        self.w13 = nn.Parameter(torch.empty(0, *self.w13.shape[1:]), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, *self.w2.shape[1:]), requires_grad=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)  # once: for /metrics and for the grouping
        self.routed += counts
        if self.over_cores is not None:
            return self._forward_over_cores(x, weights, ids)
        held = counts.tolist()
        if self.expert_parallel:
            ids = self.local_ids[ids]
            held = [held[expert] for expert in self.local_experts]
        w13, w2 = self.packed or (self.w13, self.w2)
        return tp_all_reduce(fused_experts(x, w13, w2, weights, ids, self.act_fn, held))

    def _forward_over_cores(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        groups, k = self.over_cores, self.top_k
        # One gather for the tokens and their routing (expert ids are exact in float32). The cores' exchanges run on
        # the host (shared memory, or gloo): a device's rows go through it.
        gathered = groups.gather_rows(torch.cat([x.float(), weights, ids.float()], dim=1).cpu()).to(x.device)
        if gathered.shape[0] == 0:  # no core has tokens: every rank sees the same counts and skips the sum alike
            return x
        all_x, all_weights, all_ids = gathered.split([self.hidden_size, k, k], dim=1)
        all_ids = all_ids.long()
        counts = torch.bincount(all_ids.reshape(-1), minlength=self.num_experts).tolist()
        held = [counts[expert] for expert in self.local_experts]
        w13, w2 = self.packed or (self.w13, self.w2)
        out = fused_experts(all_x.to(x.dtype), w13, w2, all_weights.contiguous(), self.local_ids[all_ids], self.act_fn, held)
        return groups.sum_own_rows(out.cpu()).to(x.device)

    def join_without_tokens(self) -> None:
        """This layer's part in a step of the other cores, on a core with no tokens of its own to run."""
        self.forward(torch.empty(0, self.hidden_size), torch.empty(0, self.num_experts))

    def load_stacked(self, part: str, tensor: torch.Tensor, name: str) -> None:
        """Every expert's matrices at once, stacked as transformers (and its GGUF reader) hold them: gate_up
        [E, 2 * I, H] (gate rows, then up) or down [E, H, I]."""
        if tensor.shape[0] != self.num_experts:
            raise ValueError(f"tensor {name!r} stacks {tensor.shape[0]} experts, but the model has {self.num_experts}")
        if part == "down":
            for expert in range(self.num_experts):
                self.load_expert(expert, "down", tensor[expert], name)
            return
        gate, up = tensor.chunk(2, dim=1)
        for expert in range(self.num_experts):
            self.load_expert(expert, "gate", gate[expert], name)
            self.load_expert(expert, "up", up[expert], name)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's share of one expert's gate, up or down matrix (as the checkpoint holds it: [I, H] or [H, I]);
        nothing for an expert another rank holds."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} names expert {expert}, but the model has {self.num_experts}")
        local = int(self.local_ids[expert])
        if local == len(self.local_experts):
            return  # another rank holds it
        start, length = self.intermediate_range
        if part == "down":
            source, dest = tensor.narrow(1, start, length), self.w2[local]
        else:
            source = tensor.narrow(0, start, length)
            dest = self.w13[local].narrow(0, 0 if part == "gate" else length, length)
        if dest.shape != source.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, which does not fit an expert of shape "
                             f"{tuple(self.w13.shape[1:])} / {tuple(self.w2.shape[1:])} on this rank")
        with torch.no_grad():
            dest.copy_(source.to(dest.dtype))
