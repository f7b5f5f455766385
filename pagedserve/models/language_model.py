"""Multimodal checkpoints served for their text. The language model inside such a checkpoint is one of the text
architectures, so the engine serves it as that architecture: its config is the checkpoint's text_config, its tensors
those under the language model's prefix. The vision tower and the projector are not read, and the API's requests take
text content parts only, so no image reaches the model."""

from __future__ import annotations

# (A multimodal architecture, the model type of its text config) -> the text architecture of its language model and that
# architecture's model type. Qwen2.5-VL's and Qwen3-VL's language models rotate by three position ids (time, height,
# width), which are all the token's position for text: their rotation is the text model's.
LANGUAGE_MODELS = {
    ("Gemma3ForConditionalGeneration", "gemma3_text"): ("Gemma3ForCausalLM", "gemma3_text"),
    ("Mistral3ForConditionalGeneration", "mistral"): ("MistralForCausalLM", "mistral"),
    ("Mistral3ForConditionalGeneration", "ministral3"): ("Ministral3ForCausalLM", "ministral3"),
    ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text"): ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3VLForConditionalGeneration", "qwen3_vl_text"): ("Qwen3ForCausalLM", "qwen3"),
}
MULTIMODAL_ARCHITECTURES = sorted({architecture for architecture, _ in LANGUAGE_MODELS})

# Where such checkpoints keep the language model's tensors (the prefixes the hub's checkpoints have, and the one
# transformers' own multimodal classes use) -> where the text architecture keeps them.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
# Their other parts, which are not read.
_OTHER_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.", "model.vision_tower.", "model.multi_modal_projector.",
                "model.visual.")


def text_config_values(values: dict) -> dict:
    """A resolved config's values as the engine serves the model: a multimodal checkpoint's text_config, as its language
    model's architecture and model type, its lm_head tied or not as the whole model's config says (transformers ties
    it by that); any other config's as they are."""
    multimodal = next((name for name in values.get("architectures") or [] if name in MULTIMODAL_ARCHITECTURES), None)
    if multimodal is None or not isinstance(values.get("text_config"), dict):
        return values
    text_type = values["text_config"].get("model_type")
    if (multimodal, text_type) not in LANGUAGE_MODELS:
        known = ", ".join(f"{name} of {kind}" for name, kind in LANGUAGE_MODELS)
        raise ValueError(f"{multimodal} with a {text_type!r} language model is not supported; supported: {known}")
    architecture, model_type = LANGUAGE_MODELS[multimodal, text_type]
    tied = {"tie_word_embeddings": values["tie_word_embeddings"]} if "tie_word_embeddings" in values else {}
    return {**values["text_config"], "architectures": [architecture], "model_type": model_type, **tied}


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name as the text architecture reads it; None for a multimodal checkpoint's other parts."""
    if name.startswith(_OTHER_PARTS):
        return None
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name
