"""Write a tiny Llama model as a GGUF file, the way llama.cpp's converter lays it out."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from tokenizers import pre_tokenizers

from pagedserve.models.gguf_convert import llama3_divisors

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUANT_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
}
MERGES = ["h e", "l l", "Ġ w", "o r"]
# Byte-level BPE: every byte, plus a few merged pairs.
VOCAB = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; readers undo this."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=10000.0,
    )


def write_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    writer = _model_writer(path, "llama", "tiny-llama", config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    _finish(writer, _gguf_tensors(state_dict, config), type_name)


def _model_writer(path, architecture: str, name: str, config, rope_freq_base: float = 10000.0):
    """A GGUFWriter with the shape every test model states, and the writer's tokenizer."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope_freq_base)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _add_tokenizer(writer)
    return writer


def _finish(writer, tensors, type_name) -> None:
    """Add the (name, array) tensors in type_name (or, given a function of the GGUF name, in the type it names for each
    tensor, as llama.cpp's mixed files such as Q4_K_M hold several), then write the file."""
    type_of = type_name if callable(type_name) else lambda name: type_name
    # Vectors (norms, biases) stay F32, as llama.cpp keeps them.
    rng = np.random.default_rng(0)
    for name, tensor in tensors:
        _add_tensor(writer, name, tensor, type_of(name) if tensor.ndim > 1 else "F32", rng)
    _write_out(writer)


def _write_out(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_round_trip(weight: np.ndarray, type_name: str) -> np.ndarray:
    """What a reader must get back for a weight stored as type_name."""
    qtype = QUANT_TYPES[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return weight.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return weight.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(weight.astype(np.float32), qtype), qtype)


# Values per block, bytes per block and where the block's fp16 scales lie, of the types written as random blocks (gguf
# cannot quantize the K-quants): any bytes make a valid block once its scales are finite.
BLOCK_LAYOUTS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
                 "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}


def random_blocks(type_name: str, rows: int, columns: int, rng: np.random.Generator, magnitude: float = 1.0) -> np.ndarray:
    """Random GGUF blocks of type_name holding a [rows, columns] matrix (uint8 [rows, bytes per row]): random values and
    scales, the scales drawn so that the values stay within about magnitude."""
    values, size, scales = BLOCK_LAYOUTS[type_name]
    raw = rng.integers(0, 256, (rows, columns // values, size), dtype=np.uint8)
    # The largest stored integer times its largest scale multiplier: a K-quant's 6-bit (Q6_K: int8) scales times its values.
    largest = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32, "Q5_0": 16, "Q5_1": 31, "Q4_0": 8, "Q4_1": 15}.get(type_name, 128)
    for at in scales:
        scale = rng.uniform(0.25, 1.0, raw.shape[:2]) * magnitude / largest
        raw[..., at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def tiny_k_quant_llama_config():
    """The tiny Llama wide enough for K-quant blocks, whose rows are whole 256-value super-blocks."""
    config = tiny_llama_config()
    config.hidden_size, config.intermediate_size = 256, 512
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def _gguf_tensors(state_dict, config):
    def layer(sd, p, i):
        yield from _llama_attention(sd, p, i, config)
        yield from _dense_mlp(sd, p, i)

    return _model_tensors(state_dict, config, layer)


def _model_tensors(state_dict, config, layer_tensors, pre_norms: bool = True):
    """(GGUF name, array) of a model: the embedding, final norm and output, and each layer's norms before attention
    and the MLP (where pre_norms) and then layer_tensors(numpy state dict, HF prefix of the layer, layer index)."""
    sd = {k: v.float().numpy() for k, v in state_dict.items()}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    yield "output.weight", sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if pre_norms:
            yield f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"]
            yield f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]
        yield from layer_tensors(sd, p, i)


def _llama_attention(sd, p, i, config):
    """q and k permuted for llama.cpp's rotary layout."""
    yield f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads)
    yield f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads)
    yield f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"]
    yield f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]


