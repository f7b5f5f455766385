// Linear layer on weights kept in their GGUF block format (Q4_0, Q4_1, Q8_0), dequantized on the fly.
//
// A decode step is bound by reading the weights, and float32 weights are 7x the bytes of Q4_1 ones.
// Each task dequantizes a few output rows of the weight into a small float32 buffer that stays in L1
// (the values are bit-identical to gguf-py's dequantization: d*q is exact in float32, so one fused
// multiply-add rounds like numpy's multiply-then-add) and takes their dot products with the input
// rows. The input is walked in chunks of rows that stay in L2, so a long prefill is not re-streamed
// from memory for every few output rows.
//
// Steps of more rows run on an interleaved copy of the blocks made once at load time
// (interleave_gguf_rows): rows in groups of 8, and for each block the 8 rows' scales as float32 and
// value k of all 8 rows side by side, so 8 rows' weights at one k dequantize into one register.
// A task dequantizes 16 rows into an L1/L2 panel laid out [k][16] and runs a 6 x 16 broadcast
// microkernel over it for all input rows: 12 FMAs per 8 loads, no horizontal sums, and each output
// is one accumulator over k in order, so its value does not depend on the batch it came in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_block.h"
#include "gguf_sub_blocks.h"
#include "ops.h"
#include "vec_lanes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Input rows x weight rows of one register tile: 4 x 3 accumulators plus three weight vectors and one
// input vector fill the 16 AVX2 registers.
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 3;
// Weight rows dequantized together: each input tile, once in L1, meets all of them.
constexpr int64_t kRowsPerGroup = 4 * kTileCols;
// Input rows per chunk: 64 rows of K <= 2048 floats stay in a 1 MiB L2.
constexpr int64_t kChunkRows = 64;

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
  const __m256 vm = _mm256_set1_ps(block_min(block, qtype, half_at(block)));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles_of(block, qtype)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), vd, vm);
  v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), vd, vm);
  v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), vd, vm);
  v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), vd, vm);
}
#endif

#if defined(__AVX512F__)
// The 32 values of one block in two 512-bit registers (values 0-15, then 16-31), as block_values computes them.
inline void block_values_512(const uint8_t* block, int64_t qtype, __m512 v[2]) {
  const __m512 vd = _mm512_set1_ps(half_at(block));
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 2; ++i)
      v[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)))), vd);
    return;
  }
  const __m512 vm = _mm512_set1_ps(block_min(block, qtype, half_at(block)));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles_of(block, qtype)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  v[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask))), vd, vm);
  v[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask))), vd, vm);
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
  const float m = block_min(block, qtype, d);
  const uint8_t* q = nibbles_of(block, qtype);
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

#if defined(__AVX512F__)
// few_rows_times_weight_rows on a processor with AVX-512: a block in two registers, two blocks per step so
// four accumulators per input row still keep the FMAs from waiting on each other; half the instructions per
// value, which leaves the loop waiting on the blocks' reads, so it fetches rows ahead (fetch_row).
template <int MR>
void few_rows_times_weight_rows_512(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t qtype,
                                    int64_t first, int64_t last, const float* bias, float* out, int64_t n) {
  const int64_t stride = quantized_block_bytes(qtype), num_blocks = k / kBlockValues;
  for (int64_t r = first; r < last; ++r) {
    const uint8_t* row = w + r * row_bytes;
    if (r + kFetchAheadRows < last) fetch_row(row + kFetchAheadRows * row_bytes, row_bytes);
    __m512 acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= num_blocks; b += 2) {
      __m512 v[4];
      block_values_512(row + b * stride, qtype, v);
      block_values_512(row + (b + 1) * stride, qtype, v + 2);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * k + b * kBlockValues + 16 * j), v[j], acc[i][j]);
    }
    if (b < num_blocks) {
      __m512 v[2];
      block_values_512(row + b * stride, qtype, v);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2; ++j) acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * k + b * kBlockValues + 16 * j), v[j], acc[i][j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3]));
      out[i * n + r] = _mm512_reduce_add_ps(sum) + (bias ? bias[r] : 0.f);
    }
  }
}
#endif

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


// Interleaved layout, per group of kPanelRows rows and per block: float d[8], float m[8] (value =
// d * q + m), then the 32 values: Q4 as 4 bytes per value index (byte j: row j in the low nibble, row
// j + 4 in the high one), Q8_0 as 8 signed bytes.
constexpr int64_t kPanelRows = 8;
constexpr int64_t kScaleBytes = 2 * kPanelRows * sizeof(float);
// Output columns of one panel (two groups) and input rows of one microkernel tile: 6 x 2 accumulators,
// two weight vectors and a broadcast value fit the 16 AVX2 registers.
constexpr int64_t kPanelCols = 2 * kPanelRows;
constexpr int64_t kBroadcastRows = 6;

