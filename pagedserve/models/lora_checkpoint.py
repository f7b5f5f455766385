"""A PEFT LoRA adapter directory read into the products it adds: for each adapted module (by its HF path, such as
model.layers.0.self_attn.q_proj; a base model's adapter is named as the model's own tensors are) the down-projection
A [r, in] and the up-projection B [out, r], B scaled by the adapter's alpha / r (alpha / sqrt(r) under rsLoRA), as
PEFT applies them. What PEFT can express and this engine cannot run is refused by name, never read halfway."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.lora_request import CONFIG_FILE, WEIGHTS_FILE
from pagedserve.models.llama import with_model_prefix

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# adapter_config.json settings that change what an adapter computes beyond A and B, with the value that means "off".
_UNSUPPORTED_SETTINGS = {"use_dora": False, "modules_to_save": None, "layer_replication": None, "alpha_pattern": {},
                         "trainable_token_indices": None, "target_parameters": None, "alora_invocation_tokens": None,
                         "use_qalora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none"}


@dataclass
class ModuleLoRA:
    a: torch.Tensor  # [rank, in_features], float32
    b: torch.Tensor  # [out_features, rank], float32, scaled

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class PeftAdapter:
    modules: dict[str, ModuleLoRA]  # HF module path -> its product

    @property
    def rank(self) -> int:
        return max(module.rank for module in self.modules.values())


def read_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    """The adapter in directory path; ValueError naming the problem when it is missing, broken, of a kind this engine
    does not run, or of a rank over max_rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    config = _read_config(directory)
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"LoRA adapter {str(directory)!r}: {WEIGHTS_FILE} is not readable: {exc}") from exc
    modules = _module_products(tensors, directory)
    for name, module in modules.items():
        if module.rank > max_rank:
            raise ValueError(f"LoRA adapter {str(directory)!r} has rank {module.rank} at {name}, over max_lora_rank ({max_rank})")
        rank_divisor = math.sqrt(module.rank) if config.get("use_rslora") else module.rank
        module.b = module.b * (float(config["lora_alpha"]) / rank_divisor)
    return PeftAdapter(modules)


def _read_config(directory: Path) -> dict:
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(directory)!r} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if not isinstance(config.get("lora_alpha"), (int, float)):
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} has no numeric lora_alpha")
    for setting, off in _UNSUPPORTED_SETTINGS.items():
        value = config.get(setting)
        if value not in (None, off, [], {}):
            raise ValueError(f"LoRA adapter {str(directory)!r} sets {setting} = {value!r}, which this engine does not run")
    return config


def _module_products(tensors: dict[str, torch.Tensor], directory: Path) -> dict[str, ModuleLoRA]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for suffix in (_A, _B):
            if key.startswith(_PREFIX) and key.endswith(suffix):
                halves.setdefault(with_model_prefix(key[len(_PREFIX):-len(suffix)]), {})[suffix] = tensor
                break
        else:
            raise ValueError(f"LoRA adapter {str(directory)!r} holds {key!r}, which is not a LoRA A or B weight of a linear layer")
    modules = {}
    for name, pair in halves.items():
        if len(pair) != 2:
            raise ValueError(f"LoRA adapter {str(directory)!r} has only one of lora_A and lora_B for {name}")
        a, b = pair[_A].float(), pair[_B].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {str(directory)!r}: {name}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             "do not make a product")
        modules[name] = ModuleLoRA(a.contiguous(), b.contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {str(directory)!r} holds no LoRA weights")
    return modules
