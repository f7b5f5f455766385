"""pagedserve: an LLM inference and serving engine with a paged KV cache."""

# First, before anything can import torch: OpenMP reads its settings once, when torch loads it (see
# pagedserve/openmp.py). That module imports no torch.
from pagedserve.openmp import set_openmp_defaults

set_openmp_defaults()

from pagedserve.lora_request import LoRARequest  # noqa: E402
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedserve.version import __version__  # noqa: E402

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestOutputKind",
           "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput", "ClassificationOutput", "ScoringRequestOutput",
           "ScoringOutput", "__version__"]

_OUTPUTS = ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput",
            "ClassificationOutput", "ScoringRequestOutput", "ScoringOutput")


def __getattr__(name: str):
    # LLM pulls in torch, which the HTTP front end does without; the outputs pull in msgspec, which the set-up's build of
    # the kernels (scripts/setup.sh, while pip installs the rest) runs without: neither loads with the package.
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    if name in _OUTPUTS:
        from pagedserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
