"""Which GEMMs of a step run on their GGUF blocks and which on the dense weight, measured on the machine at hand.

The blocks are a fraction of the bytes, so steps of few rows, bound by reading the weights, run faster on them;
more rows make a GEMM bound by arithmetic, where oneDNN's kernels (and bfloat16 matrix instructions where the
processor has them) pull ahead. Where that happens depends on the processor: on some the blocks keep up to 64
rows, on others they fall behind from 3. So each weight shape is timed both ways at growing row counts, every
GEMM of the model in the order a forward pass runs them (the whole model's weights do not fit in the caches, as
in a real step; of a large model, its first layers: MEASURED_BYTES), and keeps its blocks up to the last count at
which the dense weight was not clearly faster. A layer on blocks alone has no dense copy: its dense product
dequantizes the blocks for the step, and that is what is timed. The result is kept for the next start on the same
machine, software and model.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from pagedserve import cached_json
from pagedserve.layers import cpu_kernels
from pagedserve.layers.linear import EVERY_STEP, BlocksOrDense
from pagedserve.version import __version__

# Row counts measured, in order: a decode step's batch sizes up to where the blocks stop being an option.
CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Row counts measured next for blocks that round their input, whose integer products can outrun the dense weight's
# float ones at any row count: prefill steps. Blocks still ahead at the last take every larger step too (EVERY_STEP):
# there both paths are bound by arithmetic, whose rates stop changing with the rows.
PREFILL_ROWS = (128, 256, 512)
# Passes over the model per path and row count; the fastest counts, as the others carry the machine's slow moments.
# A prefill-sized GEMM runs long enough for fewer.
PASSES = 5
PREFILL_PASSES = 2
# How much faster the dense weight must be to take a row count from the blocks: more than the timings of one shape
# move between starts where the two are close (a few-row GEMM on both reads at a similar pace), so a noisy moment does
# not give away the blocks' smaller reads, which other work running beside a step is spared too.
DENSE_MARGIN = 1.25
# Bytes of blocks a measurement runs the GEMMs of: the model's first GEMMs in forward order up to this much, and the first
# of any shape not among them (the lm_head's). More than a processor's caches hold, so the weights come from memory as
# in a real step, and every layer's shapes are in (a model's layers repeat them); a larger model is not measured whole,
# which takes minutes per billion weights.
MEASURED_BYTES = 256 * 1024**2


def choose(model, dense_dtype: torch.dtype) -> dict[str, int]:
    """Set each GEMM's blocks to take steps of up to the measured row count (stored, or measured now); returns
    shape name -> that count."""
    gemms = model.blocks_and_dense_gemms()
    if not gemms:
        return {}
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
    """Per shape, the largest candidate row count up to which its dense weight was never clearly faster than its
    blocks (0: the dense weight always; EVERY_STEP: the blocks at every count, prefill-sized ones included)."""
    gemms = measured_gemms(gemms)
    max_rows = dict.fromkeys((gemm.shape for gemm in gemms), 0)
    still_winning = set(max_rows)
    for rows in CANDIDATE_ROWS:
        _keep_winners(gemms, rows, PASSES, still_winning, max_rows, clock)
    rounding = [gemm for gemm in gemms if gemm.blocks.rounds_activations]
    for rows in PREFILL_ROWS:
        _keep_winners([gemm for gemm in rounding if gemm.shape in still_winning], rows, PREFILL_PASSES, still_winning, max_rows, clock)
    for name in still_winning & {gemm.shape for gemm in rounding}:
        max_rows[name] = EVERY_STEP
    return max_rows


def measured_gemms(gemms: Sequence[BlocksOrDense]) -> list[BlocksOrDense]:
    """The GEMMs a measurement runs, in forward order: the first ones up to MEASURED_BYTES of blocks, and the first of
    each shape beyond them."""
    measured, shapes, stored = [], set(), 0
    for gemm in gemms:
        if stored < MEASURED_BYTES or gemm.shape not in shapes:
            measured.append(gemm)
            shapes.add(gemm.shape)
            stored += gemm.blocks.stored_bytes
    return measured


def _keep_winners(gemms: Sequence[BlocksOrDense], rows: int, passes: int, still_winning: set[str], max_rows: dict[str, int],
                  clock) -> None:
    """Times gemms at `rows` rows; a shape whose dense weight was clearly faster leaves still_winning, the others'
    max_rows become `rows`."""
    if not still_winning or not gemms:
        return
    inputs = {gemm.shape: torch.randn(rows, gemm.in_features) for gemm in gemms}
    on_blocks, on_dense = _fastest_passes(gemms, inputs, passes, clock)
    for name in still_winning & set(inputs):
        if on_dense[name] * DENSE_MARGIN < on_blocks[name]:
            still_winning.discard(name)
        else:
            max_rows[name] = rows


def _fastest_passes(gemms: Sequence[BlocksOrDense], inputs: dict[str, torch.Tensor], passes: int,
                    clock) -> tuple[dict[str, float], dict[str, float]]:
    """Per shape, the least time over `passes` passes of running each GEMM of the model once, in order, on its blocks
    and on its dense weight. The two kinds of pass alternate, so a moment when the machine is busy (another process
    starting beside this one) slows both alike."""
    fastest_blocks, fastest_dense = dict.fromkeys(inputs, math.inf), dict.fromkeys(inputs, math.inf)
    for _ in range(passes):
        for fastest, run in ((fastest_blocks, lambda gemm, x: gemm.blocks.linear(x)), (fastest_dense, lambda gemm, x: gemm.dense(x))):
            spent = dict.fromkeys(inputs, 0.0)
            for gemm in gemms:
                start = clock()
                run(gemm, inputs[gemm.shape])
                spent[gemm.shape] += clock() - start
            for name, seconds in spent.items():
                fastest[name] = min(fastest[name], seconds)
    return fastest_blocks, fastest_dense


def _key(gemms: Sequence[BlocksOrDense], dense_dtype: torch.dtype) -> list[str]:
    """Everything the measurement depends on: the kernels' build (which covers the processor, Python and torch), the
    threads, pagedserve's version, the dense dtype, the shapes, block types and whether the blocks round their input."""
    shapes = sorted({f"{gemm.shape}:{gemm.blocks.qtype}{':q8' if gemm.blocks.rounds_activations else ''}" for gemm in gemms})
    return [cpu_kernels.build_key(), str(len(os.sched_getaffinity(0))), str(torch.get_num_threads()), __version__,
            str(dense_dtype), *shapes]
