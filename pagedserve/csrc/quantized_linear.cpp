// Linear layer on weights kept in their GGUF block format (Q4_0, Q4_1, Q8_0), dequantized on the fly.
//
// A decode step is bound by reading the weights, and float32 weights are 7x the bytes of Q4_1 ones.
// Each task dequantizes a few output rows of the weight into a small float32 buffer that stays in L1
// (the values are bit-identical to gguf-py's dequantization: d*q is exact in float32, so one fused
// multiply-add rounds like numpy's multiply-then-add) and takes their dot products with the input
// rows. The input is walked in chunks of rows that stay in L2, so a long prefill is not re-streamed
// from memory for every few output rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockValues = 32;
// gguf's GGMLQuantizationType ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
// Input rows x weight rows of one register tile: 4 x 3 accumulators plus three weight vectors and one
// input vector fill the 16 AVX2 registers.
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 3;
// Weight rows dequantized together: each input tile, once in L1, meets all of them.
constexpr int64_t kRowsPerGroup = 4 * kTileCols;
// Input rows per chunk: 64 rows of K <= 2048 floats stay in a 1 MiB L2.
constexpr int64_t kChunkRows = 64;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// The 32 values of one block in four registers. Q4: nibble i of byte i is value i (low) or i + 16
// (high), value = d * q + m (Q4_0: m = -8d; d*q and -8d are exact, so this is d * (q - 8)).
inline void block_values(const uint8_t* block, int64_t qtype, __m256 v[4]) {
  const __m256 vd = _mm256_set1_ps(half_at(block));
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))), vd);
    return;
  }
  const bool has_min = qtype == kQ4_1;
  const __m256 vm = has_min ? _mm256_set1_ps(half_at(block + 2)) : _mm256_mul_ps(vd, _mm256_set1_ps(-8.f));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (has_min ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), vd, vm);
  v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), vd, vm);
  v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), vd, vm);
  v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), vd, vm);
}
#endif

void dequantize_block(const uint8_t* block, int64_t qtype, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v[4];
  block_values(block, qtype, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, v[i]);
#else
  const float d = half_at(block);
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
    return;
  }
  const bool has_min = qtype == kQ4_1;
  const float m = has_min ? half_at(block + 2) : -8.f * d;
  const uint8_t* q = block + (has_min ? 4 : 2);
  for (int i = 0; i < 16; ++i) {
    out[i] = std::fma(static_cast<float>(q[i] & 0x0F), d, m);
    out[i + 16] = std::fma(static_cast<float>(q[i] >> 4), d, m);
  }
#endif
}

void dequantize_row(const uint8_t* row, int64_t qtype, int64_t num_blocks, float* out) {
  const int64_t stride = quantized_block_bytes(qtype);
  for (int64_t b = 0; b < num_blocks; ++b) dequantize_block(row + b * stride, qtype, out + b * kBlockValues);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}
#endif

// out[i * out_stride + j] = dot(x row i, w row j) + bias[j], for MR input rows and NR weight rows of length k.
template <int MR, int NR>
void dot_tile(const float* x, int64_t x_stride, const float* w, int64_t k, const float* bias, float* out, int64_t out_stride) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * k + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * x_stride + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * out_stride + j] = horizontal_sum(acc[i][j]) + (bias ? bias[j] : 0.f);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float sum = 0.f;
      for (int64_t p = 0; p < k; ++p) sum += x[i * x_stride + p] * w[j * k + p];
      out[i * out_stride + j] = sum + (bias ? bias[j] : 0.f);
    }
#endif
}

template <int MR>
void tile_times_group(const float* x, int64_t k, const float* w, int64_t count, const float* bias, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + kTileCols <= count; j += kTileCols)
    dot_tile<MR, kTileCols>(x, k, w + j * k, k, bias ? bias + j : nullptr, out + j, n);
  if (count - j == 2) dot_tile<MR, 2>(x, k, w + j * k, k, bias ? bias + j : nullptr, out + j, n);
  if (count - j == 1) dot_tile<MR, 1>(x, k, w + j * k, k, bias ? bias + j : nullptr, out + j, n);
}