int64_t interleaved_record_bytes(int64_t qtype) { return kScaleBytes + kBlockValues * (qtype == kQ8_0 ? 8 : 4); }

// Writes the record of block b of the 8 rows starting at `rows` (each row_bytes long).
void interleave_block(const uint8_t* rows, int64_t row_bytes, int64_t b, int64_t qtype, uint8_t* record) {
  const int64_t bytes = quantized_block_bytes(qtype);
  float* scales = reinterpret_cast<float*>(record);
  uint8_t* values = record + kScaleBytes;
  std::memset(values, 0, interleaved_record_bytes(qtype) - kScaleBytes);
  for (int64_t r = 0; r < kPanelRows; ++r) {
    const uint8_t* block = rows + r * row_bytes + b * bytes;
    const float d = half_at(block);
    scales[r] = d;
    scales[kPanelRows + r] = block_min(block, qtype, d);
    if (qtype == kQ8_0) {
      for (int64_t v = 0; v < kBlockValues; ++v) values[v * kPanelRows + r] = block[2 + v];
      continue;
    }
    const uint8_t* q = nibbles_of(block, qtype);
    for (int64_t v = 0; v < kBlockValues; ++v) {
      const uint8_t nibble = v < 16 ? (q[v] & 0x0F) : (q[v - 16] >> 4);
      values[v * 4 + (r & 3)] |= static_cast<uint8_t>(nibble << (r < 4 ? 0 : 4));
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Value index v of the 8 rows of a record's values, as float32 before scaling.
template <bool Q8>
inline __m256 interleaved_values(const uint8_t* values, int64_t v) {
  if (Q8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + v * 8))));
  int32_t word;
  std::memcpy(&word, values + v * 4, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(0x0F)));
}

// panel[k][8g + j] = weight row 8g + j at k, for the `count` (1 or 2) groups whose records start at groups[g];
// a missing second group is zeros.
template <bool Q8>
void dequantize_panel(const uint8_t* const* groups, int64_t count, int64_t k, int64_t record_bytes, float* panel) {
  for (int64_t b = 0; b < k / kBlockValues; ++b)
    for (int64_t g = 0; g < 2; ++g) {
      float* out = panel + b * kBlockValues * kPanelCols + g * kPanelRows;
      if (g >= count) {
        for (int64_t v = 0; v < kBlockValues; ++v) _mm256_storeu_ps(out + v * kPanelCols, _mm256_setzero_ps());
        continue;
      }
      const uint8_t* record = groups[g] + b * record_bytes;
      const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(record));
      const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(record) + kPanelRows);
      for (int64_t v = 0; v < kBlockValues; ++v)
        _mm256_storeu_ps(out + v * kPanelCols, _mm256_fmadd_ps(interleaved_values<Q8>(record + kScaleBytes, v), d, m));
    }
}

// out[i, j] = sum over k, in order, of x[i, k] * panel[k][j] (+ bias[j]), for MR input rows and the
// first `cols` of the panel's 16 columns.
template <int MR>
void panel_tile(const float* x, int64_t k, const float* panel, int64_t cols, const float* bias, float* out, int64_t n) {
  // _mm256_set1_ps, not _mm256_broadcast_ss: with the latter GCC stored every accumulator to the
  // stack on each step (the same vbroadcastss, at half the speed).
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 w[2];
    for (int j = 0; j < 2; ++j) w[j] = _mm256_loadu_ps(panel + p * kPanelCols + j * kPanelRows);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_set1_ps(x[i * k + p]);
      for (int j = 0; j < 2; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  alignas(32) float result[MR][kPanelCols];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) _mm256_store_ps(result[i] + j * kPanelRows, acc[i][j]);
  for (int i = 0; i < MR; ++i)
    for (int64_t c = 0; c < cols; ++c) out[i * n + c] = result[i][c] + (bias ? bias[c] : 0.f);
}

void rows_times_panel(const float* x, int64_t rows, int64_t k, const float* panel, int64_t cols, const float* bias, float* out,
                      int64_t n) {
  int64_t i = 0;
  for (; i + kBroadcastRows <= rows; i += kBroadcastRows) panel_tile<kBroadcastRows>(x + i * k, k, panel, cols, bias, out + i * n, n);
  const float* xr = x + i * k;
  float* o = out + i * n;
  switch (rows - i) {
    case 5: panel_tile<5>(xr, k, panel, cols, bias, o, n); break;
    case 4: panel_tile<4>(xr, k, panel, cols, bias, o, n); break;
    case 3: panel_tile<3>(xr, k, panel, cols, bias, o, n); break;
    case 2: panel_tile<2>(xr, k, panel, cols, bias, o, n); break;
    case 1: panel_tile<1>(xr, k, panel, cols, bias, o, n); break;
    default: break;
  }
}

