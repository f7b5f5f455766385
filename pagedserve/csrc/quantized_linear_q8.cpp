// Linear layer on GGUF Q4_0 / Q4_1 / Q8_0 blocks with the activations rounded to 8 bits, a scale for each 32 values
// (the Q8 rounding llama.cpp and vLLM's GGUF kernels apply), so that a block's products are integer dot products.
//
// Turning a block's 32 values into float32 takes more instructions than reading its bytes from memory does time, so
// the float32 kernel (quantized_linear.cpp) is bound by that conversion on processors without wide vector units.
// Here the block's values stay bytes: with x's block rounded to q_x at scale d_x, and the weight's value written as
// d * c + o with c centred on 0 (below),
//   sum_j x_j (d c_j + o)  ~  d * d_x * sum_j c_j q_x,j  +  o * sum_j x_j,
// an integer dot product of 32 byte pairs (maddubs + madd on AVX2, dpbusd with VNNI) and one multiply-add; the sum
// of x over the block is kept exact, so only the rounding of x to q_x departs from the float32 product.
//
// Each output is accumulated over the blocks in order, the same whatever rows come with it: a row's product does not
// depend on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gguf_block.h"
#include "ops.h"
#include "vec_lanes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Input rows a task multiplies together by each weight row: their 4 accumulators, the weight's bytes and the
// products fit the 16 AVX2 registers, and the weight's unpacking is shared by the 4.
constexpr int64_t kRowTile = 4;

// x's rows rounded per block of 32 values: q = nearbyint(x * 127 / max|x|) (symmetric, so -q is always an int8),
// with the block's scale max|x| / 127, its exact sum and the sum of its q.
struct RoundedRows {
  std::vector<int8_t> values;
  std::vector<float> scales, sums;
  std::vector<int32_t> value_sums;
};

RoundedRows round_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t num_blocks = rows * (k / kBlockValues);
  RoundedRows rounded{std::vector<int8_t>(rows * k), std::vector<float>(num_blocks), std::vector<float>(num_blocks),
                      std::vector<int32_t>(num_blocks)};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* in = x + b * kBlockValues;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < kBlockValues; ++j) {
      amax = std::max(amax, std::fabs(in[j]));
      sum += in[j];
    }
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t value_sum = 0;
    for (int64_t j = 0; j < kBlockValues; ++j) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(in[j] * inverse));
      rounded.values[b * kBlockValues + j] = q;
      value_sum += q;
    }
    rounded.scales[b] = amax / 127.f;
    rounded.sums[b] = sum;
    rounded.value_sums[b] = value_sum;
  }
  return rounded;
}

// A weight block as value = d * c + offset with c centred: q - 8 for Q4 (offset m + 8d: Q4_0's is 0), q for Q8_0.
// Centred values keep x's rounding error from being multiplied by the nibbles' mean.
struct CentredBlock {
  float d, offset;
};

inline CentredBlock centred(const uint8_t* block, int64_t qtype) {
  const float d = half_at(block);
  return {d, qtype == kQ4_1 ? half_at(block + 2) + 8.f * d : 0.f};
}

#if defined(__AVX2__) && defined(__FMA__)
// The block's 32 values as bytes in value order: unsigned nibbles q for Q4, signed bytes for Q8_0.
inline __m256i block_bytes(const uint8_t* block, int64_t qtype) {
  if (qtype == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles_of(block, qtype)));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

// Eight int32 partial sums of the 32 products of unsigned bytes u and signed bytes s (|s| <= 127, so no pair of
// products saturates maddubs' int16).
inline __m256i unsigned_dot(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Eight int32 lanes summing to sum_j c_j x_j for weight bytes w (block_bytes) and x's bytes, whose sum is x_sum: a Q4
// block's sum of q x less 8 x_sum (-x_sum in each lane), a Q8_0 block's |w| times x with w's sign.
inline __m256i centred_dot(__m256i w, __m256i x, int32_t x_sum, int64_t qtype) {
  if (qtype == kQ8_0) return unsigned_dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_sub_epi32(unsigned_dot(w, x), _mm256_set1_epi32(x_sum));
}

#else
// c_j of a block (centred above).
inline int32_t centred_value(const uint8_t* block, int64_t qtype, int64_t j) {
  if (qtype == kQ8_0) return static_cast<int8_t>(block[2 + j]);
  const uint8_t* q = nibbles_of(block, qtype);
  return (j < 16 ? q[j] & 0x0F : q[j - 16] >> 4) - 8;
}
#endif

// Whether the rows are fetched ahead (fetch_row): where their products take less time than their bytes take to come
// from memory (a Q8_0 row: 34 bytes a block of 32 values; a Q4 row where VNNI's dpbusd multiplies its bytes). With
// AVX2's maddubs and madd a Q4 row is bound by its unpacking and products instead, and fetching ahead slowed it.
constexpr bool fetches_ahead(int64_t qtype) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return qtype == kQ8_0;
#endif
}

// Blocks go to two accumulators in turn (even, odd) so that one block's multiply-add does not wait on the previous
// one's; every row takes the same order, whatever rows come with it.
constexpr int kChains = 2;

