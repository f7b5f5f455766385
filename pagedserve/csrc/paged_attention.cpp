// Paged attention for decodes on CPU: reads K/V straight from the block layout (no gather copy).
// One task per (sequence, KV head); the query heads that share that KV head (GQA) go together,
// so each key and value row is loaded once for all of them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// query [B, H, D]; key_cache/value_cache [num_blocks, block_size, KV, D]; block_tables [B, max_blocks];
// seq_lens [B]. Returns [B, H, D]. All float32 (int64 for tables and lengths), contiguous.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous tensors only");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(query);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_stride = num_kv_heads * head_dim;  // one token's K (or V) across heads
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = len_ptr[seq];
      const float* q = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
      const int64_t* table = table_ptr + seq * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const float* k = k_ptr + slot * row_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) scores[g * len + pos] = dot(q + g * head_dim, k, head_dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax per query head
        float* s = scores.data() + g * len;
        const float max_score = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) total += (s[pos] = std::exp(s[pos] - max_score));
        const float inv = 1.f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const float* v = v_ptr + slot * row_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + pos];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), out_ptr + (seq * num_heads + kv_head * group) * head_dim);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention for decodes (CPU, float32)");
}