template <bool Q8>
void interleaved_linear(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, int64_t qtype, const float* bias,
                        float* out) {
  const int64_t record_bytes = interleaved_record_bytes(qtype), group_bytes = k / kBlockValues * record_bytes;
  const int64_t num_groups = n / kPanelRows;
  at::parallel_for(0, (num_groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(k * kPanelCols);
    // Input rows in L2-sized chunks (as above): a panel is dequantized again for each chunk.
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, m - chunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g0 = 2 * t, count = std::min<int64_t>(2, num_groups - g0);
        const uint8_t* groups[2] = {packed + g0 * group_bytes, packed + (g0 + 1) * group_bytes};
        dequantize_panel<Q8>(groups, count, k, record_bytes, panel.data());
        rows_times_panel(x + chunk * k, rows, k, panel.data(), count * kPanelRows, bias ? bias + g0 * kPanelRows : nullptr,
                         out + chunk * n + g0 * kPanelRows, n);
      }
    }
  });
}
#endif

}  // namespace

// x [M, K] float32; weight [N, K / 32 * block_bytes] uint8 (GGUF blocks, one output row per row);
// bias [N] float32 or undefined. Returns x @ dequantized(weight).T + bias, [M, N].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& interleaved) {
  const float* bias_ptr = checked_linear_args(x, weight, qtype, bias);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({m, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1), num_blocks = k / kBlockValues;
  if (m <= 2) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
      if (m == 1) few_rows_times_weight_rows_512<1>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
      else few_rows_times_weight_rows_512<2>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
#else
      if (m == 1) few_rows_times_weight_rows<1>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
      else few_rows_times_weight_rows<2>(x_ptr, k, w_ptr, row_bytes, qtype, begin, end, bias_ptr, out_ptr, n);
#endif
    });
    return out;
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (interleaved.has_value() && interleaved->defined()) {
    TORCH_CHECK(n % kPanelRows == 0 && interleaved->scalar_type() == at::kByte && interleaved->is_contiguous() &&
                    interleaved->numel() == n / kPanelRows * num_blocks * interleaved_record_bytes(qtype),
                "interleaved weight does not match the blocks (make it with interleave_gguf_rows)");
    if (qtype == kQ8_0) interleaved_linear<true>(x_ptr, m, k, interleaved->data_ptr<uint8_t>(), n, qtype, bias_ptr, out_ptr);
    else interleaved_linear<false>(x_ptr, m, k, interleaved->data_ptr<uint8_t>(), n, qtype, bias_ptr, out_ptr);
    return out;
  }
#endif
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

// The float32 values of GGUF blocks of any type the kernels read, [N, row bytes] -> [N, K], exactly as gguf dequantizes
// them: for the steps of a layer that keeps no dense weight which its blocks do not take, for a layer whose blocks the
// products do not read, and for checks. The types every kernel reads go through the float32 kernel's own unpacking.
at::Tensor dequantize_gguf(const at::Tensor& weight, int64_t qtype) {
  const StoredBlock stored = stored_block(qtype);
  TORCH_CHECK(stored.bytes > 0, "unsupported GGUF quantization type id ", qtype);
  check_rows_of_blocks(weight, stored.bytes);
  const int64_t n = weight.size(0), row_bytes = weight.size(1), k = row_bytes / stored.bytes * stored.values;
  auto out = at::empty({n, k}, weight.options().dtype(at::kFloat));
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  float* out_ptr = out.data_ptr<float>();
  const bool every_kernel_reads = quantized_block_bytes(qtype) > 0;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = w_ptr + r * row_bytes;
      if (every_kernel_reads) {
        dequantize_row(row, qtype, k / kBlockValues, out_ptr + r * k);
        continue;
      }
      for (int64_t b = 0; b < k / kBlockValues; ++b) sub_block_values(sub_block(row, b, qtype), qtype, out_ptr + r * k + b * kBlockValues);
    }
  });
  return out;
}

// GGUF blocks [N, K / 32 * block_bytes] -> the interleaved copy quantized_linear reads for steps of
// more than two rows (layout above interleave_block). N must be a multiple of 8.
at::Tensor interleave_gguf_rows(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = checked_block_rows(weight, qtype);
  const int64_t n = weight.size(0), row_bytes = weight.size(1), num_blocks = row_bytes / bytes;
  TORCH_CHECK(n % kPanelRows == 0, "interleaving takes a multiple of ", kPanelRows, " rows, not ", n);
  const int64_t record_bytes = interleaved_record_bytes(qtype);
  auto out = at::empty({n / kPanelRows, num_blocks * record_bytes}, weight.options());
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  uint8_t* out_ptr = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < num_blocks; ++b)
        interleave_block(w_ptr + g * kPanelRows * row_bytes, row_bytes, b, qtype, out_ptr + (g * num_blocks + b) * record_bytes);
  });
  return out;
}
