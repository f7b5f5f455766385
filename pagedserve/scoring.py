"""Scores of text pairs from an embedding model, as vLLM scores with one (a bi-encoder): the cosine similarity of the two
texts' embeddings. And which pairs a request means: its one first text against each second text, or the two lists
pair by pair."""

from __future__ import annotations

import numpy as np

from pagedserve.outputs import EmbeddingOutput


def score_pairs(num_first: int, num_second: int, first: str = "text_1", second: str = "text_2") -> list[tuple[int, int]]:
    """The (first, second) index pairs scored; ValueError naming the fields when their lengths pair no way."""
    if num_first == 1:
        return [(0, index) for index in range(num_second)]
    if num_first == num_second:
        return [(index, index) for index in range(num_first)]
    raise ValueError(f"{first} must hold one text, or as many as {second} ({num_second}), got {num_first}")


def cosine_similarity(first: EmbeddingOutput, second: EmbeddingOutput) -> float:
    a, b = (np.frombuffer(output.data, dtype=np.float32).astype(np.float64) for output in (first, second))
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0
