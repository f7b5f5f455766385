// The decoder layers of a Llama-family model (the Gemmas' included) for a step of decodes alone, in one call
// (decode_layers.cpp).
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

// A linear layer as Linear runs it on its GGUF blocks (QuantizedWeight) and, where it has them, on AMX tiles: steps of
// more than blocks_max_rows rows on the bfloat16 pairs (bf16_pairs_linear) where tile_pairs is given; on the blocks,
// integer products on input rounded to 8 bits where there are panels (one for each part of a layer whose parts come in
// types of their own), else float32 ones (on the interleaved copy from 3 rows, where there is one). Or, where
// values_of_pairs, a layer of no blocks whose tile_pairs are its weight's bfloat16 values (BFloat16ValuesWeight): every
// step on them, in float32 (bf16_weights_linear).
struct BlockLinear {
  at::Tensor blocks;
  int64_t qtype;
  c10::optional<at::Tensor> interleaved;
  std::vector<at::Tensor> panels;
  std::vector<int64_t> panel_types, panel_rows;
  int64_t blocks_max_rows;
  c10::optional<at::Tensor> tile_pairs;
  int64_t out_features;
  bool values_of_pairs;
  at::Tensor operator()(const at::Tensor& x) const;
  // What a step of `rows` rows multiplies: bfloat16 on the tiles (an input that comes in it is read in place, the same
  // product as float32 rounded), float32 on the blocks and on bfloat16 values.
  at::ScalarType input_dtype(int64_t rows) const;

 private:
  bool on_tiles(int64_t rows) const { return !values_of_pairs && rows > blocks_max_rows && tile_pairs.has_value(); }
};

struct DecoderLayerWeights {
  at::Tensor input_norm, post_norm;  // the norms of attention's input and of the MLP's (each after the residual's add)
  BlockLinear qkv, o, gate_up, down;
  double k_scale, v_scale;  // the KV cache's static scales; 0: each row's own
  at::Tensor cos_cache, sin_cache;  // the layer's rotary table
  int64_t window;  // a sliding window's keys; 0: full attention
  double softcap;  // the scores' soft cap; 0: none
  bool gelu_tanh;  // the MLP's activation: GELU (tanh) and mul, else SiLU and mul
  // Where defined (else none): the norms of each head's q and k (Gemma 3's), and of what attention and the MLP give
  // before it joins the residual stream (Gemma 2's and 3's).
  at::Tensor q_norm, k_norm, attention_out_norm, mlp_out_norm;
};

class LlamaDecodeLayers {
 public:
  LlamaDecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t kv_format);
  void add_layer(DecoderLayerWeights layer);
  // hidden [rows, hidden size] and the residual stream (none before the first layer) through every layer, each with
  // its cache [2, blocks, block size, KV heads, head dim]; returns (hidden, residual) as the last layer leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, c10::optional<at::Tensor> residual, const at::Tensor& positions,
                                             const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables, const at::Tensor& seq_lens) const;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t kv_format_;
  std::vector<DecoderLayerWeights> layers_;
};
