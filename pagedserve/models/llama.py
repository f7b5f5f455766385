"""The Llama family: Llama, Mistral, Ministral 3 (queries scaled by their position), Qwen2 (qkv bias), Qwen3 (q/k
RMSNorm per head), SmolLM3 (some layers without a rotary), ERNIE 4.5 (a rotary of adjacent pairs), OLMo 2 and OLMo 3
(q/k RMSNorm across the heads; norms on what attention and the MLP give, none on their input: PostNormDecoderLayer;
OLMo 3's sliding-window layers rotating by their own parameters), EXAONE 4 (OLMo 2's layer with q/k RMSNorm per head;
with sliding-window layers, its full layers without a rotary), Gemma, Gemma 2 and Gemma 3 (below), and their mixtures
of experts (models/moe.py): Mixtral, Qwen2-MoE (qkv bias, a shared expert), Qwen3-MoE (q/k RMSNorm per head), OLMoE
(q/k RMSNorm across the heads, qkv clipping).

Gemma is the family's layer with RMSNorms that scale by 1 + weight (the checkpoint's weights are loaded plus one),
embeddings scaled by the square root of the hidden size and a GELU (tanh) gated MLP. Gemma 2 adds: a norm on what
attention and the MLP each give before it joins the residual stream (GemmaDecoderLayer); scores scaled by
query_pre_attn_scalar and soft-capped (attn_logit_softcapping), logits soft-capped (final_logit_softcapping); sliding-window
and full attention layers (layer_types). Gemma 3 (its text model) has Gemma 2's layer without the soft caps, with q/k
RMSNorm per head, and each kind of layer rotates by its own rotary parameters.

Models take a flat token batch plus attention metadata; they never see requests. Under tensor
parallelism (distributed/parallel_state.py) each rank builds its share of every layer (heads, MLP
columns, vocabulary) and loads only that share of the checkpoint; under pipeline parallelism each
rank builds its stage's decoder layers, the first stage the embedding, the last the norm and lm_head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.classification import is_classifier, num_labels_of
from pagedserve.distributed.parallel_state import rank_info, tp_size
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.gemm import BFloat16ProductsWeight, BFloat16ValuesWeight, linear_into, onednn_packs, pack_weight, packed_linear
from pagedserve.layers.layernorm import RMSNorm, SplitRMSNorm
from pagedserve.layers.linear import (
    ONEDNN_ROW_MULTIPLE,
    TILES_MAX_ROWS,
    BlocksOrDense,
    Linear,
    QKVParallelLinear,
    QuantizedParts,
    QuantizedWeight,
    RowParallelLinear,
    pad_rows,
)
from pagedserve.layers.rotary import NoRotary, RotaryEmbedding, rotary_layer_types, rotary_order, unrotated_layers
from pagedserve.layers.vocab_embedding import VocabParallelEmbedding, gather_logits
from pagedserve.models.mlp import GatedMLP
from pagedserve.models.moe import checkpoint_alias, expected_expert_loads, expert_load_key, expert_tensor, layer_mlp
from pagedserve.models.native_decode import NativeDecodeLayers

# What the logits come in, whatever the other GEMMs return: sampling and logprobs read them, and bfloat16 would round
# them to steps of 1/8 at their usual size, tying tokens that are not tied.
LOGITS_DTYPE = torch.float32

# checkpoint name piece -> (our fused parameter, shard index)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# A checkpoint's static per-tensor KV cache scales, by the names vLLM reads them under -> the scales they set.
KV_SCALE_NAMES = {
    "self_attn.k_scale": ("key",),
    "self_attn.v_scale": ("value",),
    "self_attn.kv_scale": ("key", "value"),
    "self_attn.k_proj.output_scale": ("key",),
    "self_attn.v_proj.output_scale": ("value",),
}


# Model types of the Gemma family: the norms' 1 + weight, the scaled embeddings.
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# Those whose layer normalizes what attention and the MLP give (GemmaDecoderLayer).
POST_NORM_TYPES = ("gemma2", "gemma3_text")
# Model types whose layer normalizes what attention and the MLP give and not their input (PostNormDecoderLayer).
POST_NORM_ONLY_TYPES = ("olmo2", "olmo3", "exaone4")
# Model types that normalize q and k: each head's, or the whole projection's (every rank's heads).
QK_NORM_PER_HEAD_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "exaone4")
QK_NORM_ACROSS_HEADS_TYPES = ("olmoe", "olmo2", "olmo3")


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def attention_window(hf_config, index: int) -> int | None:
    """Layer index's sliding window, as transformers reads the config: the layers layer_types names
    "sliding_attention" where the config has layer_types (Qwen2's and Qwen3's, from use_sliding_window and
    max_window_layers), else every layer where sliding_window is set (Mistral's, Phi-3's); None: full attention."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[index] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend, window: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        model_type = hf_config.model_type
        qkv_bias = model_type in ("qwen2", "qwen2_moe") or getattr(hf_config, "attention_bias", False)
        o_bias = model_type not in ("qwen2", "qwen2_moe") and getattr(hf_config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, hf_config.num_attention_heads,
                                          hf_config.num_key_value_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_local_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim, hf_config.hidden_size, bias=o_bias,
                                        name="o_proj")
        self.qk_norm = model_type in QK_NORM_PER_HEAD_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.qk_norm_across_heads = model_type in QK_NORM_ACROSS_HEADS_TYPES
        if self.qk_norm_across_heads and tp_size() == 1:
            self.q_norm = RMSNorm(self.q_size, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, hf_config.rms_norm_eps)
        elif self.qk_norm_across_heads:
            q_range, kv_range, _ = self.qkv_proj.part_ranges
            head_dim = self.head_dim
            self.q_norm = SplitRMSNorm(hf_config.num_attention_heads * head_dim, q_range, hf_config.rms_norm_eps)
            self.k_norm = SplitRMSNorm(hf_config.num_key_value_heads * head_dim, kv_range, hf_config.rms_norm_eps)
        self.clip_qkv = getattr(hf_config, "clip_qkv", None)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, attn_backend, window,
                              getattr(hf_config, "attn_logit_softcapping", None))  # Gemma 2's
        if getattr(hf_config, "attention_multiplier", None) is not None:  # Granite's scale of the scores
            self.attn.scale = float(hf_config.attention_multiplier)
        if getattr(hf_config, "query_pre_attn_scalar", None) is not None:  # Gemma's
            self.attn.scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        # Ministral 3 scales each rotated query by its position: 1 + beta * log(1 + floor(position / original length)).
        self.query_position_scaling = _query_position_scaling(hf_config)

    def forward(self, positions, hidden_states, kv_cache, meta: AttentionMetadata):
        rows, tokens = hidden_states.shape[0], meta.slot_mapping.shape[0]  # rows past the tokens: LlamaModel.gemm_rows
        qkv = self.qkv_proj(hidden_states)[:tokens]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            q, k, v = (part.clamp(-self.clip_qkv, self.clip_qkv) for part in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        if self.query_position_scaling is not None:
            beta, original = self.query_position_scaling
            q = q * (1 + beta * torch.log(1 + torch.floor(positions / original)))[:, None, None].to(q.dtype)
        return self.o_proj(pad_rows(self.attn(q, k, v, kv_cache, meta, out_dtype=self.o_proj.input_dtype(rows)), rows))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, rotary_emb, attn_backend, attention_window(hf_config, index))
        self.mlp = layer_mlp(hf_config, index)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        # Granite scales what attention and the MLP add to the residual stream.
        self.residual_multiplier = float(getattr(hf_config, "residual_multiplier", None) or 1.0)

    def keep_gemm_outputs(self, dtype: torch.dtype, single_rank: bool) -> None:
        """Let GEMMs return dtype (a bfloat16 GEMM's output as it comes) where what reads their output takes it so: q, k
        and v where the attention backend does and nothing works on them first (a bias, q/k norms, clipping); the
        output and down projections, whose output only the add to the float32 residual reads (RMSNorm widens it),
        where no other rank's share is added to it."""
        attn = self.self_attn
        plain_qkv = attn.qkv_proj.bias is None and not (attn.qk_norm or attn.qk_norm_across_heads) and attn.clip_qkv is None
        if plain_qkv and attn.attn.backend.takes_bfloat16:
            attn.qkv_proj.output_dtype = dtype
        if single_rank:
            attn.o_proj.output_dtype = dtype
            if isinstance(self.mlp, GatedMLP):
                self.mlp.down_proj.output_dtype = dtype

    def norms_by_place(self) -> dict[str, RMSNorm | None] | None:
        """The layer's norms by the places the native decode layers (models/native_decode.py) apply norms at, None at a
        place it has none; None for a layer whose norms sit where those layers have no place for them."""
        return {"input_norm": self.input_layernorm, "post_norm": self.post_attention_layernorm, **_head_norms(self.self_attn),
                "attention_out_norm": None, "mlp_out_norm": None}

    def attention_input(self, hidden_states, residual):
        """The layer's input joined to the residual stream (the first layer's starts it) and normalized for attention:
        (normalized, residual). Each norm hands the GEMM after it its input in the dtype that GEMM multiplies
        (Linear.input_dtype)."""
        qkv_dtype = self.self_attn.qkv_proj.input_dtype(hidden_states.shape[0])
        if residual is None:
            return self.input_layernorm(hidden_states, out_dtype=qkv_dtype), hidden_states
        return self.input_layernorm(hidden_states, residual, out_dtype=qkv_dtype)

    def forward(self, positions, hidden_states, residual, kv_cache, meta):
        rows = hidden_states.shape[0]
        hidden_states, residual = self.attention_input(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        mlp_dtype = self.mlp.gate_up_proj.input_dtype(rows) if isinstance(self.mlp, GatedMLP) else None
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual, out_dtype=mlp_dtype)
        hidden_states = self.mlp(hidden_states)
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        return hidden_states, residual


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Gemma's layer: what attention and the MLP give is normalized (post_attention_layernorm,
    post_feedforward_layernorm) before it joins the residual stream, and the MLP's input is normalized by
    pre_feedforward_layernorm."""

    def __init__(self, hf_config, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend, index: int) -> None:
        super().__init__(hf_config, rotary_emb, attn_backend, index)
        self.pre_feedforward_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def keep_gemm_outputs(self, dtype: torch.dtype, single_rank: bool) -> None:
        """Every GEMM keeps float32 outputs: a norm of its own reads each of attention's and the MLP's, before the
        float32 residual."""

    def norms_by_place(self) -> dict[str, RMSNorm | None]:
        """The MLP's input is normalized by pre_feedforward_layernorm; attention's and the MLP's outputs by theirs."""
        return {"input_norm": self.input_layernorm, "post_norm": self.pre_feedforward_layernorm, **_head_norms(self.self_attn),
                "attention_out_norm": self.post_attention_layernorm, "mlp_out_norm": self.post_feedforward_layernorm}

    def forward(self, positions, hidden_states, residual, kv_cache, meta):
        rows = hidden_states.shape[0]
        hidden_states, residual = self.attention_input(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, kv_cache, meta))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual,
                                                                 out_dtype=self.mlp.gate_up_proj.input_dtype(rows))
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class PostNormDecoderLayer(LlamaDecoderLayer):
    """OLMo 2's, OLMo 3's and EXAONE 4's layer: attention and the MLP read the residual stream as it is (no norm before
    them), and what each gives is normalized (post_attention_layernorm, post_feedforward_layernorm) before it joins the
    stream. As every layer here, it returns (its last addition to the stream, the stream before it)."""

    def __init__(self, hf_config, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend, index: int) -> None:
        super().__init__(hf_config, rotary_emb, attn_backend, index)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def keep_gemm_outputs(self, dtype: torch.dtype, single_rank: bool) -> None:
        """Every GEMM keeps float32 outputs: a norm of its own reads each of attention's and the MLP's."""

    def norms_by_place(self) -> None:
        """Nothing normalizes attention's input here, which the native decode layers always do."""
        return None

    def forward(self, positions, hidden_states, residual, kv_cache, meta):
        stream = hidden_states if residual is None else hidden_states + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


