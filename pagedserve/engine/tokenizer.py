"""Load the HF tokenizer of a model directory, and the grammar compiler over its vocabulary."""

from __future__ import annotations

import functools
from pathlib import Path

from pagedserve.structured_output.grammar_compiler import GrammarCompiler


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{model_dir}: a fast (tokenizer.json) tokenizer is required")
    return tokenizer


@functools.cache
def grammar_compiler(tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's one grammar compiler over a model's vocabulary (vocab_size: its logits' width): the front end and
    an engine core in the same process share it, and so its cache of compiled grammars. It loads the tokenizer at its
    first compile."""
    return GrammarCompiler(functools.partial(load_tokenizer, tokenizer_dir), vocab_size, list(stop_token_ids))


def preload_tokenizer_library() -> None:
    """Import transformers' tokenizer machinery (seconds) ahead of need, e.g. while the engine starts."""
    from transformers import AutoTokenizer  # noqa: F401
