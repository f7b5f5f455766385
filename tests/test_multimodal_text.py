"""A multimodal checkpoint (Gemma 3's 4B and larger are saved as Gemma3ForConditionalGeneration) serves its language
model: the same tokens and logprobs as transformers' multimodal class on text, from the hub's layout and from
transformers' newer one, without reading the vision tower."""

import shutil

import pytest
import torch
from conftest import TOKENIZER_FILES, draw_norm_weights, greedy, hf_greedy, hf_token_logprobs

from pagedserve import LLM
from pagedserve.models.loader import iterate_safetensors

PROMPTS = [[1, 400, 500, 600, 700], list(range(100, 140))]


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory, default_model_dir):
    """A tiny Gemma3ForConditionalGeneration (a sliding-window layer and a full one; a small SigLIP tower), its norms'
    weights drawn, saved as transformers saves it (the hub's layout), with the default model's tokenizer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 1024, "initializer_range": 0.3}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=49151,
                          boi_token_index=49149, eoi_token_index=49150)
    torch.manual_seed(5)
    model = Gemma3ForConditionalGeneration(config).eval()
    draw_norm_weights(model)
    out = tmp_path_factory.mktemp("multimodal") / "gemma3"
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, out / name)
    return out


def newer_layout(model_dir, out_dir):
    """The checkpoint with its tensors named as transformers' multimodal classes name them in memory
    (model.language_model., model.vision_tower., model.multi_modal_projector.)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    renamed = {("model.language_model." + name.removeprefix("language_model.model.")) if name.startswith("language_model.model.")
               else "model." + name: tensor for name, tensor in tensors.items()}
    save_file(renamed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("layout", ["hub", "newer"])
def test_a_multimodal_checkpoint_serves_its_language_model_as_transformers_does(layout, multimodal_dir, tmp_path):
    model_dir = multimodal_dir if layout == "hub" else newer_layout(multimodal_dir, tmp_path / "newer")
    llm = LLM(str(model_dir), kv_cache_memory=16 * 1024**2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(20, logprobs=1), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(multimodal_dir, PROMPTS, 20)
    reference, _ = hf_token_logprobs(multimodal_dir, PROMPTS[1], list(outputs[1].outputs[0].token_ids))
    ours = [position[token].logprob for token, position in zip(outputs[1].outputs[0].token_ids, outputs[1].outputs[0].logprobs)]
    assert ours == pytest.approx(reference, abs=1e-3)


def test_the_vision_tower_is_not_read(multimodal_dir):
    names = [name for name, _ in iterate_safetensors(multimodal_dir)]
    assert names and all(name.startswith("model.layers.") or name in ("model.embed_tokens.weight", "model.norm.weight")
                         for name in names)
