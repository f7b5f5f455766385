"""Load the HF tokenizer of a model directory."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{model_dir}: a fast (tokenizer.json) tokenizer is required")
    return tokenizer


def preload_tokenizer_library() -> None:
    """Import transformers' tokenizer machinery (seconds) ahead of need, e.g. while the engine starts."""
    from transformers import AutoTokenizer  # noqa: F401
