"""Find a model's files, read its config, build the module and load its weights."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.rotary import rope_parameters
from pagedserve.models.gguf_blocks import dense_counterpart, dequantized_tensors, load_quantized_blocks
from pagedserve.models.language_model import text_tensor_name
from pagedserve.models.moe import parallel_shape_problems as moe_parallel_shape_problems
from pagedserve.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors the served model reads, by the names its architecture reads them under (a multimodal
    checkpoint's language model's: models/language_model.py; its other parts are not read)."""
    from safetensors import safe_open

    files = _safetensors_files(model_dir)
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                ours = text_tensor_name(name)
                if ours is not None:
                    yield ours, handle.get_tensor(name)


def checkpoint_tensors(model_dir: Path, blocks: dict[str, tuple[torch.Tensor, int]], on_blocks: set[str] = frozenset(),
                       kernels=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor, by the names the model reads: the float tensors, then the values of the GGUF blocks
    (load_quantized_blocks) no float tensor holds, dequantized (by kernels, the C++ kernels, where given), but for the
    blocks in on_blocks (a layer runs on them)."""
    stored = stored_tensor_names(model_dir)
    dequantize = {name for name in blocks if dense_counterpart(name) not in stored and name not in on_blocks}
    return itertools.chain(iterate_safetensors(model_dir), dequantized_tensors(blocks, dequantize, kernels))


def stored_tensor_names(model_dir: Path) -> set[str]:
    """The names of the checkpoint's tensors (as iterate_safetensors gives them), read from the files' headers."""
    from safetensors import safe_open

    names = set()
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            names.update(ours for ours in map(text_tensor_name, handle.keys()) if ours is not None)
    return names


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


@contextlib.contextmanager
def _skip_weight_init():
    """Random initialisation of weights the checkpoint overwrites costs seconds at start-up; skip it.
    (load_weights fails if any parameter is left unloaded.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def load_model(hf_config, model_dir: Path, dtype: torch.dtype, device: torch.device, max_position: int,
               attn_backend: AttentionBackend, pooling: bool = False,
               place_blocks: Callable[[nn.Module, dict], set[str]] | None = None, kernels=None) -> torch.nn.Module:
    """pooling: the model serves its final hidden states (runner pooling): loaded without an lm_head. A converted GGUF
    model's GGUF blocks (models/gguf_blocks.py) go to place_blocks first, which puts the layers that run on them onto
    them and returns the names of the blocks they took; the checkpoint holds no float copy of most blocks, and the
    others' layers load them dequantized (by kernels, the C++ kernels, where given)."""
    model_class = resolve_model_class(hf_config, pooling)
    with torch.device(device), _skip_weight_init():
        model = model_class(hf_config, max_position, attn_backend, pooling=pooling)
    blocks = load_quantized_blocks(model_dir)
    taken = place_blocks(model, blocks) if place_blocks is not None and blocks else set()
    model.load_weights(checkpoint_tensors(model_dir, blocks, taken, kernels))
    # Rotary caches stay float32 (they are cast per step); weights take the serving dtype.
    for _name, param in model.named_parameters():
        param.data = param.data.to(dtype)
    return model.eval()


def eos_token_ids(model_dir: Path, hf_config) -> list[int]:
    """EOS ids from generation_config.json (it may list several), else from config.json."""
    generation_config = model_dir / "generation_config.json"
    value = None
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


# generation_config.json fields that become default sampling parameters (vLLM's --generation-config auto).
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(config_dir: Path) -> dict[str, float | int]:
    """The sampling defaults in config_dir/generation_config.json, as SamplingParams field names; empty when none."""
    path = config_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad generation_config.json in {config_dir}: {exc}") from exc
    return {ours: values[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if values.get(theirs) is not None}


def max_position_of(hf_config) -> int:
    max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
    # A longrope model's frequencies change once a sequence is longer than its original context (transformers takes
    # the long factors for a whole pass then): stay within it, where they are the short factors throughout.
    params = rope_parameters(hf_config)
    if params["rope_type"] == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", None)
        if original:
            max_position = min(max_position, original)
    return max_position


def validate_parallel_shape(hf_config, tensor_parallel_size: int, pipeline_parallel_size: int,
                            layer_partition: tuple[int, ...] | None = None, expert_parallel: bool = False) -> None:
    """Refuse, naming the numbers, a split of the model its shape does not allow."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    problems = []
    for name, value in (("num_attention_heads", heads), ("vocab_size", hf_config.vocab_size),
                        ("intermediate_size", hf_config.intermediate_size)):
        if value % tp:
            problems.append(f"{name} ({value}) is not divisible by tensor_parallel_size ({tp})")
    if kv_heads >= tp and kv_heads % tp:
        problems.append(f"num_key_value_heads ({kv_heads}) is not divisible by tensor_parallel_size ({tp})")
    if kv_heads < tp and tp % kv_heads:
        problems.append(f"tensor_parallel_size ({tp}) above num_key_value_heads ({kv_heads}) must be a multiple of it")
    problems += moe_parallel_shape_problems(hf_config, tp, expert_parallel)
    layers = hf_config.num_hidden_layers
    if pp > layers:
        problems.append(f"pipeline_parallel_size ({pp}) is more than the model's {layers} layers")
    if layer_partition is not None and sum(layer_partition) != layers:
        given = ",".join(map(str, layer_partition))
        problems.append(f"pp_layer_partition {given} sums to {sum(layer_partition)}, not the model's {layers} layers")
    if problems:
        raise ValueError("this model cannot be split so: " + "; ".join(problems))

