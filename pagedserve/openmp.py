"""OpenMP's thread waiting, set before torch loads (the measurements behind it are in docs/cpu.md).

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it, so they must
be in the environment before `import torch`. set_openmp_defaults() runs when the `pagedserve` package
is imported (pagedserve/__init__.py), which precedes torch in every process pagedserve starts (the
CLI, the engine-core process, worker processes) since each imports the package first, and spawned
children inherit the environment. A program that imports torch before pagedserve keeps torch's
defaults; that is logged. Threads that spin without end starve the front end and the other ranks when
they share the cores (PASSIVE: they sleep between parallel regions), but waking a sleeping thread is
slow beside a parallel region's work and a decode step opens hundreds of them, so they spin first.

A spin is counted in turns (GOMP_SPINCOUNT), each an x86 `pause`, whose length is the processor design's; the count
is SPIN_SECONDS over the length of a turn on this processor, measured once by the kernels (when set-up compiles them,
or at a worker's first start on the machine) and kept in the cache directory for every later start.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pagedserve import cached_json
from pagedserve.cpu_features import cpu_features

logger = logging.getLogger(__name__)

# How long a waiting thread spins before it sleeps: through the host's work between a step's parallel regions and
# through another process's brief turn on its CPU (the front end's, once a step), so that a step's threads are not
# put to sleep and woken again while its barriers wait for them (docs/cpu.md, "OpenMP waiting").
SPIN_SECONDS = 2e-3
# Turns of a spin where the length of a turn on this processor is not known yet.
UNCALIBRATED_SPIN_COUNT = 20000
_openmp_set_here: list[str] = []


def openmp_defaults() -> dict[str, str]:
    """The OpenMP settings pagedserve's processes run with where the user has not set them."""
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(spin_count())}


def spin_count() -> int:
    """Turns of a spin of SPIN_SECONDS on this processor, or UNCALIBRATED_SPIN_COUNT before a turn was measured here."""
    seconds = cached_json.read(_pause_file())
    if not isinstance(seconds, float) or seconds <= 0:
        return UNCALIBRATED_SPIN_COUNT
    return max(1, round(SPIN_SECONDS / seconds))


def calibrate_spin(measure_pause_seconds: Callable[[], float]) -> None:
    """Measure and keep the length of a spin's turn on this processor (the kernels' spin_pause_seconds), once: later
    starts read it before torch loads. A measurement of 0 (no x86 pause) keeps the uncalibrated count."""
    path = _pause_file()
    if cached_json.read(path) is not None:
        return
    seconds = measure_pause_seconds()
    if seconds > 0:
        cached_json.write(path, seconds)


def spin_setting() -> str:
    """What this process's waiting threads do, for the start-up log."""
    policy, count = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    return f"OMP_WAIT_POLICY={policy or 'unset'} GOMP_SPINCOUNT={count or 'unset'}"


def _pause_file() -> Path:
    return cached_json.cache_file("openmp", "spin_pause_seconds", cpu_features().identity)


def set_openmp_defaults() -> None:
    """Put openmp_defaults() into the environment where the user has not set them (see the module doc).
    Processes started from here inherit them even where this one loaded torch too early to use them."""
    if _openmp_set_here:
        return
    if "torch" in sys.modules:
        logger.debug("torch was imported before pagedserve: this process's OpenMP runtime keeps its own wait policy")
    for name, value in openmp_defaults().items():
        if name not in os.environ:
            os.environ[name] = value
            _openmp_set_here.append(name)


def environment_without_openmp_defaults() -> dict[str, str]:
    """The environment as the user had it, for baselines that must run as their users run them."""
    return {name: value for name, value in os.environ.items() if name not in _openmp_set_here}