def _dense_mlp(sd, p, i):
    yield f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]
    yield f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"]
    yield f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"]


def _stacked_experts(sd, p, i, width: int):
    """The router and the experts, stacked as llama.cpp stacks them. transformers holds them stacked too:
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    gate_up = sd[p + "mlp.experts.gate_up_proj"]
    yield f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"]
    yield f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :width])
    yield f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, width:])
    yield f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"]


def tiny_qwen3_config():
    """A Qwen3 with the writer's vocabulary: per-head q/k norms, a head size unlike the hidden size per head (the file
    states it), tied embeddings."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
    )


def write_qwen3_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a Qwen3: its head size as the key and value lengths, q and k not permuted, their
    norms per head, no output tensor (tied)."""
    def layer(sd, p, i):
        yield from _unpermuted_attention(sd, p, i)
        yield f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]
        yield f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]
        yield from _dense_mlp(sd, p, i)

    _write_tied_with_head_size(path, "qwen3", config, layer, type_name, state_dict)


def _write_tied_with_head_size(path, architecture: str, config, layer, type_name: str, state_dict, extra=()) -> None:
    """A model's file with its head size as the key and value lengths and no output tensor (tied embeddings), each
    layer's tensors after its norms from layer(numpy state dict, HF prefix of the layer, layer index), then the
    (name, array) tensors of extra."""
    writer = _model_writer(path, architecture, f"tiny-{architecture}", config, rope_freq_base=config.rope_parameters["rope_theta"])
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    tensors = [(name, tensor) for name, tensor in _model_tensors(state_dict, config, layer) if name != "output.weight"]
    _finish(writer, [*tensors, *extra], type_name)


def _unpermuted_attention(sd, p, i):
    """q and k as the checkpoint holds them: llama.cpp's converter permutes a Llama's only."""
    for part, piece in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
        yield f"blk.{i}.attn_{part}.weight", sd[p + f"self_attn.{piece}.weight"]


def tiny_qwen2_moe_config():
    """A Qwen2-MoE with the writer's vocabulary: 8 experts, top 2, a shared expert (every layer a mixture, as llama.cpp has them)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, use_sliding_window=False,
    )


def write_qwen2_moe_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a Qwen2-MoE: the experts of a layer stacked ([E, I, H] gate and up, [E, H, I]
    down), the shared expert's gate a vector, q and k not permuted."""
    writer = _model_writer(path, "qwen2moe", "tiny-qwen2-moe", config)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _finish(writer, _qwen2_moe_tensors(state_dict, config), type_name)


def _add_tokenizer(writer) -> None:
    writer.add_vocab_size(len(VOCAB))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(VOCAB) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


# Types gguf cannot quantize: a tensor in one is written as random blocks of its shape (random_blocks), so the file's
# values are not the state dict's, and the reference reads the file (transformers' GGUF reading).
RANDOM_BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _add_tensor(writer, name: str, tensor: np.ndarray, type_name: str, rng: np.random.Generator) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, tensor.astype(np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, tensor.astype(np.float16))
    elif type_name in RANDOM_BLOCK_TYPES:
        magnitude = 1.0 if name == "token_embd.weight" else 0.15
        blocks = random_blocks(type_name, int(np.prod(tensor.shape[:-1])), tensor.shape[-1], rng, magnitude)
        writer.add_tensor(name, blocks.reshape(*tensor.shape[:-1], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(tensor.astype(np.float32), qtype), raw_dtype=qtype)


def _qwen2_moe_tensors(state_dict, config):
    def layer(sd, p, i):
        for part, piece in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):  # not permuted
            yield f"blk.{i}.attn_{part}.weight", sd[p + f"self_attn.{piece}.weight"]
            yield f"blk.{i}.attn_{part}.bias", sd[p + f"self_attn.{piece}.bias"]
        yield f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]
        yield from _stacked_experts(sd, p, i, config.moe_intermediate_size)
        for part, piece in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            yield f"blk.{i}.ffn_{part}_shexp.weight", sd[p + f"mlp.shared_expert.{piece}.weight"]
        yield f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0]

    return _model_tensors(state_dict, config, layer)


