"""Which GEMMs of a step run on their GGUF blocks and which on the dense weight, measured on the machine at hand.

The blocks are a fraction of the bytes, so steps of few rows, bound by reading the weights, run faster on them;
more rows make a GEMM bound by arithmetic, where oneDNN's kernels (and bfloat16 matrix instructions where the
processor has them) pull ahead. Where that happens depends on the processor: on some the blocks keep up to 64
rows, on others they fall behind from 3. So each weight shape is timed both ways at growing row counts, every
GEMM of the model in the order a forward pass runs them (the whole model's weights do not fit in the caches, as
in a real step), and keeps its blocks up to the last count they were not slower at. The result is kept for the
next start on the same machine, software and model.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from pagedserve import cached_json
from pagedserve.cpu_features import cpu_features
from pagedserve.layers import cpu_kernels
from pagedserve.layers.linear import BlocksOrDense
from pagedserve.version import __version__

# Row counts measured, in order: a decode step's batch sizes up to where the blocks stop being an option.
CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Passes over the model per path and row count; the fastest counts, as the others carry the machine's slow moments.
PASSES = 3

def choose(model, dense_dtype: torch.dtype) -> dict[str, int]:
    """Set each GEMM's blocks to take steps of up to the measured row count (stored, or measured now); returns
    shape name -> that count."""
    gemms = model.blocks_and_dense_gemms()
    path = cached_json.cache_file("gemm_choice", *_key(gemms, dense_dtype))
    rows = cached_json.read(path)
    if not isinstance(rows, dict) or set(rows) != {gemm.shape for gemm in gemms}:
        with torch.inference_mode():
            rows = measure(gemms)
        cached_json.write(path, rows)
    for gemm in gemms:
        gemm.blocks.max_rows = rows[gemm.shape]
    return rows


def measure(gemms: Sequence[BlocksOrDense], clock: Callable[[], float] = time.perf_counter) -> dict[str, int]:
    """Per shape, the largest candidate row count up to which its blocks were never slower than its dense weight
    (0: the dense weight always)."""
    max_rows = dict.fromkeys((gemm.shape for gemm in gemms), 0)
    still_winning = set(max_rows)
    for rows in CANDIDATE_ROWS:
        inputs = {gemm.shape: torch.randn(rows, gemm.in_features) for gemm in gemms}
        on_blocks = _fastest_pass(gemms, inputs, lambda gemm, x: gemm.blocks.linear(x), clock)
        on_dense = _fastest_pass(gemms, inputs, lambda gemm, x: gemm.dense(x), clock)
        for name in list(still_winning):
            if on_blocks[name] <= on_dense[name]:
                max_rows[name] = rows
            else:
                still_winning.discard(name)
        if not still_winning:
            break
    return max_rows


def _fastest_pass(gemms: Sequence[BlocksOrDense], inputs: dict[str, torch.Tensor], run, clock) -> dict[str, float]:
    """Per shape, the least time over PASSES passes of running each GEMM of the model once, in order."""
    fastest = dict.fromkeys(inputs, math.inf)
    for _ in range(PASSES):
        spent = dict.fromkeys(inputs, 0.0)
        for gemm in gemms:
            start = clock()
            run(gemm, inputs[gemm.shape])
            spent[gemm.shape] += clock() - start
        for name, seconds in spent.items():
            fastest[name] = min(fastest[name], seconds)
    return fastest


def _key(gemms: Sequence[BlocksOrDense], dense_dtype: torch.dtype) -> list[str]:
    """Everything the measurement depends on: the machine and threads, the software, the shapes and block types."""
    shapes = sorted({f"{gemm.shape}:{gemm.blocks.qtype}" for gemm in gemms})
    return [cpu_features().identity, str(len(os.sched_getaffinity(0))), str(torch.get_num_threads()), torch.__version__,
            __version__, cpu_kernels.build_key(), str(dense_dtype), *shapes]
