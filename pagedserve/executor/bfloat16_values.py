"""Whether float32 GEMMs whose weights hold bfloat16 values (a checkpoint stored in bfloat16) read them as bfloat16, on
the C++ kernels (layers/gemm.BFloat16ValuesWeight), rather than as a float32 copy packed for oneDNN.

The products are the same either way; the kernels read half the bytes, which is what steps of few rows wait on, but
widen every value they read, which steps of many rows, bound by arithmetic, pay for. So where the kernels widen on
vectors, their rate on a product of many rows is measured against oneDNN's float32 one on the first start on a machine,
and kept in the cache directory for later starts; they are used where they keep pace.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from pagedserve import cached_json
from pagedserve.executor.matmul_rate import matmul_rate_at, product_rate
from pagedserve.layers import cpu_kernels
from pagedserve.version import __version__

logger = logging.getLogger(__name__)

# A product of this size is bound by arithmetic and fills every thread with work while taking milliseconds.
_SIZE, _REPEATS = 1024, 3
# The share of float32 GEMMs' rate the kernels must keep on many rows: below it, the prompts' steps would lose more
# than the decode steps' halved reads gain.
_MIN_SHARE = 0.7


def values_kernels(kernels):
    """kernels where float32 GEMMs on weights of bfloat16 values should run on them here, else None."""
    if kernels is None or not kernels.bf16_weights_vector():
        return None
    return kernels if measured_share(kernels) >= _MIN_SHARE else None


@lru_cache(maxsize=2)
def measured_share(kernels) -> float:
    """The kernels' rate on a product of many rows as a share of float32 GEMMs': from the cache, or measured now and kept
    (keyed by the kernels' build, which covers the processor and torch, the threads and pagedserve's version)."""
    path = cached_json.cache_file("bfloat16_values", cpu_kernels.build_key(), str(torch.get_num_threads()), __version__)
    share = cached_json.read(path)
    if not isinstance(share, float):
        share = _kernel_rate(kernels) / matmul_rate_at(torch.float32, _SIZE, _REPEATS)
        cached_json.write(path, share)
        logger.info("float32 GEMMs reading bfloat16 values measured at %.2fx float32 GEMMs' rate on many rows: weights of "
                    "bfloat16 values are %s", share, "kept as them" if share >= _MIN_SHARE else "widened to float32 copies")
    return share


def _kernel_rate(kernels) -> float:
    """GFLOP/s of the kernels' product of _SIZE rows with a _SIZE x _SIZE weight of bfloat16 values."""
    x, packed = torch.randn(_SIZE, _SIZE), kernels.pack_bf16_pairs(torch.randn(_SIZE, _SIZE))
    return product_rate(lambda: kernels.bf16_weights_linear(x, packed, _SIZE), _SIZE, _REPEATS) or 0.0