def tiny_mixtral_config():
    """A Mixtral with the writer's vocabulary: 8 experts, top 2."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None,
    )


def write_mixtral_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a Mixtral: architecture llama with an expert count, q and k permuted for its
    rotary layout, each layer's router (ffn_gate_inp) and its experts stacked (ffn_{gate,up,down}_exps)."""
    writer = _model_writer(path, "llama", "tiny-mixtral", config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    _finish(writer, _mixtral_tensors(state_dict, config), type_name)


def _mixtral_tensors(state_dict, config):
    def layer(sd, p, i):
        yield from _llama_attention(sd, p, i, config)
        yield from _stacked_experts(sd, p, i, config.intermediate_size)

    return _model_tensors(state_dict, config, layer)


def tiny_olmoe_config():
    """An OLMoE with the writer's vocabulary: 8 experts, top 2, q and k normalized across all heads."""
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-5, rope_theta=10000.0, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
    )


def write_olmoe_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes an OLMoE: architecture olmoe, the expert width as feed_forward_length, q and k
    not permuted, their norms over the whole projection, the experts of a layer stacked."""
    writer = _model_writer(path, "olmoe", "tiny-olmoe", config)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    _finish(writer, _olmoe_tensors(state_dict, config), type_name)


def _olmoe_tensors(state_dict, config):
    def layer(sd, p, i):
        for part, piece in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):  # not permuted
            yield f"blk.{i}.attn_{part}.weight", sd[p + f"self_attn.{piece}.weight"]
        yield f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]
        yield f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]
        yield from _stacked_experts(sd, p, i, config.intermediate_size)

    return _model_tensors(state_dict, config, layer)


def tiny_olmo2_config():
    """An OLMo 2 with the writer's vocabulary: norms after attention and after the MLP only, q and k normalized across
    all heads."""
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-6, rope_theta=500000.0,
    )


def write_olmo2_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str, sliding_window: int = 0) -> None:
    """As llama.cpp's converter writes an OLMo 2: architecture olmo2, q and k not permuted, their norms over the whole
    projection, the norms after attention and the MLP. sliding_window: stated as an OLMo 3's file states it."""
    writer = _model_writer(path, "olmo2", "tiny-olmo2", config, rope_freq_base=config.rope_parameters["rope_theta"])
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    _finish(writer, _post_norm_model_tensors(state_dict, config), type_name)


def _post_norm_model_tensors(state_dict, config):
    """(GGUF name, array) of a model with OLMo 2's layer: q and k not permuted, their norms, the norms after attention
    and the MLP (none before them)."""
    def layer(sd, p, i):
        yield from _unpermuted_attention(sd, p, i)
        yield f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]
        yield f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]
        yield f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"]
        yield f"blk.{i}.post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"]
        yield from _dense_mlp(sd, p, i)

    return _model_tensors(state_dict, config, layer, pre_norms=False)


def tiny_smollm3_config():
    """A SmolLM3 with the writer's vocabulary, four layers: the fourth without a rotary, as llama.cpp has it."""
    from transformers import SmolLM3Config

    return SmolLM3Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-6, rope_theta=50000.0, no_rope_layer_interval=4,
        use_sliding_window=False,
    )


