"""pagedserve: an LLM inference and serving engine with a paged KV cache."""

import os

# Before torch loads its OpenMP runtime (libgomp): threads that spin without end collapse when the
# cores are shared with other processes (PASSIVE: they sleep between parallel regions), but waking a
# sleeping thread costs tens of microseconds and a decode step opens hundreds of parallel regions, so
# they first spin briefly (libgomp's GOMP_SPINCOUNT; PASSIVE alone means 0). Batch-16 decode step
# 105-127 -> 77-83 ms; serve at rate inf 139 -> 185 output tokens/s (200000 spins: 62 ms, 171 tokens/s).
_OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
_SET_HERE = [name for name in _OMP_DEFAULTS if name not in os.environ]
os.environ.update({name: _OMP_DEFAULTS[name] for name in _SET_HERE})


def user_environment() -> dict[str, str]:
    """The environment without the OpenMP defaults set above (for baselines run as their users would)."""
    return {name: value for name, value in os.environ.items() if name not in _SET_HERE}


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
