// The CPU kernels of pagedserve, bound to Python in bindings.cpp.
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

// kv_format: 0 for a float32, bfloat16 or float16 cache; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 for a byte cache of 8-bit rows
// (layers/attention/kv_quant.py). window: a sliding-window layer's, the most keys a query attends to (itself and those
// just before it); 0 for full causal attention. softcap: a soft cap of the scaled scores, cap * tanh(score / cap) (Gemma
// 2's); 0 for none.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t kv_format, int64_t window = 0, double softcap = 0);
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, at::Tensor out, int64_t kv_format, int64_t window = 0,
                             double softcap = 0, bool bf16_products = false);
bool prefill_bf16_products();
// RMSNorm's output in out_dtype: float32, or bfloat16 for a GEMM that multiplies it (layer_ops.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType out_dtype);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                                                at::ScalarType out_dtype);
at::Tensor silu_and_mul(const at::Tensor& gate_up, c10::optional<at::ScalarType> out_dtype = c10::nullopt);
at::Tensor argmax_rows(const at::Tensor& x);
int64_t argmax_row(const float* x, int64_t n);  // torch.argmax of one row of n floats
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& counters);
void apply_penalties_(at::Tensor logits, const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& prompt_lens,
                      const at::Tensor& presence, const at::Tensor& frequency, const at::Tensor& repetition);
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows);
void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache);
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& interleaved);
// quantized_linear's product with x rounded to 8 bits per block of 32 values, on the blocks' panels (pack_q8_panels:
// a group of rows side by side; quantized_linear_q8.cpp).
at::Tensor quantized_linear_q8(const at::Tensor& x, const at::Tensor& panels, int64_t qtype, int64_t out_features,
                               const c10::optional<at::Tensor>& bias = c10::nullopt);
// The same for the parts of a fused weight, each in its own type: their outputs side by side.
at::Tensor quantized_linear_q8_parts(const at::Tensor& x, const std::vector<at::Tensor>& panels, const std::vector<int64_t>& qtypes,
                                     const std::vector<int64_t>& out_features, const c10::optional<at::Tensor>& bias = c10::nullopt);
at::Tensor pack_q8_panels(const at::Tensor& weight, int64_t qtype);
// (values, bytes) of one stored block of a GGUF type the panels read; (0, 0) for any other.
std::tuple<int64_t, int64_t> gguf_block_shape(int64_t qtype);
at::Tensor interleave_gguf_rows(const at::Tensor& weight, int64_t qtype);
at::Tensor dequantize_gguf(const at::Tensor& weight, int64_t qtype);
at::Tensor dequantize_kv_rows(const at::Tensor& rows, int64_t kv_format);
int64_t prefill_lanes();
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping, int64_t kv_format, double k_scale, double v_scale);
// out[rows[i]] += x[rows[i]] · A · B for each row listed, with the A and B of its group's adapter (lora.cpp).
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& groups, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& adapters, const at::Tensor& parts);
// int8 GEMMs with a scale per activation row and per weight row (int8_gemm.cpp).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scales,
                       const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                       const c10::optional<at::Tensor>& input_multipliers);
// silu(gate) * up of the int8 product of a gate-up weight (gate's output features first, then up's), in float32.
at::Tensor int8_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scales,
                                    const c10::optional<at::Tensor>& input_multipliers);
// x @ W.T in float32 from bfloat16 products, W packed once into pairs along k (bf16_gemm.cpp).
bool bf16_dot_products();
bool bf16_matrix_tiles();
at::Tensor pack_bf16_pairs(const at::Tensor& weight);
// GGUF Q4_0 / Q4_1 blocks [out_features, bytes a row] repacked for bf16_pairs_linear, which dequantizes them to the
// pairs pack_bf16_pairs makes of the dequantized weight (tile_blocks.cpp).
at::Tensor pack_tile_blocks(const at::Tensor& weight, int64_t qtype);
at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& out,
                             bool tiles);
// x @ W.T in float32 of float32 x and a pack_bf16_pairs weight's values, on AVX-512 FMAs where bf16_weights_vector().
bool bf16_weights_vector();
at::Tensor bf16_weights_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& out);
// Causal attention of count fresh sequences of one length side by side ([count * length, heads, head_dim] bfloat16),
// on the AMX tiles where fresh_attention_on_tiles(head_dim) (fresh_attention.cpp).
bool fresh_attention_on_tiles(int64_t head_dim);
at::Tensor fresh_causal_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t count,
                                  double scale);
// Thread i of torch's OpenMP threads (the caller is 0) may run on cpus_of_thread[i] only; torch's thread count becomes
// its length.
void set_thread_cpus(const std::vector<std::vector<int64_t>>& cpus_of_thread);
// Seconds one turn of an OpenMP thread's spin (an x86 pause) takes on this processor; 0 where there is no pause.
double spin_pause_seconds();
// The byte multiply-adds (unsigned by signed) iterations turns of the vector units' widest such instruction do on
// num_threads threads, in registers (int8_peak.cpp); 0 where the processor has none.
int64_t int8_vector_products(int64_t iterations, int64_t num_threads);
