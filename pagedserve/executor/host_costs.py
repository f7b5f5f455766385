"""What a step costs the host before the model runs, timed without a model (for `bench sched`)."""

from __future__ import annotations

import time

import torch

from pagedserve.executor.input_batch import RunnerRequests, prepare_inputs
from pagedserve.executor.sampling_inputs import SamplingInputs
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend
from pagedserve.layers.sampling_rule import DrawKeys


def time_input_preparation(requests: RunnerRequests, num_scheduled_tokens: dict[str, int], block_size: int,
                           repeats: int) -> list[float]:
    """Seconds the model runner takes, each of repeats times, to lay out one step as its flat batch, the CPU
    backend's attention metadata included."""
    backend, device = CPUAttentionBackend(kernels=None), torch.device("cpu")
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        prepare_inputs(requests, num_scheduled_tokens, block_size, backend, device)
        durations.append(time.perf_counter() - start)
    return durations


def time_sampling_metadata(requests: RunnerRequests, request_ids: list[str], repeats: int) -> list[float]:
    """Seconds the model runner takes, each of repeats times, to describe the rows of a step that samples for
    request_ids, the same requests as the step before (as in a run of decode steps)."""
    sampling_inputs = SamplingInputs(torch.device("cpu"), DrawKeys(0))
    states, batch_key = requests.of(request_ids), (requests.version, tuple(request_ids))
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampling_inputs.metadata(states, batch_key=batch_key)
        durations.append(time.perf_counter() - start)
    return durations


def time_sampled_bookkeeping(requests: RunnerRequests, num_scheduled_tokens: dict[str, int], repeats: int) -> list[float]:
    """Seconds the model runner takes, each of repeats times, to record a step of decodes that each sampled a token: the
    tokens appended to its requests, the output's map of them, and the computed counts advanced. The requests keep
    what each round records."""
    request_ids = list(num_scheduled_tokens)
    token_ids = [(7 * index) % 1000 for index in range(len(request_ids))]
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        requests.append_sampled(requests.of(request_ids), token_ids, requests.rows_of(request_ids))
        dict(zip(request_ids, token_ids))
        requests.advance(num_scheduled_tokens)
        durations.append(time.perf_counter() - start)
    return durations
