"""A multimodal checkpoint (Gemma 3's 4B and larger saved as Gemma3ForConditionalGeneration, Mistral Small 3.1 as
Mistral3ForConditionalGeneration, Qwen2.5-VL, Qwen3-VL) serves its language model: the same tokens and logprobs as
transformers' multimodal class on text, from the layout transformers saves and from the one its classes hold in
memory, without reading the vision tower."""

import shutil

import pytest
import torch
from conftest import TOKENIZER_FILES, draw_norm_weights, greedy, hf_greedy, hf_token_logprobs

from pagedserve import LLM
from pagedserve.models.loader import iterate_safetensors

PROMPTS = [[1, 400, 500, 600, 700], list(range(100, 140))]
TEXT = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024, "initializer_range": 0.3}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
          "patch_size": 14}


QWEN_VISION = {"hidden_size": 32, "intermediate_size": 64, "depth": 1, "num_heads": 2, "out_hidden_size": 64, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN_TOKENS = {"image_token_id": 49151, "video_token_id": 49150, "vision_start_token_id": 49149}


def multimodal_model(arch: str):
    """A tiny Gemma 3 (a sliding-window layer and a full one, its norms' weights drawn; a small SigLIP tower), Mistral 3
    (its lm_head tied by the whole model's config, as transformers ties it, while its text config says untied; a small
    Pixtral tower), Qwen2.5-VL (qkv biases) or Qwen3-VL (q/k norms, interleaved sections), the Qwens' rotations in
    sections by three position ids."""
    import transformers

    torch.manual_seed(5)
    if arch == "qwen2_5_vl":
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
        config = transformers.Qwen2_5_VLConfig(text_config=TEXT | {"rope_parameters": rope, "bos_token_id": 1, "eos_token_id": 2},
                                               vision_config=QWEN_VISION | {"fullatt_block_indexes": [0]}, **QWEN_TOKENS)
        return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    if arch == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        config = transformers.Qwen3VLConfig(text_config=TEXT | {"rope_parameters": rope, "bos_token_id": 1, "eos_token_id": 2},
                                            vision_config=QWEN_VISION | {"deepstack_visual_indexes": [0]}, **QWEN_TOKENS)
        return transformers.Qwen3VLForConditionalGeneration(config).eval()
    if arch == "gemma3":
        text = TEXT | {"query_pre_attn_scalar": 24, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
        config = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4, image_token_index=49151,
                                           boi_token_index=49149, eoi_token_index=49150)
        model = transformers.Gemma3ForConditionalGeneration(config).eval()
        draw_norm_weights(model)
        return model
    config = transformers.Mistral3Config(text_config=TEXT | {"model_type": "mistral", "sliding_window": None, "tie_word_embeddings": False},
                                         vision_config=VISION | {"head_dim": 16}, image_token_index=49151, spatial_merge_size=1,
                                         tie_word_embeddings=True)
    return transformers.Mistral3ForConditionalGeneration(config).eval()


@pytest.fixture(scope="module", params=["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl"])
def multimodal_dir(request, tmp_path_factory, default_model_dir):
    """The tiny model saved as transformers saves it (the hub's layout), with the default model's tokenizer."""
    out = tmp_path_factory.mktemp("multimodal") / request.param
    multimodal_model(request.param).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, out / name)
    return out


def newer_layout(model_dir, out_dir):
    """The checkpoint with its tensors named as transformers' multimodal classes name them in memory
    (model.language_model., model.vision_tower., model.visual., model.multi_modal_projector.; lm_head as it is)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))

    def newer_name(name: str) -> str:
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("model.language_model.", "model.language_model."), ("model.visual.", "model.visual."),
                         ("model.", "model.language_model."), ("lm_head.", "lm_head.")):
            if name.startswith(old):
                return new + name.removeprefix(old)
        return "model." + name

    renamed = {newer_name(name): tensor for name, tensor in tensors.items()}
    save_file(renamed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("layout", ["hub", "newer"])
def test_a_multimodal_checkpoint_serves_its_language_model_as_transformers_does(layout, multimodal_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = multimodal_dir if layout == "hub" else newer_layout(multimodal_dir, tmp_path / "newer")
    llm = LLM(str(model_dir), kv_cache_memory=16 * 1024**2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(20, logprobs=1), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(multimodal_dir, PROMPTS, 20,
                                                                       model_class=AutoModelForImageTextToText)
    tokens = list(outputs[1].outputs[0].token_ids)
    reference, _ = hf_token_logprobs(multimodal_dir, PROMPTS[1], tokens, model_class=AutoModelForImageTextToText)
    ours = [position[token].logprob for token, position in zip(tokens, outputs[1].outputs[0].logprobs)]
    assert ours == pytest.approx(reference, abs=1e-3)


def test_a_multimodal_architecture_of_another_language_model_is_refused_by_name(tmp_path):
    import transformers

    config = transformers.Mistral3Config(text_config=TEXT | {"model_type": "llama"}, vision_config=VISION | {"head_dim": 16},
                                         image_token_index=49151, spatial_merge_size=1)
    transformers.Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Mistral3ForConditionalGeneration with a 'llama' language model is not supported; "
                                         "supported: .*Mistral3ForConditionalGeneration of mistral"):
        LLM(str(tmp_path), kv_cache_memory=16 * 1024**2)


def test_the_vision_tower_is_not_read(multimodal_dir):
    names = [name for name, _ in iterate_safetensors(multimodal_dir)]
    assert names and all(name.startswith("model.layers.") or name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
                         for name in names)
