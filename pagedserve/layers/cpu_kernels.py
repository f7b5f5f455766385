"""The C++ CPU kernels (pagedserve/csrc), compiled once per machine and cached.

If the compiler or ninja is missing the build fails once, a warning says why, and attention
falls back to the plain-torch reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.cpp"


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None when unavailable or disabled (PAGEDSERVE_ATTENTION_BACKEND=torch)."""
    if os.environ.get("PAGEDSERVE_ATTENTION_BACKEND", "auto") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        from pagedserve.models.gguf_convert import cache_root

        # One build per checkout and source version: ninja would rebuild a shared one whenever
        # another checkout (a CI clone, say) used it in between.
        key = hashlib.sha256(str(_SOURCE).encode() + _SOURCE.read_bytes()).hexdigest()[:16]
        build_dir = cache_root() / "extensions" / f"paged_attention-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(
            name="pagedserve_paged_attention",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, ...: the reference backend still works
        logger.warning("CPU attention kernel unavailable (%s); using the torch reference backend", exc)
        return None
