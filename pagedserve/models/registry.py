"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from pagedserve.models.language_model import MULTIMODAL_ARCHITECTURES
from pagedserve.models.llama import LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,  # its queries scaled by their position (models/llama.py)
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # with its layers without a rotary (no_rope_layers)
    "Olmo2ForCausalLM": LlamaForCausalLM,  # norms after attention and the MLP (models/llama.PostNormDecoderLayer)
    "Olmo3ForCausalLM": LlamaForCausalLM,  # OLMo 2's layer, with sliding-window layers
    "Ernie4_5ForCausalLM": LlamaForCausalLM,  # its rotary of adjacent pairs (layers/rotary.rotary_order)
    "Exaone4ForCausalLM": LlamaForCausalLM,  # OLMo 2's layer, q/k norms per head; its full layers unrotated beside windows
    "GraniteForCausalLM": LlamaForCausalLM,  # with its multipliers of embeddings, scores, residual adds and logits
    "Phi3ForCausalLM": LlamaForCausalLM,  # its q/k/v and gate/up saved fused (models/llama._unfused)
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": LlamaForCausalLM,  # Gemma (models/llama.py: its norms, embeddings and MLP)
    "Gemma2ForCausalLM": LlamaForCausalLM,  # Gemma 2 (its layer and soft caps)
    "Gemma3ForCausalLM": LlamaForCausalLM,  # Gemma 3's text models (its layer, norms and rotaries)
}
# Base models (no lm_head): how embedding models are saved; they serve with runner pooling only.
_BASE_MODELS = {"LlamaModel": LlamaForCausalLM, "MistralModel": LlamaForCausalLM, "Qwen2Model": LlamaForCausalLM,
                "Qwen3Model": LlamaForCausalLM}
# Sequence classification models (a score head over the pooled final hidden state: classifiers, cross-encoder
# rerankers, reward models); they serve with runner pooling only.
_CLASSIFIERS = {"LlamaForSequenceClassification": LlamaForCausalLM, "MistralForSequenceClassification": LlamaForCausalLM,
                "Qwen2ForSequenceClassification": LlamaForCausalLM, "Qwen3ForSequenceClassification": LlamaForCausalLM}


def supported_architectures() -> list[str]:
    return (sorted(_MODELS) + sorted(f"{name} (runner pooling)" for name in {**_BASE_MODELS, **_CLASSIFIERS})
            + [f"{name} (its language model)" for name in MULTIMODAL_ARCHITECTURES])


def resolve_model_class(hf_config, pooling: bool = False):
    """pooling: the engine serves the model's hidden states (runner pooling), which base models allow too."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
        if arch in _BASE_MODELS:
            if not pooling:
                raise ValueError(f"{arch} is a base model, without the lm_head that generates text: it serves embeddings "
                                 "with runner pooling")
            return _BASE_MODELS[arch]
        if arch in _CLASSIFIERS:
            if not pooling:
                raise ValueError(f"{arch} is a classification model, without the lm_head that generates text: it serves "
                                 "its classes and scores with runner pooling")
            return _CLASSIFIERS[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
