"""A model directory as a checkpoint transformers (and other engines) load whole: a converted GGUF model's float
tensors and its GGUF blocks dequantized (the values the file holds), in safetensors shards with their index, beside its
config, tokenizer and generation config."""

from __future__ import annotations

import json
import logging
import shutil
from itertools import chain
from pathlib import Path

logger = logging.getLogger(__name__)

# Bytes of tensors per shard: what is held in memory at once while writing.
SHARD_BYTES = 2 * 1024**3
# Where a converted GGUF model keeps its whole checkpoint once written (transformers_checkpoint), and the file that says
# it is complete.
_CACHED_EXPORT = "transformers"
_DONE_MARKER = ".export-complete"


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
    """Write model_dir's checkpoint whole into out_dir (made if absent); returns out_dir."""
    from safetensors.torch import save_file

    from pagedserve.models.gguf_blocks import dense_counterpart, dequantized_tensors, load_quantized_blocks
    from pagedserve.models.loader import iterate_safetensors, stored_tensor_names

    out_dir.mkdir(parents=True, exist_ok=True)
    blocks = load_quantized_blocks(model_dir)
    stored = stored_tensor_names(model_dir)
    blocks_alone = {name for name in blocks if dense_counterpart(name) not in stored}
    shards: list[dict] = [{}]
    size = 0
    weight_map = {}
    for name, tensor in chain(iterate_safetensors(model_dir), dequantized_tensors(blocks, blocks_alone)):
        if size and size + tensor.nbytes > SHARD_BYTES:
            _write_shard(shards[-1], len(shards), out_dir, save_file)
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        weight_map[name] = len(shards)
        size += tensor.nbytes
    _write_shard(shards[-1], len(shards), out_dir, save_file)
    total = len(shards)
    index = {"metadata": {}, "weight_map": {name: _shard_name(shard, total) for name, shard in weight_map.items()}}
    for shard in range(1, total + 1):
        (out_dir / _shard_name(shard, None)).rename(out_dir / _shard_name(shard, total))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for file in model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith("."):
            shutil.copy(file, out_dir / file.name)
    logger.info("wrote %d tensors in %d shards into %s", len(weight_map), total, out_dir)
    return out_dir


def _write_shard(tensors: dict, number: int, out_dir: Path, save_file) -> None:
    save_file(tensors, str(out_dir / _shard_name(number, None)), metadata={"format": "pt"})
    tensors.clear()


def _shard_name(number: int, total: int | None) -> str:
    """transformers' shard names; before the total is known, a name of the shard's number alone."""
    return f"model-{number:05d}-of-{total:05d}.safetensors" if total is not None else f"shard-{number:05d}.partial"
