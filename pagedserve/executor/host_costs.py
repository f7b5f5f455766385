"""What a step costs the host before the model runs, timed without a model (for `bench sched`)."""

from __future__ import annotations

import time

import torch

from pagedserve.executor.input_batch import RunnerRequestState, prepare_inputs
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend


def time_input_preparation(states: dict[str, RunnerRequestState], num_scheduled_tokens: dict[str, int], block_size: int,
                           repeats: int) -> list[float]:
    """Seconds the model runner takes, each of repeats times, to lay out one step as its flat batch, the CPU
    backend's attention metadata included."""
    backend, device = CPUAttentionBackend(kernels=None), torch.device("cpu")
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        prepare_inputs(states, num_scheduled_tokens, block_size, backend, device)
        durations.append(time.perf_counter() - start)
    return durations
