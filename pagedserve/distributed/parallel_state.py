"""This process's place among the ranks of a tensor- and pipeline-parallel engine, and the collectives
the model layers use. Ranks are numbered pipeline-major: rank = pp_rank * tp_size + tp_rank, so the
ranks of one pipeline stage form a tensor-parallel group. torch.distributed does the communication
(gloo on CPU, NCCL on CUDA). In a process that runs the whole model alone every call is a no-op, so
layers call them unconditionally."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.config import DataParallelPlace
from pagedserve.distributed.shm_exchange import ShmExchange, room_for, sum_in_place

# How long a process waits for the others to form a group, or for one collective of a group (a core that died
# ends the others' waits sooner: their connections close).
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
# Bytes of one rank's tensor that an exchange through shared memory carries; larger ones go through gloo, where its
# fixed cost per call is small beside theirs.
SHM_CAPACITY = 16 << 20


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
_tp_exchange: ShmExchange | None = None  # the tensor-parallel group's, where its ranks share a machine
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
    global _info, _tp_group, _previous_stage, _next_stage, _tp_exchange
    dist.init_process_group(backend=backend, init_method=init_method, world_size=info.world_size, rank=info.rank)
    groups = [dist.new_group(list(range(stage * info.tp_size, (stage + 1) * info.tp_size))) for stage in range(info.pp_size)]
    _info = info
    _tp_group = groups[info.pp_rank]
    _previous_stage = info.rank - info.tp_size if not info.is_first_stage else None
    _next_stage = info.rank + info.tp_size if not info.is_last_stage else None
    _tp_exchange = _tp_shared_exchange(info) if backend == "gloo" and info.tp_size > 1 else None


def _tp_shared_exchange(info: RankInfo) -> ShmExchange | None:
    """The tensor-parallel group's exchange through shared memory, where all its ranks run on one machine and
    /dev/shm has room; its first rank makes it, tells the others its name and releases the name once all attached."""
    hosts: list = [None] * info.tp_size
    dist.all_gather_object(hosts, host_identity(), group=_tp_group)
    first = info.pp_rank * info.tp_size
    name = [None]
    if info.tp_rank == 0:
        exchange = ShmExchange(0, info.tp_size, SHM_CAPACITY) if len(set(hosts)) == 1 and room_for(info.tp_size, SHM_CAPACITY) else None
        name = [exchange.name if exchange is not None else None]
    dist.broadcast_object_list(name, src=first, group=_tp_group)
    if name[0] is None:
        return None
    if info.tp_rank != 0:
        exchange = ShmExchange(info.tp_rank, info.tp_size, SHM_CAPACITY, name[0])
    dist.barrier(group=_tp_group)
    if info.tp_rank == 0:
        exchange.release_name()
    return exchange


def host_identity() -> str:
    """This machine (and boot): processes with the same identity can share memory."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()}/{boot.read().strip()}"
    except OSError:
        return socket.gethostname()


def destroy_distributed() -> None:
    global _info, _tp_group, _previous_stage, _next_stage, _tp_exchange
    if dist.is_initialized():
        dist.destroy_process_group()
    _info, _tp_group, _previous_stage, _next_stage, _tp_exchange = RankInfo(), None, None, None, None


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks, in place."""
    if _info.tp_size > 1:
        if _tp_exchange is not None and _tp_exchange.fits(tensor):
            return sum_in_place(tensor, _tp_exchange.exchange(tensor))
        dist.all_reduce(tensor, group=_tp_group)
    return tensor


def tp_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' tensors concatenated along dim, in rank order, on every rank."""
    if _info.tp_size == 1:
        return tensor
    if _tp_exchange is not None and _tp_exchange.fits(tensor):
        return torch.cat(_tp_exchange.exchange(tensor), dim=dim)
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


def place_store(place: DataParallelPlace) -> dist.Store:
    """The data-parallel cores' store, where their processes meet to form groups."""
    host, port = place.store_host_port
    return dist.TCPStore(host, port, is_master=False, timeout=_GROUP_TIMEOUT)


def stateless_group(store: dist.Store, name: str, rank: int, size: int) -> dist.ProcessGroupGloo:
    """A gloo group of its own (not torch.distributed's default one, which a process has at most one of), formed by
    the processes that name it at store."""
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, _GROUP_TIMEOUT)


def stateless_exchange(store: dist.Store, name: str, rank: int, size: int) -> ShmExchange | None:
    """A shared-memory exchange among the processes that name it at store (all on the store's machine), made by rank
    0, which releases its name once the others have attached; None where /dev/shm lacks room for it."""
    key = f"{name}/shared-memory"
    if rank == 0:
        exchange = ShmExchange(0, size, SHM_CAPACITY) if room_for(size, SHM_CAPACITY) else None
        store.set(key, exchange.name if exchange is not None else "")
        if exchange is not None:
            store.wait([f"{key}/attached/{other}" for other in range(1, size)])
            exchange.release_name()
        return exchange
    shm_name = store.get(key).decode()
    if not shm_name:
        return None
    exchange = ShmExchange(rank, size, SHM_CAPACITY, shm_name)
    store.set(f"{key}/attached/{rank}", "1")
    return exchange


