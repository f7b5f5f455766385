"""The C++ CPU kernels (pagedserve/csrc), compiled once per checkout and source version, and cached.

If the compiler or ninja is missing the build fails once, a warning says why, and every layer falls
back to its plain-torch reference path. PAGEDSERVE_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "quantized_linear.cpp", "bindings.cpp")


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def for_tensor(tensor: torch.Tensor):
    """The kernels, when they apply to this tensor (float32 on CPU) and are available; else None."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        return None
    return load()


def for_kv_cache(kv_cache: torch.Tensor):
    """The kernels, when they apply to this KV cache (float32, bfloat16 or float16 on CPU) and are available; else None."""
    if kv_cache.device.type != "cpu" or kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return load()


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None when unavailable or disabled."""
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        from pagedserve.models.gguf_convert import cache_root

        # One build per checkout and source version: ninja would rebuild a shared one whenever
        # another checkout (a CI clone, say) used it in between.
        digest = hashlib.sha256(str(_CSRC).encode())
        for name in (*_SOURCES, "ops.h"):
            digest.update((_CSRC / name).read_bytes())
        build_dir = cache_root() / "extensions" / f"cpu_kernels-{digest.hexdigest()[:16]}"
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(
            name="pagedserve_cpu_kernels",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *_vector_flags()],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, ...: the reference paths still work
        logger.warning("CPU kernels unavailable (%s); using the torch reference paths", exc)
        return None


def _vector_flags() -> list[str]:
    # ATen's Vectorized<float> uses AVX2 intrinsics only when told the CPU has them.
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []
