"""A model directory as a checkpoint transformers (and other engines) load whole: a converted GGUF model's float
tensors and its GGUF blocks dequantized (the values the file holds), in safetensors shards with their index, beside its
config, tokenizer and generation config."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from pagedserve.models.safetensors_shards import ShardWriter

logger = logging.getLogger(__name__)

# Where a converted GGUF model keeps its whole checkpoint once written (transformers_checkpoint), and the file that says
# it is complete.
_CACHED_EXPORT = "transformers"
_DONE_MARKER = ".export-complete"
_INDEX = "model.safetensors.index.json"


def transformers_checkpoint(model_dir: Path) -> Path:
    """A directory transformers loads whole with model_dir's weights: model_dir itself, or for a converted GGUF model
    (which keeps most tensors only as GGUF blocks) its export, written into it once."""
    from pagedserve.models.gguf_blocks import QUANTIZED_FILE

    if not (model_dir / QUANTIZED_FILE).is_file():
        return model_dir
    target = model_dir / _CACHED_EXPORT
    if not (target / _DONE_MARKER).exists():
        shutil.rmtree(target, ignore_errors=True)
        export_checkpoint(model_dir, target)
        (target / _DONE_MARKER).touch()
    return target


def export_checkpoint(model_dir: Path, out_dir: Path) -> Path:
    """Write model_dir's checkpoint whole into out_dir (made if absent), a shard at a time; returns out_dir."""
    from pagedserve.models.gguf_blocks import load_quantized_blocks
    from pagedserve.models.loader import checkpoint_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    # Named by number until the count is known, then as transformers names shards.
    shards = ShardWriter(out_dir, lambda number: f"shard-{number:05d}.partial")
    for name, tensor in checkpoint_tensors(model_dir, load_quantized_blocks(model_dir)):
        shards.add(name, tensor)
    files = shards.close()
    final = {file: f"model-{number:05d}-of-{len(files):05d}.safetensors" for number, file in enumerate(files, start=1)}
    for file, name in final.items():
        (out_dir / file).rename(out_dir / name)
    for file in model_dir.iterdir():  # config, tokenizer, generation config (not the checkpoint's own index)
        if file.is_file() and file.suffix != ".safetensors" and file.name != _INDEX and not file.name.startswith("."):
            shutil.copy(file, out_dir / file.name)
    index = {"metadata": {}, "weight_map": {name: final[file] for name, file in shards.file_of.items()}}
    (out_dir / _INDEX).write_text(json.dumps(index, indent=1))
    logger.info("wrote %d tensors in %d shards into %s", len(shards.file_of), len(files), out_dir)
    return out_dir
