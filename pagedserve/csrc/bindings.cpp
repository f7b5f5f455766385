#include <torch/extension.h>

#include "decode_layers.h"
#include "ops.h"

namespace {

// (blocks, qtype, interleaved or None, panels or None, blocks_max_rows, AMX tiles' pairs or None, out_features, whether
// those pairs are the weight's bfloat16 values), as models/native_decode.py passes a Linear.
using BlockLinearArgs = std::tuple<at::Tensor, int64_t, c10::optional<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                                   std::vector<int64_t>, int64_t, c10::optional<at::Tensor>, int64_t, bool>;

BlockLinear block_linear(const BlockLinearArgs& args) {
  return {std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args), std::get<4>(args),
          std::get<5>(args), std::get<6>(args), std::get<7>(args), std::get<8>(args), std::get<9>(args)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged attention for decodes (CPU; float32 queries, float32/bfloat16/float16 cache, or bytes of 8-bit rows and kv_format; "
        "window: a sliding window's keys, 0 for none; softcap: the scores' soft cap, 0 for none)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("kv_format") = 0, py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal paged attention for prefill chunks, after context or not (CPU; float32 queries, 16- or 32-bit cache or 8-bit rows; "
        "window: a sliding window's keys, 0 for none; softcap: the scores' soft cap, 0 for none; bf16_products: over a bfloat16 "
        "cache, q and the probabilities rounded to bfloat16 and multiplied in pairs, where prefill_bf16_products()), into out",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("query_starts"),
        py::arg("query_lens"), py::arg("seq_lens"), py::arg("scale"), py::arg("out"), py::arg("kv_format") = 0, py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("bf16_products") = false);
  m.def("prefill_bf16_products", &prefill_bf16_products,
        "whether paged_prefill_attention multiplies in bfloat16 pairs here (bf16_products): a build with AVX-512 BF16");
  m.def("write_kv_cache", &write_kv_cache,
        "store new tokens' float32 K/V at their cache slots (CPU; float32/bfloat16/float16 cache, or quantized into 8-bit rows, "
        "with static scales where k_scale / v_scale are positive, else each row's own)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"), py::arg("kv_format") = 0,
        py::arg("k_scale") = 0.0, py::arg("v_scale") = 0.0);
  m.def("dequantize_kv_rows", &dequantize_kv_rows, "8-bit KV rows (bytes [..., head_dim + 4]) as float32 values [..., head_dim]",
        py::arg("rows"), py::arg("kv_format"));
  m.def("prefill_lanes", &prefill_lanes, "floats the prefill attention tiles compute at a time in this build (16 with AVX-512)");
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension of float32 x, in out_dtype (float32 or bfloat16)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("out_dtype"));
  m.def("add_rms_norm", &add_rms_norm,
        "(RMSNorm(x + residual) in out_dtype (float32 or bfloat16), x + residual in float32); x float32 or bfloat16",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out_dtype"));
  m.def("silu_and_mul", &silu_and_mul,
        "silu(first half) * second half of the last dimension, in out_dtype (default: gate_up's; bfloat16 from float32 "
        "rounds once, computed as a bfloat16 row's is)",
        py::arg("gate_up"), py::arg("out_dtype") = py::none());
  m.def("fresh_attention_on_tiles", &fresh_attention_on_tiles,
        "whether fresh_causal_attention runs here: AMX tiles granted, head_dim a multiple of 32", py::arg("head_dim"));
  m.def("fresh_causal_attention", &fresh_causal_attention,
        "causal attention of count sequences of one length side by side, each over its own keys (bfloat16 [rows, heads, "
        "head_dim] in and out, on the AMX tiles)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("count"), py::arg("scale"));
  m.def("set_thread_cpus", &set_thread_cpus,
        "thread i of torch's OpenMP threads (the caller is 0) runs on cpus_of_thread[i] only; the thread count becomes its length",
        py::arg("cpus_of_thread"));
  m.def("spin_pause_seconds", &spin_pause_seconds,
        "seconds one turn of an OpenMP thread's spin (an x86 pause) takes on this processor; 0 where there is no pause");
  m.def("int8_vector_products", &int8_vector_products,
        "the byte multiply-adds that `iterations` turns of the widest unsigned-by-signed byte multiply-add do on num_threads "
        "threads, in registers (time it for the vector units' rate); 0 where the processor has none",
        py::arg("iterations"), py::arg("num_threads"));
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of a [rows, n] float32 tensor (same NaN and tie rules)");
  m.def("sample_rows", &sample_rows,
        "one token per row of [rows, n] float32 logits: temperature (0: argmax), top_k (0: off), top_p, min_p, and a draw "
        "from Philox(seed, counter)");
  m.def("apply_penalties_", &apply_penalties_,
        "repetition (prompt and output), frequency and presence (output) penalties, in place, over each row's tokens");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "-inf in place where a row's token bitmask (int32 words, bit j % 32 of word j / 32) forbids the token, in the rows given");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of query and key, in place");
  m.def("quantized_linear", &quantized_linear, "x @ W.T (+ bias) with W in GGUF Q4_0/Q4_1/Q8_0 blocks",
        py::arg("x"), py::arg("weight"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("interleaved") = py::none());
  m.def("quantized_linear_q8", &quantized_linear_q8,
        "x @ W.T (+ bias) with W in GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks, read from their panels (pack_q8_panels), "
        "and x rounded to 8 bits "
        "per block of 32 values (integer products)",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("quantized_linear_q8_parts", &quantized_linear_q8_parts,
        "quantized_linear_q8 over the parts of a fused weight, each on its own panels and type, x rounded once: their outputs "
        "side by side",
        py::arg("x"), py::arg("panels"), py::arg("qtypes"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("pack_q8_panels", &pack_q8_panels, "GGUF blocks as the panels quantized_linear_q8 reads (a group of rows side by side)");
  m.def("gguf_block_shape", &gguf_block_shape, "(values, bytes) of one stored block of a GGUF type the panels read; (0, 0) otherwise");
  m.def("interleave_gguf_rows", &interleave_gguf_rows, "the copy of GGUF blocks (8 rows interleaved) read for steps of 3+ rows");
  m.def("dequantize_gguf", &dequantize_gguf, "float32 values of GGUF blocks of any type the kernels read, as gguf dequantizes them");
  m.def("lora_add_", &lora_add_, "add each listed row's LoRA product (its group's adapter) to out, in place");
  m.def("int8_linear", &int8_linear,
        "(x * input_multipliers) @ (weight * weight_scales[:, None]).T (+ bias) in out_dtype, with the rows rounded to int8 "
        "at scales of their own and int32 sums (W8A8)",
        py::arg("x"), py::arg("weight"), py::arg("weight_scales"), py::arg("bias") = py::none(), py::arg("out_dtype"),
        py::arg("input_multipliers") = py::none());
  m.def("int8_linear_silu_and_mul", &int8_linear_silu_and_mul,
        "silu(gate) * up in float32 of int8_linear's product with a gate-up weight (gate's features, then up's), applied as "
        "its sums are scaled",
        py::arg("x"), py::arg("weight"), py::arg("weight_scales"), py::arg("input_multipliers") = py::none());
  m.def("bf16_dot_products", &bf16_dot_products, "whether this build multiplies bf16_pairs_linear on AVX-512 BF16 dot products or AMX tiles");
  m.def("bf16_matrix_tiles", &bf16_matrix_tiles, "whether bf16_pairs_linear runs on AMX tiles (the build has them and the OS granted them)");
  m.def("pack_bf16_pairs", &pack_bf16_pairs, "a [out_features, in_features] weight in bfloat16, packed for bf16_pairs_linear");
  m.def("pack_tile_blocks", &pack_tile_blocks,
        "GGUF Q4_0 / Q4_1 blocks [out_features, bytes a row] of a type id, repacked for bf16_pairs_linear: the same products as "
        "pack_bf16_pairs of the dequantized weight, a third of the bytes to read");
  m.def("bf16_pairs_linear", &bf16_pairs_linear,
        "x @ W.T in float32: x and W rounded to bfloat16, their products summed in float32 (W from pack_bf16_pairs or pack_tile_blocks), into out "
        "where given; on AMX tiles where bf16_matrix_tiles() and tiles",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("out") = py::none(), py::arg("tiles") = true);
  m.def("bf16_weights_vector", &bf16_weights_vector,
        "whether bf16_weights_linear runs on AVX-512 vectors here (elsewhere a scalar loop takes the same steps, far slower)");
  m.def("bf16_weights_linear", &bf16_weights_linear,
        "x @ W.T in float32: float32 x times the bfloat16 values of W (from pack_bf16_pairs), widened and summed in float32, "
        "into out where given",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("out") = py::none());
  py::class_<LlamaDecodeLayers>(m, "LlamaDecodeLayers",
                                "a Llama-family model's decoder layers on GGUF blocks (and AMX tiles), or on bfloat16 values, for a step of "
                                "decodes alone, in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("kv_format"))
      .def(
          "add_layer",
          [](LlamaDecodeLayers& self, at::Tensor input_norm, at::Tensor post_norm, const BlockLinearArgs& qkv, const BlockLinearArgs& o,
             const BlockLinearArgs& gate_up, const BlockLinearArgs& down, double k_scale, double v_scale, at::Tensor cos_cache,
             at::Tensor sin_cache, int64_t window, double softcap, bool gelu_tanh, c10::optional<at::Tensor> q_norm,
             c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> attention_out_norm, c10::optional<at::Tensor> mlp_out_norm) {
            self.add_layer({std::move(input_norm), std::move(post_norm), block_linear(qkv), block_linear(o), block_linear(gate_up),
                            block_linear(down), k_scale, v_scale, std::move(cos_cache), std::move(sin_cache), window, softcap, gelu_tanh,
                            q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()), attention_out_norm.value_or(at::Tensor()),
                            mlp_out_norm.value_or(at::Tensor())});
          },
          "the next layer: its norms' weights, its linear layers as (blocks, qtype, interleaved or None, the panels of its parts "
          "([] for none), their types, their output rows, blocks_max_rows, AMX tiles' bfloat16 pairs or None, out_features, "
          "whether those pairs are the weight's bfloat16 values, to multiply in float32), "
          "its KV cache's static scales (0: each row's own), "
          "its rotary table, its sliding window and soft cap (0: none), its MLP's activation, and the norms it has beyond "
          "Llama's (None: none)",
          py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
          py::arg("k_scale"), py::arg("v_scale"), py::arg("cos_cache"), py::arg("sin_cache"), py::arg("window") = 0,
          py::arg("softcap") = 0.0, py::arg("gelu_tanh") = false, py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
          py::arg("attention_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none())
      // Tensors only, converted before the call: the engine's other threads may run Python meanwhile.
      .def("forward", &LlamaDecodeLayers::forward, "(hidden, residual) after every layer", py::arg("hidden"), py::arg("residual"),
           py::arg("positions"), py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
           py::call_guard<py::gil_scoped_release>());
}