class ExpertGroups:
    """Expert parallelism over data-parallel engine cores: every rank of every core holds num_experts / (cores x
    tensor-parallel ranks) experts. A mixture layer gathers the tokens of every core (over `peers`: the ranks of the
    same tensor-parallel index, one per core, which hold the same tokens as their core's other ranks), applies its
    experts to all of them, and each core's rows of the partial outputs are summed over every rank (`world`)."""

    def __init__(self, place: DataParallelPlace, info: RankInfo) -> None:
        self.core, self.cores, self.tp_size = place.rank, place.size, info.tp_size
        self.size = place.size * info.tp_size
        self.rank = place.rank * info.tp_size + info.tp_rank
        store = place_store(place)
        self.world = stateless_group(store, "experts", self.rank, self.size)
        self.peers = stateless_group(store, f"experts-tp{info.tp_rank}", place.rank, place.size)
        # Every rank of every core: the cores' counts, and rows that fit, go through shared memory.
        self.shared = stateless_exchange(store, "experts", self.rank, self.size)
        self._counts: list[int] | None = None  # each core's tokens in the current pass
        self._gloo_s = 0.0  # seconds in gloo collectives, since made

    @property
    def waited_s(self) -> float:
        """Seconds spent in this rank's exchanges with the others since made: mostly waiting for their passes (a gloo
        collective's own time counts whole)."""
        return self._gloo_s + (self.shared.waited_s if self.shared is not None else 0.0)

    def _gloo(self, work) -> None:
        start = time.monotonic()
        work.wait()
        self._gloo_s += time.monotonic() - start

    def begin_pass(self, num_tokens: int) -> None:
        """Learn how many tokens each core's model pass carries (its layers gather that many rows each)."""
        if self.shared is not None:
            every_rank = self.shared.exchange(torch.tensor([num_tokens]))
            self._counts = [int(every_rank[core * self.tp_size]) for core in range(self.cores)]
            return
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.cores)]
        self._gloo(self.peers.allgather([counts], [torch.tensor([num_tokens])]))
        self._counts = [int(count) for count in counts]

    def _shares(self, row_bytes: int) -> bool:
        """Whether this pass's exchanges of rows that wide go through shared memory (the same answer on every rank:
        it depends on the cores' counts alone)."""
        return self.shared is not None and sum(self._counts) * row_bytes <= self.shared.capacity

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every core's rows of this pass (2-D, float32) in core order."""
        counts = self._counts
        if counts is None or counts[self.core] != rows.shape[0]:
            raise RuntimeError(f"a mixture layer gathers {rows.shape[0]} rows in a pass begun with {counts}")
        if self._shares(rows.shape[1] * rows.element_size()):
            every_rank = self.shared.exchange(rows)
            return torch.cat([every_rank[core * self.tp_size] for core in range(self.cores)])
        padded = rows.new_zeros(max(counts), rows.shape[1])  # gloo gathers equal shapes
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.cores)]
        self._gloo(self.peers.allgather([parts], [padded]))
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def sum_own_rows(self, partial: torch.Tensor) -> torch.Tensor:
        """This core's rows of partial ([every core's rows of this pass, ...], in core order) summed over every rank:
        each rank sends each core's ranks that core's rows (an all-to-all, which moves each row only to where it is
        summed and costs gloo less time than an all-reduce of every row)."""
        counts, mine = self._counts, self._counts[self.core]
        if self._shares(partial.shape[1] * partial.element_size()):
            first = sum(counts[: self.core])
            return sum_in_place(partial.new_empty((mine, *partial.shape[1:])),
                                [every[first:first + mine] for every in self.shared.exchange(partial)])
        blocks = partial.split(counts)
        send = torch.cat([block for block in blocks for _ in range(self.tp_size)]) if self.tp_size > 1 else partial.contiguous()
        received = partial.new_empty((self.size * mine, *partial.shape[1:]))
        self._gloo(self.world.alltoall_base(received, send, [mine] * self.size,
                                            [count for count in counts for _ in range(self.tp_size)], dist.AllToAllOptions()))
        return received.view(self.size, mine, *partial.shape[1:]).sum(0)


_expert_groups: ExpertGroups | None = None


def init_expert_groups(place: DataParallelPlace) -> None:
    """Join the groups of expert parallelism over the data-parallel cores (every rank of every core calls this)."""
    global _expert_groups
    _expert_groups = ExpertGroups(place, _info)


def expert_groups() -> ExpertGroups | None:
    return _expert_groups
