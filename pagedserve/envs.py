"""The environment variables pagedserve reads, all of them, read here and nowhere else. Everything
else is an EngineConfig field (and a CLI flag). The OpenMP variables pagedserve sets for its own
processes are in openmp.py."""

from __future__ import annotations

import os
from pathlib import Path

# Where converted models and compiled kernels are kept (default ~/.cache/pagedserve).
PAGEDSERVE_CACHE_DIR = "PAGEDSERVE_CACHE_DIR"
# Log level of pagedserve's processes (default INFO).
PAGEDSERVE_LOG_LEVEL = "PAGEDSERVE_LOG_LEVEL"
# What `dtype auto` resolves to on CPU: float32 or bfloat16 (default: bfloat16 where the processor has bfloat16 dot
# products or AMX tiles and its bfloat16 GEMMs measure at 0.9x float32's rate or more, else float32: executor/auto_dtype.py).
# The test suite sets float32, the exact mode its transformers references need.
PAGEDSERVE_CPU_AUTO_DTYPE = "PAGEDSERVE_CPU_AUTO_DTYPE"
# How the mp executor starts its worker processes: fork or spawn (default: fork where it is safe, else spawn).
PAGEDSERVE_WORKER_MULTIPROC_METHOD = "PAGEDSERVE_WORKER_MULTIPROC_METHOD"


def cache_root() -> Path:
    return Path(os.environ.get(PAGEDSERVE_CACHE_DIR, Path.home() / ".cache" / "pagedserve"))


def log_level() -> str:
    return os.environ.get(PAGEDSERVE_LOG_LEVEL, "INFO")


def worker_multiproc_method() -> str | None:
    method = os.environ.get(PAGEDSERVE_WORKER_MULTIPROC_METHOD) or None
    if method not in (None, "fork", "spawn"):
        raise ValueError(f"{PAGEDSERVE_WORKER_MULTIPROC_METHOD} must be fork or spawn, got {method!r}")
    return method


def cpu_auto_dtype() -> str | None:
    """float32 or bfloat16 where the environment fixes what `dtype auto` means on CPU, else None."""
    value = os.environ.get(PAGEDSERVE_CPU_AUTO_DTYPE) or None
    if value not in (None, "float32", "bfloat16"):
        raise ValueError(f"{PAGEDSERVE_CPU_AUTO_DTYPE} must be float32 or bfloat16, got {value!r}")
    return value
