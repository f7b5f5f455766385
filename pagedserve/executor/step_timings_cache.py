"""The warm-up's step timings, kept for the next start with the same machine, software, model and settings: it seeds
its step-time model from them and runs only the part of the warm-up that spares the first requests one-time costs.
(The model keeps learning from every step either way; the stored timings only replace its first fit.)"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from pagedserve import cached_json, envs
from pagedserve.config import EngineConfig
from pagedserve.cpu_features import cpu_features
from pagedserve.executor.model_runner import WARM_UP_FIRST_SHAPES, WARM_UP_FIT_SHAPES, WARM_UP_TIMED_PASSES
from pagedserve.layers import cpu_kernels
from pagedserve.model_info import ModelInfo
from pagedserve.version import __version__

StepTimings = list[tuple[int, int, int, float]]  # (sequences, new tokens each, context, seconds)


def timings_file(config: EngineConfig, model_info: ModelInfo) -> Path:
    settings = {field.name: repr(getattr(config, field.name)) for field in EngineConfig.settings()}
    return cached_json.cache_file(
        "step_timings", cpu_features().identity, str(len(os.sched_getaffinity(0))), str(envs.cpu_auto_dtype()), torch.__version__,
        __version__,
        cpu_kernels.build_key(), json.dumps(settings, sort_keys=True), json.dumps(dataclasses.asdict(model_info), sort_keys=True),
        repr((WARM_UP_FIRST_SHAPES, WARM_UP_FIT_SHAPES, WARM_UP_TIMED_PASSES)),  # what was timed, and how
    )


def load(path: Path) -> StepTimings | None:
    stored = cached_json.read(path)
    return [tuple(row) for row in stored] if stored else None


def store(path: Path, timings: StepTimings) -> None:
    if timings:
        cached_json.write(path, [list(row) for row in timings])
