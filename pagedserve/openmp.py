"""OpenMP's thread waiting, set before torch loads (the measurements behind it are in docs/cpu.md).

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it, so they must
be in the environment before `import torch`. set_openmp_defaults() runs when the `pagedserve` package
is imported (pagedserve/__init__.py), which precedes torch in every process pagedserve starts (the
CLI, the engine-core process, worker processes) since each imports the package first, and spawned
children inherit the environment. A program that imports torch before pagedserve keeps torch's
defaults; that is logged. Threads that spin without end starve the front end and the other ranks when
they share the cores (PASSIVE: they sleep between parallel regions), but waking a sleeping thread is
slow beside a parallel region's work and a decode step opens hundreds of them, so they spin briefly first.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
_openmp_set_here: list[str] = []


def set_openmp_defaults() -> None:
    """Put OPENMP_DEFAULTS into the environment where the user has not set them (see the module doc).
    Processes started from here inherit them even where this one loaded torch too early to use them."""
    if _openmp_set_here:
        return
    if "torch" in sys.modules:
        logger.debug("torch was imported before pagedserve: this process's OpenMP runtime keeps its own wait policy")
    for name, value in OPENMP_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            _openmp_set_here.append(name)


def environment_without_openmp_defaults() -> dict[str, str]:
    """The environment as the user had it, for baselines that must run as their users run them."""
    return {name: value for name, value in os.environ.items() if name not in _openmp_set_here}
