// The decoder layers of a Llama-family model for a step of decodes alone, in one call from Python: the same kernels on
// the same arguments, in the same order, as the layers' modules run them (models/native_decode.py says which models
// and steps), so the results are the same bits. A decode step of a few rows of a small model spends longer in the
// interpreter between its kernels than in them on a slow core; here nothing runs between them but their own dispatch.
#include "decode_layers.h"

#include <utility>

#include "ops.h"

at::Tensor BlockLinear::operator()(const at::Tensor& x) const {
  const int64_t rows = x.size(0);
  if (values_of_pairs) return bf16_weights_linear(x, *tile_pairs, out_features, c10::nullopt);
  if (on_tiles(rows)) return bf16_pairs_linear(x, *tile_pairs, out_features, c10::nullopt, true);
  if (!panels.empty()) return quantized_linear_q8_parts(x, panels, panel_types, panel_rows);
  return quantized_linear(x, blocks, qtype, c10::nullopt, interleaved);
}

at::ScalarType BlockLinear::input_dtype(int64_t rows) const { return on_tiles(rows) ? at::kBFloat16 : at::kFloat; }

LlamaDecodeLayers::LlamaDecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                                     int64_t kv_format)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), kv_format_(kv_format) {}

namespace {

// The gated MLP's activation of the gate-up GEMM's output, as layers/activation.py computes it.
at::Tensor activation_and_mul(const DecoderLayerWeights& layer, const at::Tensor& gate_up, at::ScalarType out_dtype) {
  if (!layer.gelu_tanh) return silu_and_mul(gate_up, out_dtype);
  const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
  return (at::gelu(halves[0], "tanh") * halves[1]).to(out_dtype);
}

// x through norm where the layer has it, as RMSNorm gives it to the residual's add (float32).
at::Tensor maybe_norm(const at::Tensor& x, const at::Tensor& norm, double eps) {
  return norm.defined() ? rms_norm(x, norm, eps, at::kFloat) : x;
}

}  // namespace

void LlamaDecodeLayers::add_layer(DecoderLayerWeights layer) { layers_.push_back(std::move(layer)); }

std::tuple<at::Tensor, at::Tensor> LlamaDecodeLayers::forward(at::Tensor hidden, c10::optional<at::Tensor> residual,
                                                              const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
                                                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                              const at::Tensor& seq_lens) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer: ", layers_.size(), " layers, ", kv_caches.size(), " caches");
  const int64_t rows = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  at::Tensor sum = residual.has_value() ? *residual : at::Tensor();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    if (sum.defined()) {
      std::tie(hidden, sum) = add_rms_norm(hidden, sum, layer.input_norm, eps_, layer.qkv.input_dtype(rows));
    } else {
      sum = hidden;
      hidden = rms_norm(hidden, layer.input_norm, eps_, layer.qkv.input_dtype(rows));
    }
    const at::Tensor qkv = layer.qkv(hidden);
    const at::Tensor query = maybe_norm(qkv.narrow(1, 0, q_size).reshape({rows, num_heads_, head_dim_}), layer.q_norm, eps_);
    const at::Tensor key = maybe_norm(qkv.narrow(1, q_size, kv_size).reshape({rows, num_kv_heads_, head_dim_}), layer.k_norm, eps_);
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).reshape({rows, num_kv_heads_, head_dim_});
    rotary_embedding(positions, query, key, layer.cos_cache, layer.sin_cache);
    const at::Tensor key_cache = kv_caches[i].select(0, 0), value_cache = kv_caches[i].select(0, 1);
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_format_, layer.k_scale, layer.v_scale);
    const at::Tensor attended = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale_, kv_format_,
                                                       layer.window, layer.softcap);
    const at::Tensor attention_out = maybe_norm(layer.o(attended.view({rows, -1})), layer.attention_out_norm, eps_);
    std::tie(hidden, sum) = add_rms_norm(attention_out, sum, layer.post_norm, eps_, layer.gate_up.input_dtype(rows));
    hidden = layer.down(activation_and_mul(layer, layer.gate_up(hidden), layer.down.input_dtype(rows)));
    hidden = maybe_norm(hidden, layer.mlp_out_norm, eps_);
  }
  return {hidden, sum};
}
