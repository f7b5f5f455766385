"""GGUF weights kept in their quantized blocks, under the HF names of the converted checkpoint.

The CPU kernels run a GGUF model's GEMMs straight on its quantized blocks (the same values, 4-7x fewer bytes to read
per step than float32): Q4_0/Q4_1/Q8_0 in every mode, Q5_0/Q5_1 and the K-quants where products are integers
(layers/linear.py). In which row order a GGUF tensor's rows are in the converted tensor (llama.cpp's converter permutes
q/k rows for its rotary layout) is not re-derived from naming rules: its dequantized rows are matched to the rows of
the float32 tensor the conversion made of it, and its blocks kept only when every row matches exactly. Where they
hold every value of that tensor, the conversion keeps no float copy of it (but of the embedding, whose rows are looked
up), and the loader dequantizes them for a layer that does not run on them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.layers.linear import GGUF_BLOCK_TYPES

logger = logging.getLogger(__name__)

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# A mixture's stacked experts in the converted checkpoint (transformers' layout) -> the parts whose blocks fill it, in
# their order along its dimension 1: gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I].
_STACKED_PARTS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}

# In a subdirectory: the checkpoint loader reads every *.safetensors file of the model directory.
QUANTIZED_FILE = Path("gguf_blocks") / "blocks.safetensors"


class Converted(NamedTuple):
    """A tensor of a converted GGUF checkpoint: its transformers name, its float32 values, and the GGUF tensors (of a
    gguf.GGUFReader) they were read from (a mixture's stacked gate_up_proj: its gate's and its up's)."""

    name: str
    values: torch.Tensor
    sources: tuple = ()


class KeptBlocks:
    """The GGUF blocks a conversion keeps, gathered a converted tensor at a time (keep), written at the end (write)."""

    def __init__(self) -> None:
        self.blocks: dict[str, np.ndarray] = {}
        self.types: dict[str, str] = {}

    def keep(self, tensor: Converted) -> bool:
        """Keep the blocks of tensor's sources that the kernels read and that hold its values exactly, in its row order;
        returns whether they hold every value of it (then it needs no float copy)."""
        kept = _matching_blocks(tensor)
        for name, (blocks, type_name) in kept.items():
            self.blocks[name], self.types[name] = blocks, type_name
        return tensor.name in tensors_held_by_blocks(set(kept))

    def write(self, out_dir: Path) -> set[str]:
        """Write the blocks kept to out_dir/QUANTIZED_FILE (nothing where none were); returns their names."""
        from safetensors.numpy import save_file

        if self.blocks:
            (out_dir / QUANTIZED_FILE).parent.mkdir(exist_ok=True)
            save_file(self.blocks, str(out_dir / QUANTIZED_FILE), metadata=self.types)
        return set(self.blocks)


def _matching_blocks(tensor: Converted) -> dict[str, tuple[np.ndarray, str]]:
    """Block name -> (blocks in the converted tensor's row order, type name), for each source of tensor whose blocks the
    kernels read and hold its values exactly: a 2-D tensor's rows in any order (llama.cpp's converter permutes q's
    and k's for its rotary layout), a mixture's stacked experts part by part under model.layers.N.mlp.experts.{gate,
    up,down} (transformers' gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kernel_read = {GGMLQuantizationType[name] for name in GGUF_BLOCK_TYPES}
    sources = [source for source in tensor.sources if source.tensor_type in kernel_read]
    stacked = _STACKED_EXPERTS.match(tensor.name)
    kept = {}
    for source in sources:
        values = dequantize(source.data, source.tensor_type)
        if stacked is not None:
            part = _EXPERT_TENSOR.match(source.name)
            if part is None or len(source.data.shape) != 3:
                continue
            expected = _stacked_part(tensor.values, stacked.group(2), part.group(2))
            if expected is not None and values.shape == tuple(expected.shape) and np.array_equal(values, expected.numpy()):
                kept[f"{stacked.group(1)}.{part.group(2)}"] = (np.ascontiguousarray(source.data), source.tensor_type.name)
            continue
        order = _row_order(values, tensor.values.numpy()) if len(source.data.shape) == 2 else None
        if order is None:
            logger.info("GGUF tensor %s: not exactly %s in any row order; it runs dequantized", source.name, tensor.name)
            continue
        ordered = source.data  # as the file holds it (mapped, not copied) where the order is the same
        if not np.array_equal(order, np.arange(len(order))):
            ordered = np.empty_like(source.data)
            ordered[order] = source.data
        kept[tensor.name] = (ordered, source.tensor_type.name)
    return kept


def _stacked_part(stacked: torch.Tensor, stacked_name: str, part: str) -> torch.Tensor | None:
    """The gate's, up's or down's values in a stacked experts tensor; None where that tensor does not hold the part."""
    parts = _STACKED_PARTS[stacked_name]
    if part not in parts:
        return None
    return stacked.chunk(len(parts), dim=1)[parts.index(part)]


def _row_order(values: np.ndarray, converted: np.ndarray) -> np.ndarray | None:
    """The converted tensor's row of each row of values (a GGUF tensor dequantized), where values are exactly the
    converted tensor's rows in some order; else None."""
    if values.shape != converted.shape:
        return None
    if np.array_equal(values, converted):  # most tensors keep their row order (and may repeat rows: embeddings)
        return np.arange(len(values))
    row_of = {hash(row.tobytes()): index for index, row in enumerate(converted)}
    order = [row_of.get(hash(row.tobytes())) for row in values]
    if any(row is None for row in order) or len(set(order)) != len(order):
        return None
    order = np.array(order)
    return order if np.array_equal(converted[order], values) else None


def load_quantized_blocks(model_dir: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """HF name -> (uint8 blocks [rows, bytes per row], gguf type id); empty when the model has none."""
    from safetensors import safe_open

    path = model_dir / QUANTIZED_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as handle:
        types = handle.metadata() or {}
        return {name: (handle.get_tensor(name), GGUF_BLOCK_TYPES[types[name]]) for name in handle.keys()}


def dense_counterpart(name: str) -> str:
    """The converted checkpoint's float tensor that holds a block tensor's values: a mixture's experts' gate and up are
    stacked in one gate_up_proj."""
    module, _, part = name.rpartition(".")
    if module.endswith(".mlp.experts"):
        for stacked, parts in _STACKED_PARTS.items():
            if part in parts:
                return f"{module}.{stacked}"
    return name


def blocks_filling(name: str) -> list[str]:
    """The block tensors whose values fill the converted checkpoint's float tensor `name`, in their order in it."""
    stacked = _STACKED_EXPERTS.match(name)
    if stacked is None:
        return [name]
    return [f"{stacked.group(1)}.{part}" for part in _STACKED_PARTS[stacked.group(2)]]


def tensors_held_by_blocks(block_names: set[str]) -> set[str]:
    """The converted checkpoint's float tensors whose every value the named blocks hold."""
    return {name for name in map(dense_counterpart, block_names) if set(blocks_filling(name)) <= block_names}


def dequantized_tensors(blocks: dict[str, tuple[torch.Tensor, int]], names: set[str], kernels=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The float32 checkpoint tensors of the named blocks (a mixture's experts' gate and up stacked into gate_up_proj),
    for the layers that do not run on them: the values gguf dequantizes, by the C++ kernels where given."""
    for counterpart in sorted({dense_counterpart(name) for name in names}):
        parts = blocks_filling(counterpart)
        if not set(parts) <= names:
            raise ValueError(f"GGUF blocks fill {counterpart} only in part: {', '.join(sorted(set(parts) - names))} missing")
        values = [dequantize_blocks(*blocks[part], kernels) for part in parts]
        yield counterpart, values[0] if len(values) == 1 else torch.cat(values, dim=1)


def dequantize_blocks(blocks: torch.Tensor, qtype: int, kernels=None) -> torch.Tensor:
    """float32 values of GGUF blocks [..., rows, bytes per row] -> [..., rows, values per row]."""
    rows = blocks.reshape(-1, blocks.shape[-1]).contiguous()
    if kernels is not None:
        values = kernels.dequantize_gguf(rows, qtype)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType(qtype)))
    return values.reshape(*blocks.shape[:-1], values.shape[-1])
