"""Shortened embeddings. A matryoshka model (config.json's is_matryoshka, or its matryoshka_dimensions; hf_overrides can
say it) was trained so that an embedding's first values are an embedding too: a request may ask for those
(dimensions), normalized again where the pooler normalizes."""

from __future__ import annotations

import numpy as np

from pagedserve.outputs import EmbeddingOutput


def matryoshka_dimensions(hf_config) -> list[int] | None:
    """The sizes a model's embeddings may be shortened to: its matryoshka_dimensions, every size up to its hidden size
    where it is a matryoshka model without a list, else None."""
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if listed:
        return sorted(int(size) for size in listed)
    if getattr(hf_config, "is_matryoshka", False):
        return list(range(1, hf_config.hidden_size + 1))
    return None


def check_dimensions(dimensions: int, allowed: list[int] | None) -> None:
    """ValueError naming dimensions where the model is not a matryoshka model or does not offer that size."""
    if allowed is None:
        raise ValueError("dimensions needs a matryoshka model (config.json's is_matryoshka or matryoshka_dimensions; "
                         "hf_overrides can set them): this model's embeddings are not to be shortened")
    if dimensions not in allowed:
        offered = f"one of {allowed}" if len(allowed) < 32 else f"in [1, {allowed[-1]}]"
        raise ValueError(f"dimensions must be {offered}, got {dimensions}")


def shortened(output: EmbeddingOutput, dimensions: int, normalize: bool) -> EmbeddingOutput:
    """An embedding's first `dimensions` values, normalized again where the pooler normalizes."""
    values = np.frombuffer(output.data, dtype=np.float32)[:dimensions]
    if normalize:
        values = values / max(float(np.linalg.norm(values.astype(np.float64))), 1e-12)
    return EmbeddingOutput(values.astype(np.float32).tobytes())
