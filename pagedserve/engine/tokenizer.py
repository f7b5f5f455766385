"""Load the HF tokenizer of a model directory, and the grammar compiler over its vocabulary.

transformers' AutoTokenizer decides a tokenizer's class from the model's config, and importing its config classes takes
seconds (they pull in its model-loading stack, torch included), while the class it decides on loads in a fraction of
that. So the class it chose is remembered per tokenizer directory (its files as they are) and transformers version, and
later loads call that class as AutoTokenizer does: the same tokenizer, without the config's imports.
"""

from __future__ import annotations

import functools
import importlib
from importlib import metadata
from pathlib import Path

from pagedserve import cached_json
from pagedserve.structured_output.grammar_compiler import GrammarCompiler

# Bumped when what is stored changes shape.
_FORMAT = "1"


def load_tokenizer(model_dir: str | Path):
    choice_file = _choice_file(Path(model_dir))
    tokenizer_class = _remembered_class(cached_json.read(choice_file)) if choice_file is not None else None
    if tokenizer_class is not None:
        tokenizer = tokenizer_class.from_pretrained(str(model_dir))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        chosen = type(tokenizer)
        if choice_file is not None and chosen.__module__.startswith("transformers."):  # never a model's own code
            cached_json.write(choice_file, {"module": chosen.__module__, "name": chosen.__name__})
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{model_dir}: a fast (tokenizer.json) tokenizer is required")
    return tokenizer


def _choice_file(directory: Path) -> Path | None:
    """Where AutoTokenizer's choice for this directory is kept: keyed by its files' names, sizes and modification times
    (its config, tokenizer config and tokenizer files decide the class); None for what is not a local directory."""
    if not directory.is_dir():
        return None
    stats = sorted((entry.name, entry.stat()) for entry in directory.iterdir() if entry.is_file())
    files = [f"{name}:{stat.st_size}:{stat.st_mtime_ns}" for name, stat in stats]
    return cached_json.cache_file("tokenizer_classes", str(directory.resolve()), *files, metadata.version("transformers"),
                                  _FORMAT)


def _remembered_class(choice: dict | None):
    if not isinstance(choice, dict):
        return None
    try:
        return getattr(importlib.import_module(choice["module"]), choice["name"])
    except (KeyError, TypeError, ImportError, AttributeError):
        return None


@functools.cache
def grammar_compiler(tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's one grammar compiler over a model's vocabulary (vocab_size: its logits' width): the front end and
    an engine core in the same process share it, and so its cache of compiled grammars. It loads the tokenizer at its
    first compile."""
    return GrammarCompiler(functools.partial(load_tokenizer, tokenizer_dir), vocab_size, list(stop_token_ids))


def preload_tokenizer_library() -> None:
    """Import transformers' fast tokenizers (most of what loading a tokenizer costs: the class most tokenizers are, or
    derive from) ahead of need, e.g. while the engine starts."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401
