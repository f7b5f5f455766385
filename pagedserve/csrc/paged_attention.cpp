// Paged attention for decodes on CPU: reads K/V straight from the block layout (no gather copy).
// One task per sequence, all its heads together: a block's K (then V) rows for every KV head are one
// contiguous 12 KB run at the default shapes, which the hardware prefetcher streams; a task per
// (sequence, KV head) read 256-byte pieces at a 768-byte stride and ran ~30% slower with the cache
// cold. Blocks are visited once with an online softmax (running max and sum per query head), so K
// and V of a block are read together and no per-position score buffer outlives the block. The
// sequences are split between threads by context length, so one long sequence does not leave a
// thread idle behind many short ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxBlockSize = 256;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    const __m256 s = _mm256_add_ps(s0, s1);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
    return _mm_cvtss_f32(r);
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[d] = acc[d] * rescale + sum_i p[i] * rows[i * stride + d], for the n rows of one block.
inline void scale_and_accumulate(float* __restrict acc, float rescale, const float* p, const float* rows, int64_t n,
                                 int64_t stride, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim == 64) {  // the common head size: the accumulator lives in eight registers for the whole block
    const __m256 c = _mm256_set1_ps(rescale);
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc), c), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + 8), c);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + 16), c), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + 24), c);
    __m256 a4 = _mm256_mul_ps(_mm256_loadu_ps(acc + 32), c), a5 = _mm256_mul_ps(_mm256_loadu_ps(acc + 40), c);
    __m256 a6 = _mm256_mul_ps(_mm256_loadu_ps(acc + 48), c), a7 = _mm256_mul_ps(_mm256_loadu_ps(acc + 56), c);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = rows + i * stride;
      const __m256 w = _mm256_set1_ps(p[i]);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
      a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
      a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
      a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
      a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(acc, a0), _mm256_storeu_ps(acc + 8, a1), _mm256_storeu_ps(acc + 16, a2), _mm256_storeu_ps(acc + 24, a3);
    _mm256_storeu_ps(acc + 32, a4), _mm256_storeu_ps(acc + 40, a5), _mm256_storeu_ps(acc + 48, a6), _mm256_storeu_ps(acc + 56, a7);
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
  for (int64_t i = 0; i < n; ++i) {
    const float* v = rows + i * stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[i] * v[d];
  }
}

// s[i] = exp(s[i] - max) for the n scores of a block; returns their sum. Vectorized: a scalar exp
// per score was a fifth of the kernel's time.
inline float exp_and_sum(float* s, int64_t n, float max) {
  using Vec = at::vec::Vectorized<float>;
  const Vec vmax(max);
  Vec vsum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(s + i) - vmax).exp();
    e.store(s + i);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - max));
  return sum;
}

struct AttentionShape {
  int64_t num_heads, group, head_dim, block_size, row_stride, block_stride;
  float scale;
};

struct SequenceScratch {
  std::vector<float> q, acc, scores, running_max, running_sum;
  explicit SequenceScratch(const AttentionShape& s)
      : q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), scores(s.num_heads * s.block_size),
        running_max(s.num_heads), running_sum(s.num_heads) {}
};

// Folds one block of n keys/values into every head's running softmax and accumulator.
void attend_block(const AttentionShape& s, const float* k_block, const float* v_block, int64_t n, SequenceScratch& w) {
  for (int64_t i = 0; i < n; ++i) {
    const float* k_row = k_block + i * s.row_stride;
    for (int64_t h = 0; h < s.num_heads; ++h)
      w.scores[h * s.block_size + i] = dot(w.q.data() + h * s.head_dim, k_row + (h / s.group) * s.head_dim, s.head_dim);
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    float* scores = w.scores.data() + h * s.block_size;
    const float block_max = *std::max_element(scores, scores + n);
    const float new_max = std::max(w.running_max[h], block_max);
    const float rescale = std::exp(w.running_max[h] - new_max);  // 0 on the first block
    const float block_sum = exp_and_sum(scores, n, new_max);
    w.running_sum[h] = w.running_sum[h] * rescale + block_sum;
    w.running_max[h] = new_max;
    scale_and_accumulate(w.acc.data() + h * s.head_dim, rescale, scores, v_block + (h / s.group) * s.head_dim, n, s.row_stride,
                         s.head_dim);
  }
}