// out[rows, count] (row stride n) = x[rows, k] times the count dequantized weight rows in w.
void rows_times_group(const float* x, int64_t rows, int64_t k, const float* w, int64_t count, const float* bias, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kTileRows <= rows; i += kTileRows) tile_times_group<kTileRows>(x + i * k, k, w, count, bias, out + i * n, n);
  switch (rows - i) {
    case 3: tile_times_group<3>(x + i * k, k, w, count, bias, out + i * n, n); break;
    case 2: tile_times_group<2>(x + i * k, k, w, count, bias, out + i * n, n); break;
    case 1: tile_times_group<1>(x + i * k, k, w, count, bias, out + i * n, n); break;
    default: break;
  }
}

// One or two input rows (batch-1/2 decodes): each block is dequantized in registers and multiplied in
// at once, with four accumulators per input row so the FMAs do not wait on each other.
template <int MR>
void few_rows_times_weight_rows(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t qtype,
                                int64_t first, int64_t last, const float* bias, float* out, int64_t n) {
  const int64_t stride = quantized_block_bytes(qtype), num_blocks = k / kBlockValues;
  for (int64_t r = first; r < last; ++r) {
    const uint8_t* row = w + r * row_bytes;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 v[4];
      block_values(row + b * stride, qtype, v);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + b * kBlockValues + 8 * j), v[j], acc[i][j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
      out[i * n + r] = horizontal_sum(sum) + (bias ? bias[r] : 0.f);
    }
#else
    float values[kBlockValues];
    float sums[MR] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequantize_block(row + b * stride, qtype, values);
      for (int i = 0; i < MR; ++i)
        for (int p = 0; p < kBlockValues; ++p) sums[i] += x[i * k + b * kBlockValues + p] * values[p];
    }
    for (int i = 0; i < MR; ++i) out[i * n + r] = sums[i] + (bias ? bias[r] : 0.f);
#endif
  }
}

}  // namespace

int64_t quantized_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // fp16 d, 16 bytes of nibbles
    case kQ4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // fp16 d, 32 int8
    default: return 0;
  }
}

// x [M, K] float32; weight [N, K / 32 * block_bytes] uint8 (GGUF blocks, one output row per row);
// bias [N] float32 or undefined. Returns x @ dequantized(weight).T + bias, [M, N].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  const int64_t bytes = quantized_block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "unsupported GGUF quantization type id ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(k % kBlockValues == 0 && weight.size(1) == k / kBlockValues * bytes, "weight rows of ", weight.size(1),
              " bytes do not hold ", k, " values of this type");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(), "bias must be float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1), num_blocks = k / kBlockValues;
  if (m <= 2) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      if (m == 1) few_rows_times_weight_rows<1>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
      else few_rows_times_weight_rows<2>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
    });
    return out;
  }
  const int64_t num_groups = (n + kRowsPerGroup - 1) / kRowsPerGroup;

  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kRowsPerGroup * k);
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, m - chunk);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * kRowsPerGroup, count = std::min(kRowsPerGroup, n - first);
        for (int64_t r = 0; r < count; ++r) dequantize_row(w_ptr + (first + r) * row_bytes, qtype, num_blocks, w.data() + r * k);
        const float* x_rows = x_ptr + chunk * k;
        const float* b = bias_ptr ? bias_ptr + first : nullptr;
        float* o = out_ptr + chunk * n + first;
        rows_times_group(x_rows, rows, k, w.data(), count, b, o, n);
      }
    }
  });
  return out;
}

// The float32 values of GGUF blocks [N, K / 32 * block_bytes] -> [N, K] (for embedding lookups and checks).
at::Tensor dequantize_gguf(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = quantized_block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "unsupported GGUF quantization type id ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  TORCH_CHECK(weight.size(1) % bytes == 0, "rows of ", weight.size(1), " bytes are not whole blocks of ", bytes);
  const int64_t n = weight.size(0), num_blocks = weight.size(1) / bytes, k = num_blocks * kBlockValues;
  auto out = at::empty({n, k}, weight.options().dtype(at::kFloat));
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(w_ptr + r * weight.size(1), qtype, num_blocks, out_ptr + r * k);
  });
  return out;
}