def write_smollm3_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a SmolLM3: a Llama's layout (q and k permuted) under architecture smollm3, with
    nothing said of its layers without a rotary."""
    writer = _model_writer(path, "smollm3", "tiny-smollm3", config, rope_freq_base=config.rope_parameters["rope_theta"])
    _finish(writer, _gguf_tensors(state_dict, config), type_name)


def tiny_ernie4_5_config():
    """An ERNIE 4.5 with the writer's vocabulary: its rotary of adjacent pairs, a head size the file states (beside
    hidden size / heads)."""
    from transformers import Ernie4_5Config

    return Ernie4_5Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-5, rope_theta=500000.0, use_bias=False,
    )


def write_ernie4_5_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str, rope_factors=None) -> None:
    """As llama.cpp's converter writes an ERNIE 4.5: q and k as the checkpoint holds them, no output tensor (tied).
    rope_factors: a rope_freqs tensor too, which llama.cpp writes for a scaled rotary of other architectures."""
    def layer(sd, p, i):
        yield from _unpermuted_attention(sd, p, i)
        yield from _dense_mlp(sd, p, i)

    extra = [("rope_freqs.weight", rope_factors)] if rope_factors is not None else []
    _write_tied_with_head_size(path, "ernie4_5", config, layer, type_name, state_dict, extra)


def tiny_exaone4_config():
    """An EXAONE 4 with the writer's vocabulary: a sliding-window layer and a full one (without a rotary), and a llama3
    rope scaling whose blend covers two of the head's frequencies (so that a file's factors tell its bounds)."""
    from transformers import Exaone4Config

    return Exaone4Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-5, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 2048},
    )


def write_exaone4_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes an EXAONE 4: OLMo 2's tensors with q/k norms per head, q and k as the checkpoint
    holds them, the sliding window and its pattern (which layers take it), and the llama3 scaling as the factors that
    divide each frequency (rope_freqs), as its converter computes them."""
    rope = config.rope_parameters
    writer = _model_writer(path, "exaone4", "tiny-exaone4", config, rope_freq_base=rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    factors = np.array(llama3_divisors(rope, config.head_dim), dtype=np.float32)
    _finish(writer, [*_post_norm_model_tensors(state_dict, config), ("rope_freqs.weight", factors)], type_name)


def tiny_gemma3_config():
    """A Gemma 3 text model as a GGUF file tells it: llama.cpp's layer pattern (every sixth layer full attention, the
    others sliding), the file's rope base and linear scaling for the full layers and 10000 for the sliding ones, scores
    scaled by the head size; tied embeddings."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6,
        sliding_window=16, bos_token_id=0, eos_token_id=2, pad_token_id=1, tie_word_embeddings=True, query_pre_attn_scalar=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
    )


def tiny_gemma2_config():
    """A Gemma 2 as a GGUF file tells it: llama.cpp's layer pattern (sliding, then full), scores scaled by the head size,
    soft caps of the scores and logits unlike transformers' defaults (the file states them); tied embeddings."""
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6,
        sliding_window=16, bos_token_id=0, eos_token_id=2, pad_token_id=1, tie_word_embeddings=True, query_pre_attn_scalar=16,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0, rope_theta=10000.0,
    )


def write_gemma2_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a Gemma 2: architecture gemma2, its soft caps, q and k as they are, every norm's
    weight stored plus one, no output tensor (tied)."""
    writer = _model_writer(path, "gemma2", "tiny-gemma2", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    _finish(writer, _gemma_tensors(state_dict, config, qk_norms=False), type_name)


def write_gemma3_gguf(path, state_dict: dict[str, torch.Tensor], config, type_name: str) -> None:
    """As llama.cpp's converter writes a Gemma 3: architecture gemma3, q and k as they are, every norm's weight stored
    plus one (llama.cpp's RMSNorm multiplies by the stored weight), no output tensor (tied)."""
    writer = _model_writer(path, "gemma3", "tiny-gemma3", config, rope_freq_base=1000000.0)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    _finish(writer, _gemma_tensors(state_dict, config, qk_norms=True), type_name)


def _gemma_tensors(state_dict, config, qk_norms: bool):
    """Gemma 2's and Gemma 3's tensors (qk_norms: Gemma 3's q and k norms)."""
    sd = {k: v.float().numpy() for k, v in state_dict.items()}
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    if qk_norms:
        norms |= {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"] + 1
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in norms.items():
            yield f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"] + 1
        yield f"blk.{i}.attn_q.weight", sd[p + "self_attn.q_proj.weight"]
        yield f"blk.{i}.attn_k.weight", sd[p + "self_attn.k_proj.weight"]
        yield f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"]
        yield f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]
        yield from _dense_mlp(sd, p, i)
