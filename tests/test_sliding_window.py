"""Sliding-window attention: a layer with a window attends to the keys of the last `window` positions, as transformers'
mask says. Models whose config gives every layer a window (Mistral's sliding_window) or some of them (Qwen2's
use_sliding_window with max_window_layers, Gemma 2's and Gemma 3's layer_types; Gemma 2's scores soft-capped too)
generate as transformers does past the window: through the C++ kernels and the torch backend, prompts in chunks after a
context longer than the window, and cached prefixes."""

import pytest
from conftest import greedy, hf_greedy, make_tiny_model, token_ids_of

from pagedserve import LLM
from pagedserve.models.hf_config import load_hf_config
from pagedserve.models.llama import attention_window
from pagedserve.models.loader import max_position_of

WINDOW = 10
# The prompts outgrow the window: a short one, one of three blocks, and one that the long one's start shares.
PROMPTS = [list(range(200, 214)), list(range(300, 345)), list(range(300, 330)) + [7, 8, 9]]


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory, default_model_dir):
    """A Mistral whose every layer has the window, a Qwen2 whose second layer has it (max_window_layers 1), and a
    Gemma 2 and a Gemma 3 whose first layer has it (layer_types)."""
    root = tmp_path_factory.mktemp("windowed")
    return {
        "gemma2": make_tiny_model(root / "gemma2", "gemma2", default_model_dir, sliding_window=WINDOW),
        "gemma3": make_tiny_model(root / "gemma3", "gemma3", default_model_dir, sliding_window=WINDOW),
        "mistral": make_tiny_model(root / "mistral", "mistral", default_model_dir, sliding_window=WINDOW),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", default_model_dir, use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1),
    }


def test_each_layers_window_is_the_configs(windowed_models):
    mistral, qwen2, gemma3 = (load_hf_config(windowed_models[name]) for name in ("mistral", "qwen2", "gemma3"))
    assert [attention_window(mistral, index) for index in range(2)] == [WINDOW, WINDOW]
    assert [attention_window(qwen2, index) for index in range(2)] == [None, WINDOW]
    assert [attention_window(gemma3, index) for index in range(2)] == [WINDOW, None]
    assert max_position_of(mistral) == 1024  # a model with a window serves its whole context


@pytest.mark.parametrize("model", ["mistral", "qwen2", "gemma2", "gemma3"])
@pytest.mark.parametrize("settings", [
    {},  # the C++ kernels
    {"attention_backend": "torch"},
])
def test_windowed_models_generate_as_transformers_past_the_window(model, settings, windowed_models):
    model_dir = windowed_models[model]
    # Chunks of 16 tokens: the long prompt's later chunks follow a context longer than the window.
    llm = LLM(str(model_dir), kv_cache_memory=16 * 1024**2, max_num_batched_tokens=16, **settings)
    try:
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(24), use_tqdm=False)
        # The third prompt shares the second's first blocks: it starts after a cached prefix longer than the window.
        cached = llm.generate({"prompt_token_ids": PROMPTS[2]}, greedy(24), use_tqdm=False)[0]
    finally:
        llm.llm_engine.client.shutdown()
    assert cached.num_cached_tokens >= 16
    assert token_ids_of(first) + token_ids_of([cached]) == hf_greedy(model_dir, PROMPTS, 24)
