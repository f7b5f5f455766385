"""Where a model's HF-format files are: the default model's name, a .gguf file (converted once) or a directory.
Imports nothing heavy: the engine process finds its model, and tells its front end, before loading torch."""

from __future__ import annotations

from pathlib import Path

from pagedserve.config import DEFAULT_MODEL
from pagedserve.models import gguf_convert


def resolve_model_dir(model: str) -> Path:
    """An HF-format directory for `model`: the default model's name, a .gguf file, or a directory."""
    if model == DEFAULT_MODEL:
        return gguf_convert.ensure_converted(gguf_convert.default_gguf_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return gguf_convert.ensure_converted(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {model!r} is neither a directory, a .gguf file, nor {DEFAULT_MODEL!r}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


if __name__ == "__main__":  # set-up converts the default model ahead of the first start
    from pagedserve import log

    log.configure()
    resolve_model_dir(DEFAULT_MODEL)