// out[h] = softmax(q[h] . K^T * scale) V over the len tokens in the blocks of table, for every head h.
void attend_sequence(const AttentionShape& s, const float* q_in, const float* k_cache, const float* v_cache, const int64_t* table,
                     int64_t len, float* out, SequenceScratch& w) {
  const int64_t qdim = s.num_heads * s.head_dim;
  for (int64_t i = 0; i < qdim; ++i) w.q[i] = q_in[i] * s.scale;
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.running_max.begin(), w.running_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.running_sum.begin(), w.running_sum.end(), 0.f);
  const int64_t num_blocks = (len + s.block_size - 1) / s.block_size;
  for (int64_t b = 0; b < num_blocks; ++b)
    attend_block(s, k_cache + table[b] * s.block_stride, v_cache + table[b] * s.block_stride,
                 std::min(s.block_size, len - b * s.block_size), w);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float inv = 1.f / w.running_sum[h];
    for (int64_t d = 0; d < s.head_dim; ++d) out[h * s.head_dim + d] = w.acc[h * s.head_dim + d] * inv;
  }
}

// Boundaries of `parts` contiguous ranges of sequences holding about equal numbers of context tokens.
std::vector<int64_t> split_by_context(const int64_t* lens, int64_t num_seqs, int64_t parts) {
  std::vector<int64_t> bounds{0};
  const int64_t total = std::accumulate(lens, lens + num_seqs, int64_t{0});
  int64_t seen = 0;
  for (int64_t seq = 0; seq < num_seqs && static_cast<int64_t>(bounds.size()) < parts; ++seq) {
    seen += lens[seq];
    if (seen * parts >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(seq + 1);
  }
  if (bounds.back() != num_seqs) bounds.push_back(num_seqs);
  return bounds;
}

}  // namespace

// query [B, H, D]; key_cache/value_cache [num_blocks, block_size, KV, D]; block_tables [B, max_blocks];
// seq_lens [B]. Returns [B, H, D]. All float32 (int64 for tables and lengths), contiguous.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dtype() == at::kFloat && key_cache.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous tensors only");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(block_size <= kMaxBlockSize, "block_size must be <= ", kMaxBlockSize);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = at::empty_like(query);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_stride = num_kv_heads * head_dim;  // one token's K (or V) across heads
  const int64_t block_stride = block_size * row_stride;
  const float fscale = static_cast<float>(scale);

  const AttentionShape shape{num_heads, group, head_dim, block_size, row_stride, block_stride, fscale};
  const std::vector<int64_t> bounds = split_by_context(len_ptr, num_seqs, std::min<int64_t>(at::get_num_threads(), num_seqs));
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    SequenceScratch scratch(shape);
    for (int64_t part = begin; part < end; ++part)
      for (int64_t seq = bounds[part]; seq < bounds[part + 1]; ++seq)
        attend_sequence(shape, q_ptr + seq * num_heads * head_dim, k_ptr, v_ptr, table_ptr + seq * max_blocks, len_ptr[seq],
                        out_ptr + seq * num_heads * head_dim, scratch);
  });
  return out;
}

// key/value [T, KV, D] (any token and head strides, rows contiguous) -> key_cache/value_cache
// [num_blocks, block_size, KV, D] at the flat slots of slot_mapping [T]. index_copy_ takes ~100 us a
// call for a decode batch (a generic strided loop); this is a copy of T rows.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(slot_mapping.numel() == num_tokens && key_cache.size(2) == num_kv_heads && key_cache.size(3) == head_dim,
              "shapes of key, cache and slot_mapping disagree");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (num_tokens > 0) {
    const auto [low, high] = std::minmax_element(slots, slots + num_tokens);
    TORCH_CHECK(*low >= 0 && *high < num_slots, "slot ", *high, " outside the cache of ", num_slots, " slots (or ", *low, " < 0)");
  }
  const int64_t row = num_kv_heads * head_dim;
  const at::Tensor sources[2] = {key, value};
  float* caches[2] = {key_cache.data_ptr<float>(), value_cache.data_ptr<float>()};
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& src = sources[which];
    const float* src_ptr = src.data_ptr<float>();
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        std::memcpy(caches[which] + slots[t] * row + h * head_dim, src_ptr + t * src.stride(0) + h * src.stride(1),
                    head_dim * sizeof(float));
  }
}
