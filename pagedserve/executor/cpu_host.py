"""Tuning of the CPU host an engine runs on: threads per rank and the CPUs they run on, glibc's malloc, and mapping
the KV cache's pages ahead of use. The measurements behind each choice are in docs/cpu.md.

**OpenMP** waiting is set before torch loads, in pagedserve/openmp.py. **Threads**: threads_per_rank below is
the one rule for how many torch threads a rank runs; thread_cpus and ThreadPinning for where they run.

**malloc.** glibc maps large blocks straight from the OS and unmaps them on free, and trims the top
of its heap; a long prefill step frees large activation buffers, which the next step would then
page-fault back in. A fixed mmap threshold at glibc's maximum and no trimming keep them. Blocks above that
maximum still come fresh each time (host_memory.py), so what would be one every step is kept instead (the model
runner's logits of many rows).

**KV cache pages.** The cache comes from calloc, so start-up does not pay for gigabytes of page
faults; but a first touch of memory is slow on VMs, and without help the engine pays it inside its
steps as it first writes K/V into each block. A background thread maps the pages in while the engine
is idle (MADV_POPULATE_WRITE: as a write would, without changing contents, so it is safe beside the
engine's own writes), in the order the block pool hands blocks out, at SCHED_IDLE. The cache is mapped in 4 KB pages:
a VM that hands free memory back to its host backs a 2 MB page afresh at its first touch, many times slower a byte.
Once every page is mapped, the same thread gathers the cache into 2 MB pages (MADV_COLLAPSE, Linux 6.1+), again only
while the engine is idle: the decode attention reads every block of every running sequence each step, and with 4 KB
pages its reads wait on page walks. The thread holds the caches through weak references, so a dropped engine stops
it, and it is stopped at interpreter exit (a daemon thread still inside madvise there made the C++ runtime abort the
exiting process).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from pagedserve.host_memory import FRESH_PAGES_ABOVE_BYTES

if TYPE_CHECKING:
    import torch

    from pagedserve.config import EngineConfig

logger = logging.getLogger(__name__)


def threads_per_rank(config: EngineConfig) -> int | None:
    """torch intra-op threads of each rank: num_threads where the user set it, else the machine's cores shared
    evenly among every rank of every engine core (data parallelism included); None where one rank runs alone,
    which keeps torch's own default."""
    if config.num_threads is not None:
        return config.num_threads
    ranks = config.world_size * config.data_parallel_size
    return None if ranks == 1 else max(1, (os.cpu_count() or 1) // ranks)


def thread_cpus(config: EngineConfig, rank: int, threads: int, in_engine_process: bool, cpus: list[int]) -> list[int] | None:
    """The CPUs to pin a rank's torch threads to, thread i to the i-th (ThreadPinning), from cpus (the process's, one
    per core first: cpus_one_per_core_first), each rank of the engine taking its own; None where they stay unpinned:
    pinning is off, the process is the caller's (pinning its threads would bind the program and every process it
    starts later), the ranks may run on other machines (Ray), or the ranks' threads outnumber the CPUs."""
    world_size = config.world_size
    if not (config.pin_threads and in_engine_process):
        return None
    if world_size > 1 and config.distributed_executor_backend == "ray":
        return None
    if world_size * threads > len(cpus):
        logger.info("torch threads left unpinned: %d rank(s) x %d threads outnumber the %d CPUs this process may use",
                    world_size, threads, len(cpus))
        return None
    return cpus[rank * threads : (rank + 1) * threads]


def cpus_one_per_core_first(cpus: list[int], core_of: Callable[[int], object]) -> list[int]:
    """cpus, the first CPU of each physical core before a core's second (hyperthread): threads pinned in this order get
    a core each while there are cores to give. core_of(cpu) names the core a CPU belongs to (cpu_core)."""
    seen: dict[object, int] = {}
    rank_in_core = {}
    for cpu in sorted(cpus):
        core = core_of(cpu)
        rank_in_core[cpu] = seen.get(core, 0)
        seen[core] = rank_in_core[cpu] + 1
    return sorted(cpus, key=lambda cpu: (rank_in_core[cpu], cpu))


def cpu_core(cpu: int) -> object:
    """(package, core) of a CPU as Linux's sysfs tells it; the CPU itself where it does not."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return cpu


# Steps of up to this many tokens run on pinned threads, larger ones on threads the OS places (ThreadPinning).
PINNED_MAX_TOKENS = 1


class ThreadPinning:
    """A rank's torch threads pinned one to a CPU each (thread i to cpus[i]) for steps of up to PINNED_MAX_TOKENS
    tokens, and free on all the process's CPUs (free_cpus) for larger ones. In a lone stream's short decode step, a
    thread the OS stacks on its sibling's CPU (as it does when a front end wakes on theirs) can double the step. A
    larger step hands the front end more tokens to process, and a pinned thread must then share its CPU with that work,
    where free threads served as many tokens a second (docs/cpu.md, "Threads pinned to CPUs while one stream decodes")."""

    def __init__(self, kernels, cpus: list[int], free_cpus: list[int]) -> None:
        self.cpus = cpus
        self._kernels = kernels
        self._free = [free_cpus] * len(cpus)
        self.pinned = False

    def for_step(self, num_tokens: int) -> None:
        """Pin or free the threads for a step of num_tokens (an empty step, which runs no pass, changes nothing)."""
        wanted = num_tokens <= PINNED_MAX_TOKENS
        if num_tokens and wanted != self.pinned:
            self._kernels.set_thread_cpus([[cpu] for cpu in self.cpus] if wanted else self._free)
            self.pinned = wanted


def thread_pinning(config: EngineConfig, rank: int, kernels, in_engine_process: bool) -> ThreadPinning | None:
    """This rank's ThreadPinning where thread_cpus gives it CPUs and the C++ kernels are loaded (they set each thread's
    CPUs from inside OpenMP's threads); None otherwise."""
    import torch

    if kernels is None:
        return None
    own = sorted(os.sched_getaffinity(0))
    cpus = thread_cpus(config, rank, torch.get_num_threads(), in_engine_process, cpus_one_per_core_first(own, cpu_core))
    return ThreadPinning(kernels, cpus, own) if cpus else None


def limit_front_end_threads() -> None:
    """The server's front end does no tensor math: if anything pulled torch into it, keep it off the engine's cores."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


# ---- malloc --------------------------------------------------------------------------------

# glibc <malloc.h> parameter ids.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The C library (errno kept for ctypes.get_errno), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


def keep_freed_memory() -> bool:
    """Keep freed host memory in the process (see the module doc); returns whether glibc took it.
    No-op where malloc is not glibc's."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # c_int: the trim threshold is a size_t inside glibc; the largest int is plenty (2 GiB).
    ok = mallopt(_M_MMAP_THRESHOLD, FRESH_PAGES_ABOVE_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        logger.debug("mallopt refused the settings; freed memory goes back to the OS")
    return ok


# ---- KV cache pages ----------------------------------------------------------------------------

_MADV_HUGEPAGE = 14  # <linux/mman.h>
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_COLLAPSE = 25  # Linux 6.1+
_BLOCKS_PER_CALL = 64  # ~0.75 MB per layer and K or V at the default shapes: a short syscall
_HUGE_PAGE = 2 << 20  # what one MADV_COLLAPSE call gathers: one page, so a step waits for one at most
_running: dict[threading.Thread, threading.Event] = {}


def use_small_pages(tensor: torch.Tensor) -> bool:
    """Asks for 4 KB pages under a contiguous tensor not yet touched; returns whether the kernel took it. numpy asks
    for 2 MB pages under every large array (MADV_HUGEPAGE), and a VM that hands free memory back to its host backs a
    2 MB page afresh at its first touch, many times slower a byte than 4 KB pages (docs/cpu.md, "KV cache pages"); the
    prefault gathers the pages into 2 MB ones once they are mapped, while the engine is idle."""
    madvise = _madvise()
    start, end = _whole_pages(tensor, mmap.PAGESIZE)
    return madvise is not None and end > start and madvise(start, end - start, _MADV_NOHUGEPAGE) == 0


def _whole_pages(tensor: torch.Tensor, page_bytes: int) -> tuple[int, int]:
    """The whole pages of page_bytes inside a contiguous tensor: (start, end) addresses, end == start if none."""
    start = -(-tensor.data_ptr() // page_bytes) * page_bytes
    return start, max(start, (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page_bytes * page_bytes)


def prefault_in_background(kv_caches: list[torch.Tensor], may_run: Callable[[], bool] = lambda: True) -> threading.Thread | None:
    """Starts mapping the pages of kv_caches (each [2, num_blocks, ...], contiguous) block by block, then gathering
    them into 2 MB pages, whenever may_run() says so (checked every ~10 ms); returns the thread, or None where madvise
    is unavailable."""
    madvise = _madvise()
    if madvise is None or not kv_caches:
        return None
    refs = [weakref.ref(cache) for cache in kv_caches]
    stop = threading.Event()
    thread = threading.Thread(target=_prefault, args=(madvise, refs, kv_caches[0].shape[1], may_run, stop), name="kv-prefault",
                              daemon=True)
    _running[thread] = stop
    thread.start()
    return thread


@atexit.register
def _stop_all() -> None:
    for thread, stop in list(_running.items()):
        stop.set()
        thread.join()


def _madvise():
    madvise = getattr(libc(), "madvise", None)
    if madvise is None:
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _prefault(madvise, refs: list[weakref.ref], num_blocks: int, may_run: Callable[[], bool], stop: threading.Event) -> None:
    try:
        try:
            # At idle priority: page faults on a VM hold the core in the hypervisor, where the guest cannot
            # preempt them, so a thread at normal priority slowed the engine's own work.
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
        except (AttributeError, OSError):
            pass  # no SCHED_IDLE here: the thread still only sleeps in the kernel while it maps pages
        if _map_blocks(madvise, refs, num_blocks, may_run, stop):
            _gather_huge_pages(madvise, refs, may_run, stop)
    finally:
        _running.pop(threading.current_thread(), None)


def _map_blocks(madvise, refs: list[weakref.ref], num_blocks: int, may_run: Callable[[], bool], stop: threading.Event) -> bool:
    """True once every block is mapped; False if stopped first."""
    for first in range(0, num_blocks, _BLOCKS_PER_CALL):
        last = min(first + _BLOCKS_PER_CALL, num_blocks)
        for ref in refs:
            for half in (0, 1):  # K, then V
                # Asked before every call: a step that begins while one runs waits for it (in the hypervisor, where
                # the guest cannot preempt it), so no more than one call may overlap a step.
                if not _allowed(may_run, stop):
                    return False
                cache = ref()
                if cache is None:
                    return False  # the engine is gone
                mapped = _populate(madvise, cache[half, first:last])
                del cache
                if not mapped:
                    return False
    return True


def _gather_huge_pages(madvise, refs: list[weakref.ref], may_run: Callable[[], bool], stop: threading.Event) -> None:
    """Gathers each cache's mapped 4 KB pages into 2 MB pages, one page a call, the blocks the pool hands out first
    first. A kernel without MADV_COLLAPSE leaves them as they are; a page it cannot gather now stays small."""
    offset, any_left = 0, True
    while any_left:
        any_left = False
        for ref in refs:
            for half in (0, 1):
                if not _allowed(may_run, stop):
                    return
                cache = ref()
                if cache is None:
                    return
                start, end = _whole_pages(cache[half], _HUGE_PAGE)
                del cache
                if start + offset >= end:
                    continue
                any_left = True
                if offset == 0 and madvise(start, end - start, _MADV_HUGEPAGE) != 0:  # undoes use_small_pages
                    return
                if madvise(start + offset, _HUGE_PAGE, _MADV_COLLAPSE) != 0 and ctypes.get_errno() == errno.EINVAL:
                    logger.debug("the KV cache stays in 4 KB pages: this kernel has no MADV_COLLAPSE")
                    return
        offset += _HUGE_PAGE


def _allowed(may_run: Callable[[], bool], stop: threading.Event) -> bool:
    """Waits until may_run() says the thread may go on (checked every ~10 ms); False once it is stopped."""
    while not may_run():
        if stop.wait(0.01):
            return False
    return not stop.is_set()


def _populate(madvise, blocks: torch.Tensor) -> bool:
    """Maps the pages under a contiguous range of blocks (rounded out to whole pages)."""
    start = blocks.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = blocks.data_ptr() + blocks.numel() * blocks.element_size()
    if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    logger.debug("KV cache prefault stopped: madvise failed (%s)", os.strerror(ctypes.get_errno()))
    return False


class KVCachePrefault:
    """The prefault of one process's KV cache, run whenever that process has not stepped for a little while
    (steps of an engine with requests follow each other within milliseconds)."""

    IDLE_AFTER_S = 0.05

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self._in_step = False
        self._last_step_end = 0.0
        is_idle = weakref.WeakMethod(self._is_idle)  # the thread must not keep a dropped engine alive
        self.thread = prefault_in_background(kv_caches, may_run=lambda: (idle := is_idle()) is None or idle())

    def step_started(self) -> None:
        self._in_step = True

    def step_ended(self) -> None:
        self._in_step = False
        self._last_step_end = time.monotonic()

    def wait(self, timeout_s: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)

    def _is_idle(self) -> bool:
        return not self._in_step and time.monotonic() - self._last_step_end > self.IDLE_AFTER_S
