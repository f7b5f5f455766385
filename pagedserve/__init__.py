"""pagedserve: an LLM inference and serving engine with a paged KV cache."""

import os

# Before torch loads its OpenMP runtime (libgomp): threads that spin without end collapse when the
# cores are shared with other processes (PASSIVE: they sleep between parallel regions), but waking a
# sleeping thread costs tens of microseconds and a decode step opens hundreds of parallel regions, so
# they first spin briefly (libgomp's GOMP_SPINCOUNT; PASSIVE alone means 0). Batch-16 decode step
# 105-127 -> 77-83 ms; serve at rate inf 139 -> 185 output tokens/s (200000 spins: 62 ms, 171 tokens/s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from pagedserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; the HTTP front end imports this package and needs no torch.
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