// out[i * n + r] for weight rows r in [first, last) and the MR input rows starting at `row` of `rounded`.
template <int MR, int64_t qtype>
void rows_times_weight_rows(const RoundedRows& rounded, int64_t row, int64_t k, const uint8_t* w, int64_t row_bytes,
                            int64_t first, int64_t last, const float* bias, float* out, int64_t n) {
  const int64_t stride = quantized_block_bytes(qtype), num_blocks = k / kBlockValues;
  const int8_t* xq = rounded.values.data() + row * k;
  const float* xd = rounded.scales.data() + row * num_blocks;
  const float* xs = rounded.sums.data() + row * num_blocks;
  const int32_t* xqs = rounded.value_sums.data() + row * num_blocks;
  for (int64_t r = first; r < last; ++r) {
    const uint8_t* weight_row = w + r * row_bytes;
    float offsets[MR][kChains] = {};
#if defined(__AVX2__) && defined(__FMA__)
    if (fetches_ahead(qtype) && r + kFetchAheadRows < last) fetch_row(weight_row + kFetchAheadRows * row_bytes, row_bytes);
    __m256 acc[MR][kChains];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < kChains; ++c) acc[i][c] = _mm256_setzero_ps();
    // Block b into chain c (a constant in each call, so the accumulators stay in registers).
    const auto add_block = [&](int64_t b, int c) __attribute__((always_inline)) {
      const uint8_t* block = weight_row + b * stride;
      const CentredBlock weight = centred(block, qtype);
      const __m256i wv = block_bytes(block, qtype);
      for (int i = 0; i < MR; ++i) {
        const int64_t xb = i * num_blocks + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * k + b * kBlockValues));
        const __m256 sums = _mm256_cvtepi32_ps(centred_dot(wv, xv, xqs[xb], qtype));
        acc[i][c] = _mm256_fmadd_ps(sums, _mm256_set1_ps(weight.d * xd[xb]), acc[i][c]);
        if constexpr (qtype != kQ8_0) offsets[i][c] += weight.offset * xs[xb];  // a Q8_0 block's offset is 0
      }
    };
    int64_t b = 0;
    for (; b + kChains <= num_blocks; b += kChains) {
      add_block(b, 0);
      add_block(b + 1, 1);
    }
    if (b < num_blocks) add_block(b, 0);
    for (int i = 0; i < MR; ++i)
      out[i * n + r] = horizontal_sum(_mm256_add_ps(acc[i][0], acc[i][1])) + (offsets[i][0] + offsets[i][1]) + (bias ? bias[r] : 0.f);
#else
    float acc[MR][kChains] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int c = b % kChains;
      const uint8_t* block = weight_row + b * stride;
      const CentredBlock weight = centred(block, qtype);
      for (int i = 0; i < MR; ++i) {
        const int64_t xb = i * num_blocks + b;
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlockValues; ++j) sum += centred_value(block, qtype, j) * xq[i * k + b * kBlockValues + j];
        acc[i][c] += static_cast<float>(sum) * (weight.d * xd[xb]);
        offsets[i][c] += weight.offset * xs[xb];
      }
    }
    for (int i = 0; i < MR; ++i) out[i * n + r] = (acc[i][0] + acc[i][1]) + (offsets[i][0] + offsets[i][1]) + (bias ? bias[r] : 0.f);
#endif
  }
}

// rows_times_weight_rows for a tile of 1 to kRowTile input rows.
template <int64_t qtype>
void rows_of_type(int64_t rows, const RoundedRows& rounded, int64_t row, int64_t k, const uint8_t* w, int64_t row_bytes,
                  int64_t first, int64_t last, const float* bias, float* out, int64_t n) {
  switch (rows) {
    case 4: rows_times_weight_rows<4, qtype>(rounded, row, k, w, row_bytes, first, last, bias, out, n); break;
    case 3: rows_times_weight_rows<3, qtype>(rounded, row, k, w, row_bytes, first, last, bias, out, n); break;
    case 2: rows_times_weight_rows<2, qtype>(rounded, row, k, w, row_bytes, first, last, bias, out, n); break;
    default: rows_times_weight_rows<1, qtype>(rounded, row, k, w, row_bytes, first, last, bias, out, n); break;
  }
}

}  // namespace

// x [M, K] float32; weight [N, K / 32 * block_bytes] uint8 (GGUF blocks); bias [N] float32 or undefined. Returns
// x @ dequantized(weight).T + bias, [M, N], with x rounded to 8 bits per block of 32 values.
at::Tensor quantized_linear_q8(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  const float* bias_ptr = checked_linear_args(x, weight, qtype, bias);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({m, n}, x.options());
  const RoundedRows rounded = round_rows(x.data_ptr<float>(), m, k);
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  // Each task takes a range of weight rows for every input row, a tile of input rows at a time: its weight rows stay in
  // the cache while the tiles pass.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = 0; row < m; row += kRowTile) {
      const int64_t rows = std::min(kRowTile, m - row);
      float* o = out_ptr + row * n;
      if (qtype == kQ4_0) rows_of_type<kQ4_0>(rows, rounded, row, k, w_ptr, row_bytes, begin, end, bias_ptr, o, n);
      else if (qtype == kQ4_1) rows_of_type<kQ4_1>(rows, rounded, row, k, w_ptr, row_bytes, begin, end, bias_ptr, o, n);
      else rows_of_type<kQ8_0>(rows, rounded, row, k, w_ptr, row_bytes, begin, end, bias_ptr, o, n);
    }
  });
  return out;
}
