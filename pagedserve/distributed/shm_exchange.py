"""Collectives among the processes of one machine through POSIX shared memory: each rank writes its tensor once, and
every rank reads all of them there. gloo's collectives go over loopback TCP through its own threads, a millisecond
or more a call however small the tensor, and a model pass makes one or two per layer; vLLM's CPU backend sums its
tensor-parallel ranks in shared memory for the same reason.

Layout: per rank a 64-byte line whose first word counts the exchanges it has written ("posted"); then two buffers
(alternate exchanges use alternate ones), each a slot per rank: a 64-byte header (bytes, dtype, shape) and up to
capacity bytes. Exchange n writes buffer n % 2 once every rank has posted n - 1, by which time each has finished
reading exchange n - 2 from it; it reads the slots once every rank has posted n. On x86 a store is seen after the
stores before it; elsewhere _fence() orders them. A tensor over capacity, or ranks on different machines, take gloo.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import torch

_LINE = 64
_HEADER_WORDS = 8  # nbytes, dtype code, ndim, up to 5 sizes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
# Spin (yielding the core) this long before sleeping between looks: exchanges within a step meet in microseconds,
# a core that waits for another core's step may wait long.
_SPIN_S = 0.002
_SLEEP_S = 0.0002
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


class ShmExchange:
    """One tensor from each of `size` ranks (rank: this one's index), each sees all: the primitive under sum, gather
    and all-to-all. Made by one rank (create) and attached by the others under its name."""

    def __init__(self, rank: int, size: int, capacity: int, name: str | None = None) -> None:
        self.rank, self.size, self.capacity = rank, size, capacity
        self.slot_bytes = _LINE + capacity
        total = size * _LINE + 2 * size * self.slot_bytes
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=total if name is None else 0)
        if name is None:  # until every rank has attached (release_name), or should this process end before
            atexit.register(self.release_name)
        self.posted = np.ndarray((size, _LINE // 8), np.int64, self.shm.buf, 0)
        if name is None:
            self.posted[:] = 0
        self.bytes = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.count = int(self.posted[rank, 0])
        self.waited_s = 0.0  # seconds spent waiting for the other ranks, since made

    @property
    def name(self) -> str:
        return self.shm.name

    def release_name(self) -> None:
        """Remove the memory's name once every rank has attached: the ranks keep their mappings, and the memory goes with
        the last of them, however the processes end (killed ones run no clean-up)."""
        try:
            self.shm.unlink()
        except FileNotFoundError:  # released already
            pass

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in _DTYPES and tensor.dim() <= 5 and \
            tensor.numel() * tensor.element_size() <= self.capacity

    def exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (this one's included), as views into the shared memory: read them before the exchange
        after next."""
        self.count += 1
        buffer = self.count % 2
        self._wait_all(self.count - 1)
        offset = self._slot(buffer, self.rank)
        header = np.ndarray((_HEADER_WORDS,), np.int64, self.shm.buf, offset)
        nbytes = tensor.numel() * tensor.element_size()
        header[:3] = (nbytes, _DTYPES.index(tensor.dtype), tensor.dim())
        header[3:3 + tensor.dim()] = tensor.shape
        self.bytes[offset + _LINE:offset + _LINE + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        _fence()
        self.posted[self.rank, 0] = self.count
        self._wait_all(self.count)
        return [self._view(buffer, rank) for rank in range(self.size)]

    def _slot(self, buffer: int, rank: int) -> int:
        return self.size * _LINE + (buffer * self.size + rank) * self.slot_bytes

    def _view(self, buffer: int, rank: int) -> torch.Tensor:
        offset = self._slot(buffer, rank)
        nbytes, code, ndim, *sizes = (int(word) for word in np.ndarray((_HEADER_WORDS,), np.int64, self.shm.buf, offset))
        data = self.bytes[offset + _LINE:offset + _LINE + nbytes]
        return data.view(_DTYPES[code]).view(sizes[:ndim])

    def _wait_all(self, count: int) -> None:
        posted = self.posted[:, 0]
        if posted.min() >= count:
            _fence()
            return
        start = now = time.monotonic()
        while posted.min() < count:
            if now - start < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)
            now = time.monotonic()
        self.waited_s += now - start
        _fence()


def room_for(size: int, capacity: int) -> bool:
    """Whether the shared-memory file system has room for an exchange of size ranks (a write past its free space would
    kill the writer, not fail)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize > 2 * (size * _LINE + 2 * size * (_LINE + capacity))


def sum_in_place(tensor: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """tensor = the parts' sum, added in rank order (so every rank gets the same bits)."""
    tensor.copy_(parts[0])
    for part in parts[1:]:
        tensor.add_(part)
    return tensor
