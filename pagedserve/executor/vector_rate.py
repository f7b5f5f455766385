"""How fast this host's vector units multiply bytes: the compiled kernels' probe (csrc/int8_peak.cpp) timed on every
thread. `bench machine` and the ceiling take it as the limit of the GGUF blocks' integer products."""

from __future__ import annotations

import time

import torch

from pagedserve.layers import cpu_kernels

# The probe is timed in runs at least this long (its turns doubled until one is).
_RUN_S = 0.05


def int8_vector_gop_s(repeats: int) -> float | None:
    """G byte multiply-adds x 2 a second that the vector units' widest unsigned-by-signed byte multiply-add reaches on
    every thread, in registers, best of repeats; None without the kernels or such an instruction."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    threads, turns = torch.get_num_threads(), 1 << 16
    while True:
        start = time.perf_counter()
        products = kernels.int8_vector_products(turns, threads)
        took = time.perf_counter() - start
        if products == 0:
            return None
        if took >= _RUN_S:
            break
        turns *= 2
    best = took
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.int8_vector_products(turns, threads)
        best = min(best, time.perf_counter() - start)
    return 2 * products / best / 1e9
