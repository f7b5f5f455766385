"""The environment variables pagedserve reads, all of them, read here and nowhere else. Everything
else is an EngineConfig field (and a CLI flag). The OpenMP variables pagedserve sets for its own
processes are in executor/cpu_host.py."""

from __future__ import annotations

import os
from pathlib import Path

# Where converted models and compiled kernels are kept (default ~/.cache/pagedserve).
PAGEDSERVE_CACHE_DIR = "PAGEDSERVE_CACHE_DIR"
# Log level of pagedserve's processes (default INFO).
PAGEDSERVE_LOG_LEVEL = "PAGEDSERVE_LOG_LEVEL"


def cache_root() -> Path:
    return Path(os.environ.get(PAGEDSERVE_CACHE_DIR, Path.home() / ".cache" / "pagedserve"))


def log_level() -> str:
    return os.environ.get(PAGEDSERVE_LOG_LEVEL, "INFO")
