"""This process's place among the ranks of a tensor- and pipeline-parallel engine, and the collectives
the model layers use. Ranks are numbered pipeline-major: rank = pp_rank * tp_size + tp_rank, so the
ranks of one pipeline stage form a tensor-parallel group. torch.distributed does the communication
(gloo on CPU, NCCL on CUDA). In a process that runs the whole model alone every call is a no-op, so
layers call them unconditionally."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.config import DataParallelPlace

# How long a process waits for the others to form a group, or for one collective of a group (a core that died
# ends the others' waits sooner: their connections close).
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class RankInfo:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    # Decoder layers per pipeline stage; None: as even as they go, the first stages taking any remainder.
    layer_partition: tuple[int, ...] | None = None
    # A mixture's experts spread whole over the tensor-parallel group (expert parallelism), not split within it.
    expert_parallel: bool = False

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's pipeline stage runs."""
        counts = self.layer_partition or pipeline_partition(num_layers, self.pp_size)
        start = sum(counts[: self.pp_rank])
        return range(start, start + counts[self.pp_rank])

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank whose step outputs go back to the engine: the last stage's first tensor-parallel rank."""
        return self.is_last_stage and self.tp_rank == 0


def pipeline_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (stage < extra) for stage in range(pp_size))


_info = RankInfo()
_tp_group = None
_previous_stage: int | None = None
_next_stage: int | None = None


def rank_info() -> RankInfo:
    return _info


def tp_rank() -> int:
    return _info.tp_rank


def tp_size() -> int:
    return _info.tp_size


def init_distributed(info: RankInfo, init_method: str, backend: str) -> None:
    """Join the process group (every rank calls this) and make the tensor-parallel groups."""
    global _info, _tp_group, _previous_stage, _next_stage
    dist.init_process_group(backend=backend, init_method=init_method, world_size=info.world_size, rank=info.rank)
    groups = [dist.new_group(list(range(stage * info.tp_size, (stage + 1) * info.tp_size))) for stage in range(info.pp_size)]
    _info = info
    _tp_group = groups[info.pp_rank]
    _previous_stage = info.rank - info.tp_size if not info.is_first_stage else None
    _next_stage = info.rank + info.tp_size if not info.is_last_stage else None


def destroy_distributed() -> None:
    global _info, _tp_group, _previous_stage, _next_stage
    if dist.is_initialized():
        dist.destroy_process_group()
    _info, _tp_group, _previous_stage, _next_stage = RankInfo(), None, None, None


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks, in place."""
    if _info.tp_size > 1:
        dist.all_reduce(tensor, group=_tp_group)
    return tensor


def tp_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' tensors concatenated along dim, in rank order, on every rank."""
    if _info.tp_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_info.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Each tensor to the same tensor-parallel rank of the next pipeline stage."""
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=_next_stage)


def receive_from_previous_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    for tensor in tensors:
        dist.recv(tensor, src=_previous_stage)
    return tensors


def stateless_group(place: DataParallelPlace, name: str, rank: int, size: int) -> dist.ProcessGroupGloo:
    """A gloo group of its own (not torch.distributed's default one, which a process has at most one of), formed by
    the processes that name it at the data-parallel cores' store."""
    host, port = place.store_host_port
    store = dist.TCPStore(host, port, is_master=False, timeout=_GROUP_TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, _GROUP_TIMEOUT)


class ExpertGroups:
    """Expert parallelism over data-parallel engine cores: every rank of every core holds num_experts / (cores x
    tensor-parallel ranks) experts. A mixture layer gathers the tokens of every core (over `peers`: the ranks of the
    same tensor-parallel index, one per core, which hold the same tokens as their core's other ranks), applies its
    experts to all of them, and each core's rows of the partial outputs are summed over every rank (`world`)."""

    def __init__(self, place: DataParallelPlace, info: RankInfo) -> None:
        self.core, self.cores, self.tp_size = place.rank, place.size, info.tp_size
        self.size = place.size * info.tp_size
        self.rank = place.rank * info.tp_size + info.tp_rank
        self.world = stateless_group(place, "experts", self.rank, self.size)
        self.peers = stateless_group(place, f"experts-tp{info.tp_rank}", place.rank, place.size)
        self._counts: list[int] | None = None  # each core's tokens in the current pass

    def begin_pass(self, num_tokens: int) -> None:
        """Learn how many tokens each core's model pass carries (its layers gather that many rows each)."""
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.cores)]
        self.peers.allgather([counts], [torch.tensor([num_tokens])]).wait()
        self._counts = [int(count) for count in counts]

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every core's rows of this pass (2-D, float32) in core order."""
        counts = self._counts
        if counts is None or counts[self.core] != rows.shape[0]:
            raise RuntimeError(f"a mixture layer gathers {rows.shape[0]} rows in a pass begun with {counts}")
        padded = rows.new_zeros(max(counts), rows.shape[1])  # gloo gathers equal shapes
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.cores)]
        self.peers.allgather([parts], [padded]).wait()
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def sum_own_rows(self, partial: torch.Tensor) -> torch.Tensor:
        """This core's rows of partial ([every core's rows of this pass, ...], in core order) summed over every rank:
        each rank sends each core's ranks that core's rows (an all-to-all, which moves each row only to where it is
        summed and costs gloo less time than an all-reduce of every row)."""
        counts, mine = self._counts, self._counts[self.core]
        blocks = partial.split(counts)
        send = torch.cat([block for block in blocks for _ in range(self.tp_size)]) if self.tp_size > 1 else partial.contiguous()
        received = partial.new_empty((self.size * mine, *partial.shape[1:]))
        self.world.alltoall_base(received, send, [mine] * self.size, [count for count in counts for _ in range(self.tp_size)],
                                 dist.AllToAllOptions()).wait()
        return received.view(self.size, mine, *partial.shape[1:]).sum(0)


_expert_groups: ExpertGroups | None = None


def init_expert_groups(place: DataParallelPlace) -> None:
    """Join the groups of expert parallelism over the data-parallel cores (every rank of every core calls this)."""
    global _expert_groups
    _expert_groups = ExpertGroups(place, _info)


def expert_groups() -> ExpertGroups | None:
    return _expert_groups