def _head_norms(attn: LlamaAttention) -> dict[str, RMSNorm | None]:
    """An attention's per-head q and k norms, by the native decode layers' names (None where it has none)."""
    return {"q_norm": attn.q_norm if attn.qk_norm else None, "k_norm": attn.k_norm if attn.qk_norm else None}


class MissingLayer(nn.Module):
    """A decoder layer that another pipeline stage runs: it keeps the layers' numbering and holds nothing."""


class LlamaModel(nn.Module):
    def __init__(self, hf_config, max_position: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        info = rank_info()
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # The last stage holds the embedding too when the lm_head is tied to it.
        if info.is_first_stage or (tied and info.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.stage_layers = info.stage_layers(hf_config.num_hidden_layers)
        self.embedding_multiplier = float(getattr(hf_config, "embedding_multiplier", None) or 1.0)  # Granite's
        if hf_config.model_type in GEMMA_TYPES:  # the square root of the hidden size, rounded to float32 as transformers' buffer holds it
            self.embedding_multiplier = float(torch.tensor(hf_config.hidden_size**0.5, dtype=torch.float32))
        layer_class = _decoder_layer_class(hf_config.model_type)
        rotary = _rotary_tables(hf_config, max_position)
        self.layers = nn.ModuleList([
            layer_class(hf_config, rotary(index), attn_backend, index) if index in self.stage_layers else MissingLayer()
            for index in range(hf_config.num_hidden_layers)
        ])
        if info.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.native_decode: NativeDecodeLayers | None = None  # the layers in one C++ call, for the steps it takes
        self.pads_gemm_rows = False  # set where the GEMMs are packed for it (LlamaForCausalLM.pack_gemm_weights)

    def gemm_rows(self, tokens: int) -> int:
        """The rows a step of `tokens` tokens runs through the layers: more, to a multiple of ONEDNN_ROW_MULTIPLE (zero
        rows past the tokens, which the attention leaves out), where its GEMMs are oneDNN's bfloat16 ones beyond the AMX
        tiles' rows and every row is a token's to every layer (no adapters, which pick theirs by token, nor experts)."""
        if tokens <= TILES_MAX_ROWS or not self.pads_gemm_rows:
            return tokens
        first = self.layers[self.stage_layers[0]]
        if first.self_attn.qkv_proj.lora is not None:
            return tokens
        return -(-tokens // ONEDNN_ROW_MULTIPLE) * ONEDNN_ROW_MULTIPLE

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """kv_caches: this stage's layers' caches. The last stage returns the final hidden states; the others
        (hidden states, residual) for the next stage, which passes them back in as intermediate."""
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
        else:
            hidden_states, residual = intermediate
        native = self.native_decode
        if native is not None and native.takes(meta, hidden_states.shape[0]):
            hidden_states, residual = native.forward(hidden_states, residual, positions, kv_caches, meta)
        else:
            tokens = hidden_states.shape[0]
            rows = self.gemm_rows(tokens)
            hidden_states, residual = pad_rows(hidden_states, rows), None if residual is None else pad_rows(residual, rows)
            for index, kv_cache in zip(self.stage_layers, kv_caches):
                hidden_states, residual = self.layers[index](positions, hidden_states, residual, kv_cache, meta)
            hidden_states, residual = hidden_states[:tokens], residual[:tokens]
        if not rank_info().is_last_stage:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, max_position: int, attn_backend: AttentionBackend, pooling: bool = False) -> None:
        """pooling: the model serves its final hidden states (an embedding model), or a classification model its score
        head's logits of them: no lm_head."""
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, max_position, attn_backend)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.logits_scaling = float(getattr(hf_config, "logits_scaling", None) or 1.0)  # Granite divides its logits by it
        # Gemma 2 caps its logits: cap * tanh(logit / cap).
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self.packed_lm_head: torch.Tensor | None = None
        # The lm_head's weight in bfloat16 pairs for the C++ kernels: multiplied in bfloat16 with float32 sums where GEMMs
        # multiply in bfloat16 and the kernels have bfloat16 dot products; read as bfloat16 values into float32 products
        # where the GEMMs are float32 and its values are bfloat16 ones (values_kernels).
        self.lm_head_pairs: BFloat16ProductsWeight | BFloat16ValuesWeight | None = None
        self.quantized_lm_head: QuantizedWeight | None = None
        head_dim = head_dim_of(hf_config)
        self.rotary_order = rotary_order(hf_config, head_dim)
        if self.rotary_order is not None and hf_config.model_type in QK_NORM_PER_HEAD_TYPES + QK_NORM_ACROSS_HEADS_TYPES:
            raise ValueError("q/k norms with a rotary that reorders q and k at load (a partial_rotary_factor, or adjacent "
                             "pairs) are not supported")
        if pooling or not rank_info().is_last_stage:
            self.lm_head = None
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)  # its rows: this rank's vocabulary
        # A classification model's head (transformers' name for it): a few rows, whole on every rank of the last stage.
        self.score = None
        if pooling and is_classifier(hf_config) and rank_info().is_last_stage:
            self.score = nn.Linear(hf_config.hidden_size, num_labels_of(hf_config), bias=False)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, intermediate=None):
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classification model's float32 logits of pooled final hidden states ([rows, hidden])."""
        return F.linear(pooled.float(), self.score.weight.float())

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary (each tensor-parallel rank computes its share, then they are gathered). out: a
        float32 [rows, vocabulary] tensor one rank's dense lm_head writes them into rather than a new one (gathered
        shares make a new one); the logits are what returns."""
        if self.quantized_lm_head is not None and self.quantized_lm_head.takes(hidden_states):
            local = self.quantized_lm_head.linear(hidden_states)
        else:
            local = self.dense_logits(hidden_states, out if tp_size() == 1 else None)
        logits = gather_logits(local)
        if self.logits_scaling != 1.0:
            logits.div_(self.logits_scaling)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def dense_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's logits on the dense lm_head (packed where pack_gemm_weights ran), whatever the blocks would take;
        into out where given."""
        if self.lm_head_pairs is not None:
            return self.lm_head_pairs.linear(hidden_states, out)
        if self.packed_lm_head is not None:
            product = partial(packed_linear, packed_weight=self.packed_lm_head, bias=None)
        elif self.lm_head.weight is None:  # on its blocks alone
            product = partial(F.linear, weight=self.quantized_lm_head.dequantized())
        else:
            product = partial(F.linear, weight=self.lm_head.weight)
        return product(hidden_states) if out is None else linear_into(product, hidden_states, out)

    def pack_gemm_weights(self, dtype: torch.dtype, onednn: bool, activation_dtype: torch.dtype, kernels=None,
                          tiles: bool = False, values_kernels=None) -> None:
        """Run every dense GEMM on a copy of its weight in dtype (float32, or bfloat16 multiplying activations rounded to
        it), reordered for oneDNN where onednn; the originals stay for reading. GEMMs return activation_dtype, but the
        MLP's gate-up, whose output SiLU-and-mul and the down projection read, keeps dtype, and so do others whose
        readers take it (LlamaDecoderLayer.keep_gemm_outputs); but for steps on AMX tiles, which return their float32
        sums (Linear.pack, where tiles). The lm_head returns
        LOGITS_DTYPE: in bfloat16 on the kernels' bfloat16 dot products where they have them, else in float32. Given
        values_kernels, float32 GEMMs whose weights hold bfloat16 values read them so (Linear.pack), the lm_head's too."""
        # Where the tiles take the steps of few rows, the steps that reach oneDNN's bfloat16 GEMMs are the large ones:
        # there a pass over the gate-up output costs most, and a new row count costs each GEMM shape a primitive.
        onednn_beyond_tiles = tiles and dtype == torch.bfloat16 and onednn and onednn_packs(dtype)
        gate_ups = {module.gate_up_proj for module in self.modules() if isinstance(module, GatedMLP)}
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(dtype, onednn, activation_dtype, kernels if tiles else None,
                            parts_apart=onednn_beyond_tiles and module in gate_ups, values_kernels=values_kernels)
        self.model.pads_gemm_rows = onednn_beyond_tiles and not any(isinstance(module, FusedMoE) for module in self.modules())
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.gate_up_proj.output_dtype = dtype
            elif isinstance(module, FusedMoE):
                module.pack(dtype, onednn)
            elif isinstance(module, LlamaDecoderLayer):
                module.keep_gemm_outputs(dtype, single_rank=tp_size() == 1 and rank_info().pp_size == 1)
        if self.lm_head is None or self.lm_head.weight is None:  # none, or on its blocks alone
            return
        if dtype == torch.bfloat16 and BFloat16ProductsWeight.offered(kernels):
            self.lm_head_pairs = BFloat16ProductsWeight(self.lm_head.weight, kernels)
        elif values_kernels is not None and BFloat16ValuesWeight.holds(self.lm_head.weight):
            self.lm_head_pairs = BFloat16ValuesWeight(self.lm_head.weight, values_kernels)
        elif onednn:
            self.packed_lm_head = pack_weight(self.lm_head.weight, LOGITS_DTYPE)

    def use_native_decode(self, kernels) -> bool:
        """Run steps of few decodes through the decoder layers in one C++ call (models/native_decode.py) where every
        layer allows it; call once the GEMMs' row counts are chosen. Returns whether it does."""
        self.model.native_decode = NativeDecodeLayers.of(self.model, kernels)
        return self.model.native_decode is not None

    def blocks_and_dense_gemms(self) -> list[BlocksOrDense]:
        """Every GEMM that can run either on its GGUF blocks or on its dense weight, in the order a forward pass runs them."""
        gemms = [BlocksOrDense(f"{type(m).__name__} {m.in_features}x{m.out_features}", m.in_features, m.quantized,
                               partial(m.dense_matmul, bias=None))
                 for m in self.modules() if isinstance(m, Linear) and m.quantized is not None]
        if self.quantized_lm_head is not None:
            hidden, vocab = self.config.hidden_size, self.quantized_lm_head.blocks.shape[0]
            gemms.append(BlocksOrDense(f"lm_head {hidden}x{vocab}", hidden, self.quantized_lm_head, self.dense_logits))
        return gemms

    def use_quantized_weights(self, blocks: dict[str, tuple[torch.Tensor, int]], kernels, integer_products: bool = False) -> set[str]:
        """Run the GEMMs whose checkpoint tensors come as GGUF blocks on them (the C++ kernels, float32
        activations), this rank's share of them (the blocks given are those the products will read: Worker); call
        before load_weights. A fused layer needs all its shards in blocks, and in one type unless integer_products (the
        products will be integers on rounded input: QuantizedParts); so do a mixture's gate and up. q's and k's blocks
        come in the checkpoint's row order and are put in the kernels' rotary order as their float rows were (each
        row's blocks move whole: the same values). A layer that takes its blocks keeps no dense weight, but for the
        embedding that shares them with the lm_head. Returns the names of the blocks taken."""
        shards: dict[str, dict[int | None, tuple[torch.Tensor, int]]] = {}
        experts: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
        for name, entry in blocks.items():
            module_name, _, part = name.rpartition(".")
            if isinstance(self._module_of(name), FusedMoE):
                experts.setdefault(module_name, {})[part] = entry
                continue
            target, shard = _fused_target(name)
            shards.setdefault(target, {})[shard] = (self._in_rotary_order(name, entry[0]), entry[1])
        lm_head_source = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        taken = {f"{module_name}.{part}" for module_name, parts in experts.items() if self._experts_on_blocks(module_name, parts, kernels)
                 for part in parts}
        for target, parts in shards.items():
            if target == lm_head_source:
                if self.lm_head is not None:
                    qblocks, qtype = parts[None]
                    local_blocks = self.lm_head.rank_slice(qblocks, None, False).contiguous()
                    self.quantized_lm_head = QuantizedWeight(local_blocks, qtype, kernels)
                    if not self.tie_word_embeddings:
                        self.lm_head.register_parameter("weight", None)
                    taken.add(target)
                continue
            module = self._module_of(target)
            if not isinstance(module, Linear):
                continue  # another stage's, or not a linear layer
            expected = range(len(module.shard_sizes)) if module.shard_sizes else [None]
            types = [parts[s][1] for s in expected] if set(parts) == set(expected) else []
            if not types or (len(set(types)) > 1 and not integer_products):
                continue
            local = [module.rank_blocks(parts[s][0], s, kernels.gguf_block_shape(qtype)) for s, qtype in zip(expected, types)]
            if any(part is None for part in local):
                continue
            if len(set(types)) == 1:
                module.use_blocks(QuantizedWeight(torch.cat(local).contiguous(), types[0], kernels))
            else:
                module.use_blocks(QuantizedParts([QuantizedWeight(part, qtype, kernels) for part, qtype in zip(local, types)], kernels))
            taken.update(name for name in blocks if _fused_target(name)[0] == target)
        return taken

    def _experts_on_blocks(self, module_name: str, parts: dict[str, tuple[torch.Tensor, int]], kernels) -> bool:
        """A mixture layer's experts onto their GGUF blocks: gate and up in one type (each expert multiplies them as one
        weight), down in its own (llama.cpp's Q4_K_M gives it more bits)."""
        if set(parts) != {"gate", "up", "down"} or parts["gate"][1] != parts["up"][1]:
            return False
        (gate, gate_up_type), (up, _), (down, down_type) = parts["gate"], parts["up"], parts["down"]
        return self.get_submodule(module_name).use_blocks(gate, up, down, gate_up_type, down_type, kernels)

    def block_products(self) -> list[QuantizedWeight | QuantizedParts]:
        """Every product on GGUF blocks (QuantizedWeight, QuantizedParts): the GEMMs that can also run dense, and the
        experts'."""
        experts = [weight for module in self.modules() if isinstance(module, FusedMoE) for weight in module.block_weights()]
        return [gemm.blocks for gemm in self.blocks_and_dense_gemms()] + experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's share of each checkpoint tensor into place; tensors of other stages are skipped."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            if name.startswith("lm_head.") and self.lm_head is None and rank_info().is_last_stage:
                continue  # an embedding model's: its hidden states are what it serves
            name = checkpoint_alias(with_model_prefix(name))
            expert = expert_tensor(name)
            if expert is not None:
                experts, index, part = expert
                if not self._belongs_to_another_stage(experts) and not self.get_submodule(experts).on_blocks:
                    loaded.update(self._load_experts(experts, index, part, tensor, name))
                continue
            if _kv_scale_target(name) is not None:
                self._load_kv_scale(name, tensor)
                continue
            if self.config.model_type in GEMMA_TYPES and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0  # Gemma's RMSNorm scales by 1 + weight, in float32
            for piece_name, piece in _unfused(name, tensor, self.config):
                piece = self._in_rotary_order(piece_name, piece)
                target, shard = _fused_target(piece_name)
                if target not in params:
                    if self._belongs_to_another_stage(target) or self._on_blocks_alone(target):
                        continue
                    raise ValueError(f"checkpoint tensor {piece_name!r} has no place in {type(self).__name__}")
                _copy_into(self._module_of(target), params[target], piece, shard, piece_name)
                loaded.add(f"{target}#{shard}")
        missing = [n for n in self._expected_loads() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(sorted(missing)[:8])}")

    def _in_rotary_order(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """q's and k's rows (weights and biases) with each head's dims in the order the kernels turn them in
        (layers/rotary.rotary_order); other tensors as they are."""
        order = self.rotary_order
        if order is None or not (".q_proj." in name or ".k_proj." in name):
            return tensor
        head_dim = len(order)
        return tensor.reshape(tensor.shape[0] // head_dim, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)

    def _load_experts(self, module_name: str, index: int | None, part: str, tensor: torch.Tensor, name: str) -> list[str]:
        """One expert's part, or (index None) every expert's, stacked; returns what it loaded, as _expected_loads names it."""
        experts = self.get_submodule(module_name)
        if index is not None:
            experts.load_expert(index, part, tensor, name)
            return [expert_load_key(module_name, index, part)]
        experts.load_stacked(part, tensor, name)
        parts = ("down",) if part == "down" else ("gate", "up")
        return [expert_load_key(module_name, expert, p) for expert in range(experts.num_experts) for p in parts]

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        attention, fields = _kv_scale_target(name)
        if self._belongs_to_another_stage(attention):
            return
        value = float(tensor) if tensor.numel() == 1 else math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"checkpoint tensor {name!r} must be one positive, finite per-tensor scale, got {tensor.tolist()}")
        layer = self.get_submodule(attention)
        layer.kv_scales = dataclasses.replace(layer.kv_scales, **dict.fromkeys(fields, value))

    def _module_of(self, param_name: str) -> nn.Module | None:
        try:
            return self.get_submodule(param_name.rsplit(".", 1)[0])
        except AttributeError:
            return None

    def _belongs_to_another_stage(self, param_name: str) -> bool:
        parts = param_name.split(".")
        if parts[:2] == ["model", "layers"]:
            return isinstance(self.model.layers[int(parts[2])], MissingLayer)
        return parts[1] in ("embed_tokens", "norm") or parts[0] in ("lm_head", "score")  # held by the first or last stage only

    def _on_blocks_alone(self, param_name: str) -> bool:
        """Whether the parameter's module runs on GGUF blocks and has let that dense weight go (use_quantized_weights)."""
        module = self._module_of(param_name)
        return module is not None and param_name.endswith(".weight") and getattr(module, "weight", True) is None

    def _expected_loads(self) -> list[str]:
        expected = []
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE) and not module.on_blocks:
                expected += expected_expert_loads(name, module)
        for name, _ in self.named_parameters():
            module = self._module_of(name)
            if isinstance(module, FusedMoE):
                continue
            shards = getattr(module, "shard_sizes", None)
            expected += [f"{name}#{i}" for i in range(len(shards))] if shards else [f"{name}#None"]
        return expected


