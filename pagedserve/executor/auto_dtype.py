"""What `dtype auto` multiplies in on a CPU: bfloat16 where the processor multiplies bfloat16 in hardware and its
bfloat16 GEMMs are about as fast as its float32 ones or faster, else float32; and what its KV cache stores.

The flags alone cannot tell. AMX tiles, and AVX-512 BF16 dot products on some processors, run bfloat16 GEMMs at several
times the float32 rate; on others the dot products issue no faster than float32 FMAs, and the conversions around them
then make a bfloat16 GEMM slower than a float32 one (docs/cpu.md has the measurements). So the two rates are measured
on the first start on a machine, torch and thread count, and kept in the cache directory for later starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from pagedserve import cached_json
from pagedserve.cpu_features import CPUFeatures
from pagedserve.executor.matmul_rate import matmul_rate_at
from pagedserve.version import __version__

logger = logging.getLogger(__name__)

# Products of this size fill every thread with work while taking milliseconds, so the measurement stays short.
_SIZE, _REPEATS = 1024, 3
# bfloat16 is kept at a near-tie: its weights and KV cache are half the bytes, which memory-bound decode steps read.
_BFLOAT16_MIN_SHARE = 0.9


@dataclass(frozen=True)
class GemmRates:
    """GFLOP/s of this machine's float32 and bfloat16 GEMMs (None: torch has no bfloat16 GEMM here)."""
    float32: float
    bfloat16: float | None

    @property
    def bfloat16_pays(self) -> bool:
        return self.bfloat16 is not None and self.bfloat16 >= _BFLOAT16_MIN_SHARE * self.float32


def auto_gemm_dtype(features: CPUFeatures) -> torch.dtype:
    """bfloat16 where the processor multiplies it in hardware and the measurement (gemm_rates) says it pays, else
    float32."""
    if not features.has_bfloat16_matrix:
        return torch.float32
    return torch.bfloat16 if gemm_rates(features).bfloat16_pays else torch.float32


def auto_cache_dtype(features: CPUFeatures) -> torch.dtype:
    """What the KV cache stores under `dtype auto`: bfloat16 where the processor has bfloat16 instructions, even where
    the GEMMs measure faster in float32. The cache is read, not multiplied by matrix units: a decode step reads its
    bytes and widens them, so half the bytes is what counts."""
    return torch.bfloat16 if features.has_bfloat16_matrix else torch.float32


@lru_cache(maxsize=4)
def gemm_rates(features: CPUFeatures) -> GemmRates:
    """The two rates on this machine: from the cache, or measured now and kept (keyed by the processor, torch, the
    threads and pagedserve's version, which fixes how they are measured)."""
    path = cached_json.cache_file("gemm_rates", features.identity, torch.__version__, str(torch.get_num_threads()), __version__)
    stored = cached_json.read(path)
    if isinstance(stored, dict) and isinstance(stored.get("float32"), float):
        rates = GemmRates(stored["float32"], stored.get("bfloat16"))
    else:
        rates = measure_gemm_rates()
        cached_json.write(path, {"float32": rates.float32, "bfloat16": rates.bfloat16})
    logger.info("dtype auto: bfloat16 GEMMs at %s GFLOP/s, float32 at %.0f on this machine, so %s GEMMs",
                "no" if rates.bfloat16 is None else f"{rates.bfloat16:.0f}", rates.float32,
                "bfloat16" if rates.bfloat16_pays else "float32")
    return rates


def measure_gemm_rates() -> GemmRates:
    return GemmRates(matmul_rate_at(torch.float32, _SIZE, _REPEATS), matmul_rate_at(torch.bfloat16, _SIZE, _REPEATS))
