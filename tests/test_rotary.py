"""Rope scalings are transformers' own: computed by its functions at a model's first start, read back from the cache
by later starts (which then need not import transformers), the same values either way."""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.layers import rotary
from pagedserve.models.hf_config import ResolvedConfig

SCALINGS = [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
     "short_factor": [1.0 + i / 16 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=[scaling["rope_type"] for scaling in SCALINGS])
def test_a_rope_scaling_is_transformers_own_computed_or_read_back(scaling, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      rope_parameters=dict(scaling))
    resolved = ResolvedConfig(json.loads(config.to_json_string(use_diff=False)))
    expected_inv_freq, expected_scaling = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    computed = rotary.compute_inv_freq(resolved, 16)

    def not_again(*_):
        raise AssertionError("a start after the first computed the scaling again")

    monkeypatch.setattr(rotary, "_transformers_inv_freq", not_again)
    read_back = rotary.compute_inv_freq(resolved, 16)
    for inv_freq, attention_scaling in (computed, read_back):
        assert torch.equal(inv_freq, expected_inv_freq.float()) and attention_scaling == float(expected_scaling)
    # Another scaling is another entry: nothing read back belongs to a different config.
    other = ResolvedConfig({**resolved.to_dict(), "rope_parameters": {**scaling, "factor": scaling["factor"] * 2}})
    with pytest.raises(AssertionError, match="computed the scaling again"):
        rotary.compute_inv_freq(other, 16)


def test_a_longrope_model_keeps_to_its_original_context():
    from pagedserve.models.loader import max_position_of

    longrope = ResolvedConfig({"max_position_embeddings": 1024, "rope_parameters": SCALINGS[-1]})
    assert max_position_of(longrope) == 256  # beyond it transformers turns to the long factors


def test_a_partial_rotary_turns_the_dims_transformers_turns():
    config = ResolvedConfig({"max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                                "partial_rotary_factor": 0.75}})
    assert rotary.rotary_dim(config, 16) == 12
    order = rotary.partial_rotary_order(16, 12)
    rope = rotary.RotaryEmbedding(config, 16, 64)
    torch.manual_seed(0)
    query, key, positions = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.arange(5) * 7

    def transformers_turn(x):  # the first 12 dims turned as pairs (i, i + 6), the rest passed
        angles = positions[:, None].float() * (1.0 / 10000.0 ** (torch.arange(0, 12, 2).float() / 12))
        cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[:, None], torch.cat((angles.sin(), angles.sin()), -1)[:, None]
        turned = x[..., :12]
        return torch.cat((turned * cos + torch.cat((-turned[..., 6:], turned[..., :6]), -1) * sin, x[..., 12:]), -1)

    ours_query, ours_key = rope(positions, query[..., order].clone(), key[..., order].clone())
    torch.testing.assert_close(ours_query, transformers_turn(query)[..., order])
    torch.testing.assert_close(ours_key, transformers_turn(key)[..., order])