def _query_position_scaling(hf_config) -> tuple[float, int] | None:
    """(beta, original context length) of a config whose queries are scaled by their position (Ministral 3's
    llama_4_scaling_beta); None for the others."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    return float(beta), int(params["original_max_position_embeddings"])


def _decoder_layer_class(model_type: str) -> type[LlamaDecoderLayer]:
    if model_type in POST_NORM_TYPES:
        return GemmaDecoderLayer
    return PostNormDecoderLayer if model_type in POST_NORM_ONLY_TYPES else LlamaDecoderLayer


def _rotary_tables(hf_config, max_position: int):
    """layer index -> its table of rotary angles: one shared by every layer (they all rotate by the same position), or
    one per layer type where the config rotates each type by its own parameters (Gemma 3's); none (NoRotary) for a
    layer that attends without one (SmolLM3's)."""
    head_dim = head_dim_of(hf_config)
    layer_types, unrotated = rotary_layer_types(hf_config), unrotated_layers(hf_config)
    if layer_types is None:
        shared = RotaryEmbedding(hf_config, head_dim, max_position)
        return lambda index: NoRotary() if index in unrotated else shared
    tables = {layer_type: RotaryEmbedding(hf_config, head_dim, max_position, layer_type) for layer_type in layer_types}
    return lambda index: NoRotary() if index in unrotated else tables[hf_config.layer_types[index]]


def with_model_prefix(name: str) -> str:
    """A checkpoint tensor's name as a ...ForCausalLM names it: a base model's (LlamaModel, Qwen3Model: how embedding
    models are saved) lack the "model." before the decoder's tensors."""
    return name if name.startswith(("model.", "lm_head.", "score.")) else "model." + name


def _kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """For a checkpoint's KV cache scale: the Attention module it belongs to and the scales it sets; else None."""
    for suffix, fields in KV_SCALE_NAMES.items():
        if name.endswith(f".{suffix}"):
            return name[: -len(suffix)] + "self_attn.attn", fields
    return None


def _unfused(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the separate q/k/v and gate/up tensors the layers load by shard: Phi-3 saves each
    layer's q, k and v as one qkv_proj and its gate and up as one gate_up_proj (gate first), which is split here so
    that each rank takes its heads and columns of each, as it does from the other checkpoints."""
    if ".self_attn.qkv_proj." in name:
        head_dim = head_dim_of(hf_config)
        q_size, kv_size = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
        parts = tensor.split([q_size, kv_size, kv_size], dim=0)
        return [(name.replace("qkv_proj", piece), part) for piece, part in zip(("q_proj", "k_proj", "v_proj"), parts)]
    if ".mlp.gate_up_proj." in name:
        gate, up = tensor.chunk(2, dim=0)
        return [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
    return [(name, tensor)]


def _fused_target(name: str) -> tuple[str, int | None]:
    for piece, (fused, shard) in STACKED_PARAMS.items():
        if f".{piece}." in name:
            return name.replace(piece, fused), shard
    return name, None


def _copy_into(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str) -> None:
    with torch.no_grad():
        rank_slice = getattr(module, "rank_slice", None)
        if rank_slice is not None:
            tensor = rank_slice(tensor, shard, name.endswith(".bias"))
        if shard is None:
            dest = param
        else:
            sizes = module.shard_sizes
            start = sum(sizes[:shard])
            dest = param.narrow(0, start, sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
