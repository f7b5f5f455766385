"""Map the KV cache's pages in ahead of use, from a background thread at idle priority.

The cache comes from calloc, so start-up does not pay for gigabytes of page faults. But a first touch
of memory is slow on the VMs we run on (250 MB/s to 2 GB/s), and without this the engine paid it
inside its steps, as it first wrote K/V into each block: a fresh engine's 2048-token prefill step ran
at 464 tokens/s against 537 for the same bare forward on blocks already touched, and at 601 against
603 once the cache had been touched beforehand (docs/benchmarks.md).

MADV_POPULATE_WRITE (Linux 5.14+) maps pages as a write would, without changing their contents, so it
is safe while the engine writes K/V into the same blocks. Blocks are mapped in the order the block
pool hands them out (ascending ids), so the first requests find theirs mapped first. The thread maps
only while the engine has no requests (a server between start-up and its first requests, or between
bursts), at SCHED_IDLE: started before the model loaded, it slowed start-up by ~1 s (page faults on a
VM hold the core in the hypervisor, where the guest cannot preempt them). It holds the caches only through weak
references, so an engine that is dropped stops it, and it is stopped at interpreter exit (a daemon
thread still inside madvise there made the C++ runtime abort the exiting process).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import torch

from pagedserve.executor.host_memory import libc

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
_BLOCKS_PER_CALL = 64  # ~0.75 MB per layer and K or V at the default shapes: a short syscall
_running: dict[threading.Thread, threading.Event] = {}


def prefault_in_background(kv_caches: list[torch.Tensor], may_run: Callable[[], bool] = lambda: True) -> threading.Thread | None:
    """Starts mapping the pages of kv_caches (each [2, num_blocks, ...], contiguous) block by block,
    whenever may_run() says so (checked every ~10 ms); returns the thread, or None where madvise is unavailable."""
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
        _map_blocks(madvise, refs, num_blocks, may_run, stop)
    finally:
        _running.pop(threading.current_thread(), None)


def _map_blocks(madvise, refs: list[weakref.ref], num_blocks: int, may_run: Callable[[], bool], stop: threading.Event) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (AttributeError, OSError):
        pass  # no SCHED_IDLE here: the thread still only sleeps in the kernel while it maps pages
    for first in range(0, num_blocks, _BLOCKS_PER_CALL):
        while not may_run():
            if stop.wait(0.01):
                return
        if stop.is_set():
            return
        last = min(first + _BLOCKS_PER_CALL, num_blocks)
        for ref in refs:
            cache = ref()
            if cache is None:
                return  # the engine is gone
            for half in cache:  # K, then V
                if not _populate(madvise, half[first:last]):
                    return
            del cache


def _populate(madvise, blocks: torch.Tensor) -> bool:
    """Maps the pages under a contiguous range of blocks (rounded out to whole pages)."""
    start = blocks.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = blocks.data_ptr() + blocks.numel() * blocks.element_size()
    if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    logger.debug("KV cache prefault stopped: madvise failed (%s)", os.strerror(ctypes.get_errno()))
    return False
