"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config):
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
