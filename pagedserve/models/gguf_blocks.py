"""GGUF weights kept in their quantized blocks, under the HF names of the converted checkpoint.

The CPU kernels run a GGUF model's GEMMs straight on its quantized blocks (the same values, 4-7x fewer bytes to read
per step than float32): Q4_0/Q4_1/Q8_0 in every mode, Q5_0/Q5_1 and the K-quants where products are integers
(layers/linear.py). Which HF tensor a GGUF tensor became, and in
which row order (llama.cpp's converter permutes q/k rows for its rotary layout), is not re-derived
from naming rules: each quantized tensor's dequantized rows are matched to the rows of the float32
tensors that transformers' conversion produced, and kept only when every row matches exactly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedserve.layers.linear import GGUF_BLOCK_TYPES

logger = logging.getLogger(__name__)

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")

# In a subdirectory: the checkpoint loader reads every *.safetensors file of the model directory.
QUANTIZED_FILE = Path("gguf_blocks") / "blocks.safetensors"


def extract_quantized_blocks(reader, hf_tensors: dict[str, torch.Tensor], out_dir: Path) -> set[str]:
    """Write the kernel-readable quantized tensors of the file `reader` (a gguf.GGUFReader) reads to
    out_dir/QUANTIZED_FILE, in the row order of their float32 counterparts in hf_tensors; returns their names."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    block_types = {GGMLQuantizationType[name] for name in GGUF_BLOCK_TYPES}
    blocks, metadata = _expert_blocks([t for t in reader.tensors if t.tensor_type in block_types], hf_tensors)
    candidates = [t for t in reader.tensors if t.tensor_type in block_types and len(t.data.shape) == 2]
    row_owner = _row_index(hf_tensors) if candidates else {}
    for tensor in candidates:
        values = dequantize(tensor.data, tensor.tensor_type)
        match = _match_rows(values, row_owner, hf_tensors)
        if match is None:
            logger.info("GGUF tensor %s: no exact float32 counterpart; it runs dequantized", tensor.name)
            continue
        hf_name, hf_rows = match
        ordered = np.empty_like(tensor.data)
        ordered[hf_rows] = tensor.data
        blocks[hf_name] = ordered
        metadata[hf_name] = tensor.tensor_type.name
    if blocks:
        (out_dir / QUANTIZED_FILE).parent.mkdir(exist_ok=True)
        save_file(blocks, str(out_dir / QUANTIZED_FILE), metadata=metadata)
    return set(blocks)


def _expert_blocks(tensors, hf_tensors: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A mixture's stacked experts (llama.cpp's blk.N.ffn_{gate,up,down}_exps, [E, rows, bytes]) under
    model.layers.N.mlp.experts.{gate,up,down}, each kept only when its values are exactly the converted checkpoint's
    (transformers' stacked gate_up_proj [E, 2I, H], gate rows first, and down_proj [E, H, I])."""
    from gguf.quants import dequantize

    blocks, metadata = {}, {}
    for tensor in tensors:
        match = _EXPERT_TENSOR.match(tensor.name)
        if match is None or len(tensor.data.shape) != 3:
            continue
        layer, part = match.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        stacked = hf_tensors.get(f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}")
        if stacked is None:
            continue
        if part != "down":
            width = stacked.shape[1] // 2
            stacked = stacked[:, :width] if part == "gate" else stacked[:, width:]
        values = dequantize(tensor.data, tensor.tensor_type)
        if values.shape != tuple(stacked.shape) or not np.array_equal(values, stacked.numpy()):
            logger.info("GGUF tensor %s: not exactly the converted experts; they run dequantized", tensor.name)
            continue
        blocks[f"{prefix}.{part}"] = np.ascontiguousarray(tensor.data)
        metadata[f"{prefix}.{part}"] = tensor.tensor_type.name
    return blocks, metadata


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
    if module.endswith(".mlp.experts") and part in ("gate", "up", "down"):
        return f"{module}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    return name


def tensors_held_by_blocks(block_names: set[str]) -> set[str]:
    """The converted checkpoint's float tensors whose every value the named blocks hold (a stacked gate_up_proj needs
    both its gate's and its up's)."""
    held = {dense_counterpart(name) for name in block_names}
    return {name for name in held if not name.endswith(".gate_up_proj")
            or {f"{name.rpartition('.')[0]}.{part}" for part in ("gate", "up")} <= block_names}


def dequantized_tensors(blocks: dict[str, tuple[torch.Tensor, int]], names: set[str], kernels=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The float32 checkpoint tensors of the named blocks (a mixture's experts' gate and up stacked into gate_up_proj),
    for the layers that do not run on them: the values gguf dequantizes, by the C++ kernels where given."""
    stacked: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(names):
        values = dequantize_blocks(*blocks[name], kernels)
        counterpart = dense_counterpart(name)
        if counterpart == name or counterpart.endswith(".down_proj"):
            yield counterpart, values
            continue
        parts = stacked.setdefault(counterpart, {})
        parts[name.rpartition(".")[2]] = values
        if len(parts) == 2:
            yield counterpart, torch.cat([parts["gate"], parts["up"]], dim=1)
            del stacked[counterpart]
    if stacked:
        raise ValueError(f"GGUF blocks of a mixture hold gate without up or up without gate: {', '.join(sorted(stacked))}")


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


def _row_index(hf_tensors: dict[str, torch.Tensor]) -> dict[int, tuple[str, int]]:
    """Hash of each row's bytes -> (tensor name, row) over every 2-D float32 tensor."""
    owner = {}
    for name, tensor in hf_tensors.items():
        if tensor.dim() != 2 or tensor.dtype != torch.float32:
            continue
        for row, values in enumerate(tensor.numpy()):
            owner.setdefault(hash(values.tobytes()), (name, row))
    return owner


def _match_rows(values: np.ndarray, row_owner: dict, hf_tensors: dict[str, torch.Tensor]) -> tuple[str, np.ndarray] | None:
    """(HF name, HF row of each GGUF row) when the rows are exactly a permutation of one HF tensor's rows."""
    owners = [row_owner.get(hash(row.tobytes())) for row in values]
    names = {o[0] for o in owners if o is not None}
    if len(names) != 1:
        return None
    name = names.pop()
    target = hf_tensors[name].numpy()
    if target.shape != values.shape:
        return None
    if np.array_equal(target, values):  # most tensors keep their row order (and may repeat rows: embeddings)
        return name, np.arange(len(values))
    if any(o is None for o in owners):
        return None
    hf_rows = np.array([row for _, row in owners])
    if len(np.unique(hf_rows)) != len(hf_rows) or not np.array_equal(target[hf_rows], values):
        return None
    return name, hf_rows
