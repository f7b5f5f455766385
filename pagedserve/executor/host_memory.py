"""Keep freed host memory in the process, so engine steps do not page-fault their activations anew.

glibc's malloc maps blocks above a threshold (it grows to at most 32 MiB) straight from the OS and
unmaps them on free, and gives the top of its heap back once more than twice that is free. A
2048-token prefill step frees tens of MB of activations at its end, so every such step page-faulted
400-800 MB back in: on this VM 0.5-1 s of a 3.5 s step. Above a fixed threshold of 32 MiB and with
trimming off, the next step reuses the same pages. vLLM's CPU docs reach the same end by preloading
tcmalloc; this needs no extra library. No-op where malloc is not glibc's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache

logger = logging.getLogger(__name__)

# glibc <malloc.h> parameter ids.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024**2  # glibc's upper bound on 64-bit systems


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The C library (errno kept for ctypes.get_errno), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


def keep_freed_memory() -> bool:
    """Returns whether glibc took the settings."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # c_int: the trim threshold is a size_t inside glibc; the largest int is plenty (2 GiB).
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        logger.debug("mallopt refused the settings; freed memory goes back to the OS")
    return ok
