// Paged attention on CPU for decodes and for prefill chunks (after context or not): both read K/V
// straight from the block layout (no gather copy).
//
// Decodes: one task per sequence, all its heads together: a block's K (then V) rows for every KV head
// are one contiguous run (KV heads x head size floats), where a task per (sequence, KV head) would read
// one head's short piece at a stride of all heads, which prefetches poorly from a cold cache. Head sizes that are a multiple
// of 32 (AVX2) take three passes (all scores, one softmax, all values; attend_sequence_three_pass);
// other head sizes visit each block once with an online softmax (attend_sequence). Either way a
// sequence's context is attended in parts of at most 512 tokens, merged after (decode_in_parts), so
// one long sequence runs on every thread, and the parts are split between threads by context
// length, so one long sequence does not leave a thread idle behind many short ones.
//
// The cache may store float32, bfloat16 or float16 (kv_cache_dtype); the kernels compute in float32.
// The three-pass decode widens values in registers as it loads them (16 at a time where the build has AVX-512, but
// for a float32 cache: DecodeLanes); the other routes widen what they
// read (a block for a decode, a key or value row for a prefill tile) into a small float scratch that
// stays in L1, so their scoring and accumulating code is one for every storage type.
//
// An 8-bit cache (int8, fp8 e4m3 or e5m2: layers/attention/kv_quant.py) is a byte tensor whose every
// (token, KV head) row is head_dim values and then their float32 scale: rows are head_dim + 4 bytes
// apart (AttentionShape::head_stride). Its rows are written quantized (write_kv_cache). The three-pass
// decode reads 8-bit rows in registers (a key's scale multiplies its dot product, a value's its
// weight), 16 values at a time where the build has AVX-512 (Lanes16), else 8; the other routes
// dequantize them into the scratch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_lanes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxBlockSize = 256;

#if defined(__AVX2__) && defined(__F16C__)
// 8 cache values as float32: bfloat16 is the high half of a float32, float16 widens by F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 values of an 8-bit row, not yet scaled: int8 by sign extension, fp8 e5m2 as the high byte of a float16.
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 load8(const c10::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}
// fp8 e4m3 as a float16 with the same sign, exponent and mantissa bits: its value over 2^8 (the exponent biases are 7
// and 15), subnormals included, which kLoadedUnit puts back. Sign-extended to 16 bits and shifted, the sign lands on
// bit 15 and a copy of it on bit 14, which the mask clears. A cache holds no e4m3 NaN (quantize_row), so none is
// looked for.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i widened = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(widened, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
}
#endif

template <typename T>
constexpr bool kEightBit = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// Cache elements of one (token, KV head) row: its head_dim values, and after an 8-bit row's values its float32 scale
// (kv_format 0: a 16- or 32-bit cache).
constexpr int64_t kScaleBytes = sizeof(float);
inline int64_t row_width(int64_t head_dim, int64_t kv_format) { return head_dim + (kv_format ? kScaleBytes : 0); }

// Vectors of 8 floats (Lanes8), or of 16 (Lanes16) where the build has AVX-512. The prefill tiles compute on 16
// where they can (their loops are bound by arithmetic, and a lane's sums keep their order). The three-pass decode
// takes 16 for 8- and 16-bit rows: widening them takes as many instructions as the products, and with the rows in
// cache the loops are bound by arithmetic, so half the instructions let more of the reads overlap them. A float32
// cache keeps 8: its rows need no widening, and the exact path's sums stay in the order transformers was compared in.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Lanes8 : Floats8 {
  template <typename T>
  static Vec widen(const T* p) { return load8(p); }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define PAGEDSERVE_LANES16 1
struct Lanes16 : Floats16 {
  // 16 values of an 8-bit row, not yet scaled, as load8 widens 8.
  static Vec widen(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(p))); }
  static Vec widen(const c10::Float8_e5m2* p) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes(p)), 8)); }
  static Vec widen(const c10::Float8_e4m3fn* p) {
    const __m256i widened = _mm256_cvtepi8_epi16(bytes(p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(widened, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
  }
  // 16 values of a 16-bit row: bfloat16 is the high half of a float32, float16 widens by F16C.
  static Vec widen(const c10::BFloat16* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves(p)), 16)); }
  static Vec widen(const c10::Half* p) { return _mm512_cvtph_ps(halves(p)); }
  static __m128i bytes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static __m256i halves(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
};
template <typename T>
using DecodeLanes = std::conditional_t<std::is_same_v<T, float>, Lanes8, Lanes16>;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <typename T>
using DecodeLanes = Lanes8;
#endif

// The largest magnitude an 8-bit format holds: a row's largest value is stored as it.
template <typename T>
constexpr float kFormatMax = std::is_same_v<T, int8_t> ? 127.f : std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;

// What load8's values of an 8-bit format are multiplied by to be the format's values: 2^8 for fp8 e4m3, 1 otherwise.
template <typename T>
constexpr float kLoadedUnit = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;

// An 8-bit row's scale: the float32 after its head_dim values (unaligned).
template <typename T>
inline float row_scale(const T* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, reinterpret_cast<const char*>(row + head_dim), sizeof(float));
  return scale;
}

// What load8's values of an 8-bit row are multiplied by to be the values the row holds.
template <typename T>
inline float loaded_scale(const T* row, int64_t head_dim) {
  return row_scale(row, head_dim) * kLoadedUnit<T>;
}

// dst[i] = value i of the 8-bit row times its scale, for the row's head_dim values, eight at a time with AVX2 (load8).
template <typename T>
inline void dequantize_row(const T* row, int64_t head_dim, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 vscale = _mm256_set1_ps(loaded_scale(row, head_dim));
  for (; i + 8 <= head_dim; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(load8(row + i), vscale));
#endif
  const float scale = row_scale(row, head_dim);
  for (; i < head_dim; ++i) dst[i] = static_cast<float>(row[i]) * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight floats (finite, within the format's range) in an fp8 format, rounded as c10's scalar conversion rounds them
// (fp8e4m3fn_from_fp32_value, fp8e5m2_from_fp32_value), so the bytes are the torch path's: below the format's
// smallest normal, a float add puts the rounded subnormal in the low bits; above it, the exponent is rebiased and the
// mantissa rounded to nearest even with integer adds. Returned as eight int32 lanes holding a byte each.
template <typename T>
inline __m256i to_fp8(__m256 values) {
  constexpr int kMantissa = std::is_same_v<T, c10::Float8_e4m3fn> ? 3 : 2, kBias = kMantissa == 3 ? 7 : 15;
  constexpr int kShift = 23 - kMantissa;
  constexpr uint32_t kSmallestNormal = static_cast<uint32_t>(127 - kBias + 1) << 23;
  constexpr uint32_t kDenormMask = static_cast<uint32_t>(127 - kBias + kShift + 1) << 23;
  constexpr uint32_t kRebias = (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (kShift - 1)) - 1);
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i magnitude = _mm256_xor_si256(bits, sign);
  const __m256i denorm = _mm256_set1_epi32(static_cast<int>(kDenormMask));
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(magnitude), _mm256_castsi256_ps(denorm))), denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, kShift), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32(static_cast<int>(kRebias))), odd), kShift);
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kSmallestNormal)), magnitude);
  const __m256i byte = _mm256_and_si256(_mm256_blendv_epi8(normal, subnormal, is_subnormal), _mm256_set1_epi32(0xFF));
  return _mm256_or_si256(byte, _mm256_srli_epi32(sign, 24));
}

// Eight int32 lanes, each a byte's value (unsigned, or signed for int8), stored as eight bytes.
template <typename T>
inline void store_bytes(__m256i lanes, T* dst) {
  const __m128i low = _mm256_castsi256_si128(lanes), high = _mm256_extracti128_si256(lanes, 1);
  const __m128i bytes = std::is_same_v<T, int8_t> ? _mm_packs_epi16(_mm_packs_epi32(low, high), _mm_setzero_si128())
                                                  : _mm_packus_epi16(_mm_packus_epi32(low, high), _mm_setzero_si128());
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), bytes);
}
#endif

// One float row quantized into an 8-bit row: values / scale in the format, then the scale. The scale is
// fixed_scale where it is positive (a checkpoint's static per-tensor scale), else the row's own: its
// largest magnitude over the format's largest (1 for a row of zeros). As the torch path: a NaN is
// stored as 0 (int8 has none, and an fp8 NaN would cost every read a compare), values are clamped to
// the format's range, int8 rounds to nearest even, fp8 converts (to nearest even). Eight values at a
// time with AVX2, the same divisions and roundings as the scalar loop.
template <typename T>
inline void quantize_row(const float* src, int64_t head_dim, T* dst, float fixed_scale) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t vectorized = head_dim / 8 * 8;
#else
  const int64_t vectorized = 0;
#endif
  float scale = fixed_scale;
  if (!(scale > 0.f)) {
    float largest = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    if (vectorized) largest = largest_magnitude(src, vectorized);
#endif
    for (int64_t i = vectorized; i < head_dim; ++i) largest = std::max(largest, std::abs(src[i]));  // a NaN is passed over
    scale = largest / kFormatMax<T>;
    if (!(scale > 0.f)) scale = 1.f;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vscale = _mm256_set1_ps(scale), high = _mm256_set1_ps(kFormatMax<T>), low = _mm256_set1_ps(-kFormatMax<T>);
  for (int64_t i = 0; i < vectorized; i += 8) {
    __m256 value = _mm256_div_ps(_mm256_loadu_ps(src + i), vscale);
    value = _mm256_andnot_ps(_mm256_cmp_ps(value, value, _CMP_UNORD_Q), value);  // NaN -> 0
    value = _mm256_min_ps(_mm256_max_ps(value, low), high);
    if constexpr (std::is_same_v<T, int8_t>)
      store_bytes(_mm256_cvtps_epi32(value), dst + i);  // rounds to nearest even, as nearbyint does
    else
      store_bytes(to_fp8<T>(value), dst + i);
  }
#endif
  for (int64_t i = vectorized; i < head_dim; ++i) {
    float value = src[i] / scale;
    value = std::isnan(value) ? 0.f : std::min(std::max(value, -kFormatMax<T>), kFormatMax<T>);
    if constexpr (std::is_same_v<T, int8_t>)
      dst[i] = static_cast<int8_t>(std::nearbyint(value));
    else
      dst[i] = static_cast<T>(value);
  }
  std::memcpy(reinterpret_cast<char*>(dst + head_dim), &scale, sizeof(float));
}

// dst[i] = float(src[i]) for n values of a 16-bit cache.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n values of the cache as float32: the cache's own memory when it stores float32, else widened into scratch.
// For an 8-bit cache, n covers whole rows of head_stride elements (a row, or a block's rows), each
// dequantized into the scratch at the same place.
template <typename T>
inline const float* as_float(const T* src, int64_t n, float* scratch, int64_t head_dim = 0, int64_t head_stride = 0) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (kEightBit<T>) {
    for (int64_t row = 0; row < n; row += head_stride) dequantize_row(src + row, head_dim, scratch + row);
    return scratch;
  } else {
    widen(src, scratch, n);
    return scratch;
  }
}

// Calls f(T{}) with T the element type the KV cache stores: its dtype, or for a byte cache the 8-bit
// format (kv_format: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2; 0 for a 16- or 32-bit cache).
template <typename F>
void dispatch_cache_type(const at::Tensor& cache, int64_t kv_format, const F& f) {
  if (cache.scalar_type() == at::kByte) {
    switch (kv_format) {
      case 1: return f(int8_t{});
      case 2: return f(c10::Float8_e4m3fn{});
      case 3: return f(c10::Float8_e5m2{});
      default: TORCH_CHECK(false, "a byte KV cache needs its 8-bit format (1 int8, 2 fp8_e4m3, 3 fp8_e5m2), got ", kv_format);
    }
  }
  TORCH_CHECK(kv_format == 0, "an 8-bit format names a byte cache, got a ", cache.scalar_type(), " one");
  switch (cache.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "KV cache must be float32, bfloat16, float16 or bytes of an 8-bit format, got ", cache.scalar_type());
  }
}

void check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches only");
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return horizontal_sum(_mm256_add_ps(s0, s1));
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[d] = acc[d] * rescale + sum_i p[i * p_stride] * rows[i * stride + d], for n rows of values.
inline void scale_and_accumulate(float* __restrict acc, float rescale, const float* p, int64_t p_stride, const float* rows,
                                 int64_t n, int64_t stride, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim == 64) {  // the common head size: the accumulator lives in eight registers for the whole block
    const __m256 c = _mm256_set1_ps(rescale);
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc), c), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + 8), c);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + 16), c), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + 24), c);
    __m256 a4 = _mm256_mul_ps(_mm256_loadu_ps(acc + 32), c), a5 = _mm256_mul_ps(_mm256_loadu_ps(acc + 40), c);
    __m256 a6 = _mm256_mul_ps(_mm256_loadu_ps(acc + 48), c), a7 = _mm256_mul_ps(_mm256_loadu_ps(acc + 56), c);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = rows + i * stride;
      const __m256 w = _mm256_set1_ps(p[i * p_stride]);
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
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[i * p_stride] * v[d];
  }
}

// The largest of n floats, a vector of them at a time (std::max_element's compare-and-select waits on each
// comparison in turn, and a decode takes the largest of every head's scores).
inline float max_of(const float* s, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  float result = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= Vec::size()) {
    Vec vmax = Vec::loadu(s);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(s + i));
    result = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  }
  for (; i < n; ++i) result = std::max(result, s[i]);
  return result;
}

// s[i] = cap * tanh(s[i] / cap) for n scaled scores: a soft cap (Gemma 2's attention logit soft-capping), applied
// before the causal or window mask and the softmax, as transformers applies it.
inline void cap_scores(float* s, int64_t n, float cap) {
  using Vec = at::vec::Vectorized<float>;
  const Vec vcap(cap);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) ((Vec::loadu(s + i) / vcap).tanh() * vcap).store(s + i);
  for (; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
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

// Prefetches the next block (into L2) a few cache lines per call, so its requests are spread over the
// work on the current block. Issued at once, at the block's start, most of a block's requests find no
// free miss buffer and come to little; spread, the kernel runs near the speed of a plain read of the
// same blocks (docs/cpu.md).
struct SpreadPrefetch {
  const char* block = nullptr;
  int64_t bytes = 0, offset = 0, per_call = 0;
  // The block to fetch, of `block_bytes`, over `calls` calls (more calls are no-ops, fewer leave the rest to finish()).
  void start(const void* next_block, int64_t block_bytes, int64_t calls) {
    block = static_cast<const char*>(next_block);
    bytes = next_block ? block_bytes : 0;
    offset = 0;
    per_call = ((block_bytes + calls - 1) / calls + 63) / 64 * 64;
  }
  inline void operator()() { fetch_until(std::min(bytes, offset + per_call)); }
  void finish() { fetch_until(bytes); }
  inline void fetch_until(int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
    for (; offset < end; offset += 64) _mm_prefetch(block + offset, _MM_HINT_T1);
#else
    offset = end;
#endif
  }
};

struct AttentionShape {
  int64_t num_heads, group, head_dim, block_size, row_stride, block_stride;
  float scale;
  int64_t head_stride;  // cache elements from one KV head's row to the next: head_dim, or row_width(head_dim, kv_format)
  float softcap = 0.f;  // a soft cap of the scaled scores (cap_scores); 0: none
};

struct SequenceScratch {
  std::vector<float> q, acc, scores, maxes, sums, k_block, v_block;  // maxes/sums: running; k/v_block: a widened 16-bit block
  explicit SequenceScratch(const AttentionShape& s)
      : q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), scores(s.num_heads * s.block_size), maxes(s.num_heads),
        sums(s.num_heads), k_block(s.block_stride), v_block(s.block_stride) {}
};

// Folds the n scores of one block (already q.k * scale) into a query row's running softmax and
// accumulator: acc = acc * exp(old_max - new_max) + sum_i exp(s_i - new_max) v_i.
inline void fold_scores(float* scores, int64_t n, const float* v_rows, int64_t row_stride, int64_t dim, float& running_max,
                        float& running_sum, float* acc) {
  const float block_max = max_of(scores, n);
  const float new_max = std::max(running_max, block_max);
  const float rescale = std::exp(running_max - new_max);  // 0 on the first block
  const float block_sum = exp_and_sum(scores, n, new_max);
  running_sum = running_sum * rescale + block_sum;
  running_max = new_max;
  scale_and_accumulate(acc, rescale, scores, 1, v_rows, n, row_stride, dim);
}

// Folds one block of n keys/values into every head's running softmax and accumulator; step() runs
// once per key (the next block's prefetches).
template <typename Step>
void attend_block(const AttentionShape& s, const float* k_block, const float* v_block, int64_t n, SequenceScratch& w, Step&& step) {
  for (int64_t i = 0; i < n; ++i) {
    step();
    const float* k_row = k_block + i * s.row_stride;
    for (int64_t h = 0; h < s.num_heads; ++h)
      w.scores[h * s.block_size + i] = dot(w.q.data() + h * s.head_dim, k_row + (h / s.group) * s.head_stride, s.head_dim);
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    if (s.softcap > 0.f) cap_scores(w.scores.data() + h * s.block_size, n, s.softcap);
    fold_scores(w.scores.data() + h * s.block_size, n, v_block + (h / s.group) * s.head_stride, s.row_stride, s.head_dim,
                w.maxes[h], w.sums[h], w.acc.data() + h * s.head_dim);
  }
}

// Each head's online softmax over the keys of blocks [first_block, end_block) of a sequence of len
// tokens, from key first_key on (a sliding window's first; 0 for all) (w.maxes, w.sums), and the sum of their
// values weighted by it (w.acc, not yet divided by w.sums).
template <typename T>
void attend_sequence(const AttentionShape& s, const float* q_in, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t len, int64_t first_key, int64_t first_block, int64_t end_block, SequenceScratch& w) {
  const int64_t qdim = s.num_heads * s.head_dim;
  for (int64_t i = 0; i < qdim; ++i) w.q[i] = q_in[i] * s.scale;
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.maxes.begin(), w.maxes.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.sums.begin(), w.sums.end(), 0.f);
  const int64_t block_bytes = s.block_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t skip = std::max<int64_t>(0, first_key - b * s.block_size);  // the block's keys before the window
    const int64_t n = std::min(s.block_size, len - b * s.block_size) - skip, offset = table[b] * s.block_stride + skip * s.row_stride;
    SpreadPrefetch next_keys, next_values;
    next_keys.start(b + 1 < end_block ? k_cache + table[b + 1] * s.block_stride : nullptr, block_bytes, n);
    next_values.start(b + 1 < end_block ? v_cache + table[b + 1] * s.block_stride : nullptr, block_bytes, n);
    attend_block(s, as_float(k_cache + offset, n * s.row_stride, w.k_block.data(), s.head_dim, s.head_stride),
                 as_float(v_cache + offset, n * s.row_stride, w.v_block.data(), s.head_dim, s.head_stride), n, w, [&] {
                   next_keys();
                   next_values();
                 });
    next_keys.finish();
    next_values.finish();
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- decodes in three passes, for head sizes that are a multiple of 32 ----
// All scores of the sequence first (K read once), then one softmax per head over the whole
// context, then the values (V read once): no per-block rescaling, and the dot products of 4 keys
// with up to 3 query heads share their horizontal sums. Each pass walks the blocks in order and
// reads a block's rows for every KV head before the next block, so the reads stay contiguous.
// Values are widened in registers as they are loaded, so a 16-bit cache costs no extra pass. The
// next block is prefetched while one is computed, its requests spread over the computation
// (SpreadPrefetch): blocks are scattered, so the hardware prefetcher stops at each block's end, and
// without the prefetch the kernel's reads and arithmetic took turns instead of overlapping.

// The sums of the eight lanes of a, b, c and d.
inline __m128 sum_lanes4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[h * stride + i] = q[h] . keys[i] for NH query heads (q rows of dim floats) and NK keys (NK = 4 or 1). An
// 8-bit key's scale factors out of its dot product: the sums are scaled once.
template <int NH, int NK, typename T>
inline void score_keys(const float* q, const T* const* keys, int64_t dim, float* scores, int64_t stride) {
  using L = DecodeLanes<T>;
  typename L::Vec acc[NH][NK];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) acc[h][j] = L::zero();
  for (int64_t d = 0; d < dim; d += L::kWidth) {
    typename L::Vec qv[NH];
    for (int h = 0; h < NH; ++h) qv[h] = L::load(q + h * dim + d);
    for (int j = 0; j < NK; ++j) {
      const typename L::Vec k = L::widen(keys[j] + d);
      for (int h = 0; h < NH; ++h) acc[h][j] = L::fma(qv[h], k, acc[h][j]);
    }
  }
  float key_scales[NK];
  for (int j = 0; j < NK; ++j) key_scales[j] = kEightBit<T> ? loaded_scale(keys[j], dim) : 1.f;
  for (int h = 0; h < NH; ++h) {
    if constexpr (NK == 4)
      _mm_storeu_ps(scores + h * stride, _mm_mul_ps(sum_lanes4(L::fold(acc[h][0]), L::fold(acc[h][1]), L::fold(acc[h][2]), L::fold(acc[h][3])),
                                                    _mm_loadu_ps(key_scales)));
    else
      scores[h * stride] = horizontal_sum(L::fold(acc[h][0])) * key_scales[0];
  }
}

// acc[h][0:32] += sum_i p[h * stride + i] * values[i][0:32] for NH heads over n value rows (row_stride apart). An 8-bit
// row's scale (at row_scale_at elements from its first value read) joins its weight.
template <int NH, typename T, typename Step>
inline void accumulate_values(const float* p, int64_t stride, const T* values, int64_t row_stride, int64_t n, float* acc,
                              int64_t acc_stride, Step& step, int64_t row_scale_at = 0) {
  using L = DecodeLanes<T>;
  constexpr int kVectors = 32 / L::kWidth;
  typename L::Vec a[NH][kVectors];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVectors; ++c) a[h][c] = L::load(acc + h * acc_stride + L::kWidth * c);
  for (int64_t i = 0; i < n; ++i) {
    typename L::Vec w[NH];
    const T* row = values + i * row_stride;
    const float value_scale = kEightBit<T> ? loaded_scale(row, row_scale_at) : 1.f;
    for (int h = 0; h < NH; ++h) w[h] = L::broadcast(p[h * stride + i] * value_scale);
    step();
    for (int c = 0; c < kVectors; ++c) {
      const typename L::Vec v = L::widen(row + L::kWidth * c);
      for (int h = 0; h < NH; ++h) a[h][c] = L::fma(w[h], v, a[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVectors; ++c) L::store(acc + h * acc_stride + L::kWidth * c, a[h][c]);
}

// The query heads of one KV head are taken up to 3 at a time (12 accumulators fit the 16 registers).
template <typename F>
inline void for_head_runs(int64_t group, const F& f) {
  for (int64_t first = 0; first < group; first += 3) {
    switch (std::min<int64_t>(3, group - first)) {
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      default: f(std::integral_constant<int, 1>{}, first);
    }
  }
}

struct DecodeScratch {
  std::vector<float> q, acc, scores, maxes, sums;  // scores [num_heads][max_len: the most keys of one part]
  DecodeScratch(const AttentionShape& s, int64_t max_len)
      : q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), scores(s.num_heads * max_len), maxes(s.num_heads),
        sums(s.num_heads) {}
};

// Each head's softmax over the keys of blocks [first_block, end_block) of a sequence of len tokens, from key
// first_key on (a sliding window's first; 0 for all) (w.maxes, w.sums), and the sum of their values weighted by it
// (w.acc, not yet divided by w.sums).
template <typename T>
void attend_sequence_three_pass(const AttentionShape& s, const float* q_in, const T* k_cache, const T* v_cache, const int64_t* table,
                                int64_t len, int64_t first_key, int64_t first_block, int64_t end_block, int64_t max_len, DecodeScratch& w,
                                const T* next_sequence_keys) {
  const int64_t D = s.head_dim, num_kv_heads = s.num_heads / s.group, num_blocks = end_block;
  const int64_t part_first_key = std::max(first_block * s.block_size, first_key);
  const int64_t part_len = std::min(len, num_blocks * s.block_size) - part_first_key;
  for (int64_t i = 0; i < s.num_heads * D; ++i) w.q[i] = q_in[i] * s.scale;
  for (int64_t b = first_block; b < num_blocks; ++b) {  // pass 1: scores
    // The block's keys from the part's first on (in its first block, a window may start part way), and where the
    // first of them is among the part's.
    const int64_t skip = std::max<int64_t>(0, part_first_key - b * s.block_size);
    const T* block = k_cache + table[b] * s.block_stride + skip * s.row_stride;
    const int64_t first_key = b * s.block_size + skip - part_first_key, n = std::min(s.block_size - skip, part_len - first_key);
    SpreadPrefetch pf;
    pf.start(b + 1 < num_blocks ? k_cache + table[b + 1] * s.block_stride : v_cache + table[first_block] * s.block_stride,
             s.block_stride * static_cast<int64_t>(sizeof(T)), num_kv_heads * ((s.block_size + 3) / 4));
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for_head_runs(s.group, [&](auto nh, int64_t first_head) {
        constexpr int NH = decltype(nh)::value;
        const int64_t head = g * s.group + first_head;
        const float* q = w.q.data() + head * D;
        float* scores = w.scores.data() + head * max_len + first_key;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
          const T* keys[4];
          for (int j = 0; j < 4; ++j) keys[j] = block + (i + j) * s.row_stride + g * s.head_stride;
          score_keys<NH, 4>(q, keys, D, scores + i, max_len);
          pf();
        }
        for (; i < n; ++i) {
          const T* key = block + i * s.row_stride + g * s.head_stride;
          score_keys<NH, 1>(q, &key, D, scores + i, max_len);
        }
      });
    pf.finish();
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {  // pass 2: softmax over the part's keys
    float* scores = w.scores.data() + h * max_len;
    if (s.softcap > 0.f) cap_scores(scores, part_len, s.softcap);
    w.maxes[h] = max_of(scores, part_len);
    w.sums[h] = exp_and_sum(scores, part_len, w.maxes[h]);
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t b = first_block; b < num_blocks; ++b) {  // pass 3: values
    const int64_t skip = std::max<int64_t>(0, part_first_key - b * s.block_size);
    const T* block = v_cache + table[b] * s.block_stride + skip * s.row_stride;
    const int64_t first_key = b * s.block_size + skip - part_first_key, n = std::min(s.block_size - skip, part_len - first_key);
    // The next block of V, or at the last one the first block of keys of the thread's next sequence.
    SpreadPrefetch pf;
    pf.start(b + 1 < num_blocks ? v_cache + table[b + 1] * s.block_stride : next_sequence_keys, s.block_stride * static_cast<int64_t>(sizeof(T)),
             num_kv_heads * (D / 32) * s.block_size);
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for_head_runs(s.group, [&](auto nh, int64_t first_head) {
        constexpr int NH = decltype(nh)::value;
        const int64_t head = g * s.group + first_head;
        for (int64_t d0 = 0; d0 < D; d0 += 32)
          accumulate_values<NH>(w.scores.data() + head * max_len + first_key, max_len, block + g * s.head_stride + d0, s.row_stride, n,
                                w.acc.data() + head * D + d0, D, pf, D - d0);
      });
    pf.finish();
  }
}

#endif

// Boundaries of `parts` contiguous ranges of items holding about equal shares of their costs (a
// sequence's context length, a prefill task's query rows x keys), so one costly item does not
// leave a thread idle behind many cheap ones.
std::vector<int64_t> split_by_cost(const int64_t* costs, int64_t num_items, int64_t parts) {
  std::vector<int64_t> bounds{0};
  const int64_t total = std::accumulate(costs, costs + num_items, int64_t{0});
  int64_t seen = 0;
  for (int64_t item = 0; item < num_items && static_cast<int64_t>(bounds.size()) < parts; ++item) {
    seen += costs[item];
    if (seen * parts >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(item + 1);
  }
  if (bounds.back() != num_items) bounds.push_back(num_items);
  return bounds;
}

// One part of a sequence's context for a decode: blocks [first_block, end_block) of its
// table, at most kPartTokens tokens. A sequence of one part writes its output; the parts of a longer
// one write their unnormalized sums, maxima and exp-sums (PartialDecode), merged afterwards.
struct DecodePart {
  int64_t seq, first_block, end_block;
};

// Where a part of a longer sequence leaves its results: acc [num_heads * head_dim], max and sum [num_heads].
struct PartialDecode {
  float *acc, *max, *sum;
};

// A sequence's context is attended in parts of at most this many tokens, each part a task of its own,
// so one long sequence (alone in a step, or beside short ones) runs on every thread (docs/cpu.md).
// Where a sequence is cut depends on its own length only, so its output does not depend on the batch
// it came in (a sequence of up to 512 tokens is one part, with no merge).
constexpr int64_t kPartTokens = 512;

// The parts of a step's sequences (in order), each part's cost (its tokens), the index of each
// sequence's first part (and one past the last), the most tokens of one part, and each sequence's first key (past
// the keys before its sliding window, where the layer has one).
struct DecodePlan {
  std::vector<DecodePart> parts;
  std::vector<int64_t> costs, first_part, first_key;
  int64_t max_len = 0;

  DecodePlan(const int64_t* len_ptr, int64_t num_seqs, int64_t block_size, int64_t window)
      : first_part(num_seqs + 1), first_key(num_seqs) {
    const int64_t part_blocks = std::max<int64_t>(1, kPartTokens / block_size);
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      first_part[seq] = static_cast<int64_t>(parts.size());
      first_key[seq] = window > 0 ? std::max<int64_t>(0, len_ptr[seq] - window) : 0;
      const int64_t blocks = (len_ptr[seq] + block_size - 1) / block_size;
      for (int64_t b = first_key[seq] / block_size; b < blocks; b += part_blocks) {
        parts.push_back({seq, b, std::min(blocks, b + part_blocks)});
        costs.push_back(std::min(len_ptr[seq], (b + part_blocks) * block_size) - std::max(b * block_size, first_key[seq]));
        max_len = std::max(max_len, costs.back());
      }
    }
    first_part[num_seqs] = static_cast<int64_t>(parts.size());
  }
  int64_t num_parts_of(int64_t seq) const { return first_part[seq + 1] - first_part[seq]; }
};

// Where the parts of sequences cut in several leave their partial results (null for whole sequences).
std::vector<PartialDecode> partial_slots(const DecodePlan& plan, int64_t num_heads, int64_t head_dim, std::vector<float>& storage) {
  const int64_t num_parts = static_cast<int64_t>(plan.parts.size()), qdim = num_heads * head_dim, slot = qdim + 2 * num_heads;
  std::vector<PartialDecode> partials(num_parts, PartialDecode{nullptr, nullptr, nullptr});
  if (num_parts == static_cast<int64_t>(plan.first_part.size()) - 1) return partials;  // no sequence was cut
  storage.resize(num_parts * slot);
  for (int64_t p = 0; p < num_parts; ++p)
    if (plan.num_parts_of(plan.parts[p].seq) > 1) {
      float* base = storage.data() + p * slot;
      partials[p] = {base, base + qdim, base + qdim + num_heads};
    }
  return partials;
}

// A part's results (w: either route's scratch): a whole sequence's output (w.acc / sum), or a part's partial results.
template <typename Scratch>
void write_decode_part(const AttentionShape& s, const Scratch& w, float* out, const PartialDecode* partial) {
  if (partial) {
    std::copy(w.acc.begin(), w.acc.end(), partial->acc);
    std::copy(w.maxes.begin(), w.maxes.end(), partial->max);
    std::copy(w.sums.begin(), w.sums.end(), partial->sum);
    return;
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float inv = 1.f / w.sums[h];
    for (int64_t d = 0; d < s.head_dim; ++d) out[h * s.head_dim + d] = w.acc[h * s.head_dim + d] * inv;
  }
}

// out[h] = sum_p acc_p[h] e^(max_p[h] - M) / sum_p sum_p[h] e^(max_p[h] - M), M the largest max_p[h]:
// the parts' softmaxes rescaled to one.
void merge_decode_parts(const PartialDecode* parts, int64_t num_parts, int64_t num_heads, int64_t head_dim, float* out) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) top = std::max(top, parts[p].max[h]);
    float total = 0.f;
    float* o = out + h * head_dim;
    std::fill(o, o + head_dim, 0.f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float weight = std::exp(parts[p].max[h] - top);
      total += parts[p].sum[h] * weight;
      const float* acc = parts[p].acc + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += acc[d] * weight;
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
  }
}

// Runs attend(part, next part of the same thread or null, scratch) for every part of the plan, on
// the threads split by cost, then writes each whole sequence's output and merges each cut one's.
template <typename MakeScratch, typename Attend>
void decode_in_parts(const AttentionShape& s, const DecodePlan& plan, float* out_ptr, const MakeScratch& make_scratch, const Attend& attend) {
  const int64_t num_parts = static_cast<int64_t>(plan.parts.size()), qdim = s.num_heads * s.head_dim;
  std::vector<float> partial_storage;
  const std::vector<PartialDecode> partials = partial_slots(plan, s.num_heads, s.head_dim, partial_storage);
  const std::vector<int64_t> bounds = split_by_cost(plan.costs.data(), num_parts, std::min<int64_t>(at::get_num_threads(), num_parts));
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t task = begin; task < end; ++task)
      for (int64_t i = bounds[task]; i < bounds[task + 1]; ++i) {
        const DecodePart& part = plan.parts[i];
        attend(part, i + 1 < bounds[task + 1] ? &plan.parts[i + 1] : nullptr, scratch);
        write_decode_part(s, scratch, out_ptr + part.seq * qdim, partials[i].acc ? &partials[i] : nullptr);
      }
  });
  for (int64_t seq = 0; seq < static_cast<int64_t>(plan.first_part.size()) - 1; ++seq)
    if (plan.num_parts_of(seq) > 1)
      merge_decode_parts(partials.data() + plan.first_part[seq], plan.num_parts_of(seq), s.num_heads, s.head_dim, out_ptr + seq * qdim);
}



// ---- prefill chunks: a prompt's first chunk, prefix-cache hits, later chunks of long prompts ----
// A task is (chunk, KV head, tile of up to kQueryTile query tokens). Its rows are the tile's tokens
// times the query heads that share the KV head, so each key and value read from the cache serves up
// to kQueryTile * group rows. The queries are held transposed ([dim][row]), so a span of keys is
// scored straight from the cache by a register-blocked kernel (4 keys x 24 rows), and the softmax
// of a span runs across one row per vector lane; values are then read from the cache once per 3 rows.
constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeySpan = 64;
// A sliding window's tile: each row's first key falls in the tile's first span (attend_tile).
static_assert(kKeySpan > kQueryTile, "a span must hold more keys than a tile has query tokens");
constexpr int64_t kLanes = at::vec::Vectorized<float>::size();  // rows are padded to whole vectors of the softmax

struct PrefillTask {
  int64_t chunk, kv_head, first, count;  // query tokens [first, first + count) of the chunk
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Sized for the largest tile; a task uses its own rows rounded up to whole vectors (the extra rows
// compute on zeros and are not read).
struct TileScratch {
  std::vector<float> q_t, scores_t, acc, running_max, running_sum, rescale;
  std::vector<const float*> keys, values;  // the span's K and V rows of the task's KV head: in the cache, or widened below
  std::vector<float> key_rows, value_rows;  // a 16-bit cache's span, widened
  // With bfloat16 products (attend_tile_bf16): q_t's rows and the span's probabilities as bfloat16 pairs of dims and of
  // keys ([pair][padded rows]), the span's values as pairs of keys ([pair][dim]), the span's keys where the cache holds them.
  std::vector<uint32_t> q_pairs, p_pairs, v_pairs;
  std::vector<const c10::BFloat16*> key_rows_bf16, value_rows_bf16;
  TileScratch(int64_t max_rows, int64_t head_dim, int64_t span, bool bf16_products)
      : q_t(head_dim * round_up(max_rows, kLanes)), scores_t(span * round_up(max_rows, kLanes)), acc(max_rows * head_dim),
        running_max(round_up(max_rows, kLanes)), running_sum(round_up(max_rows, kLanes)), rescale(round_up(max_rows, kLanes)),
        keys(span), values(span), key_rows(bf16_products ? 0 : span * head_dim), value_rows(bf16_products ? 0 : span * head_dim),
        q_pairs(bf16_products ? head_dim / 2 * round_up(max_rows, kLanes) : 0),
        p_pairs(bf16_products ? (span + 1) / 2 * round_up(max_rows, kLanes) : 0),
        v_pairs(bf16_products ? (span + 1) / 2 * head_dim : 0), key_rows_bf16(bf16_products ? span : 0),
        value_rows_bf16(bf16_products ? span : 0) {}
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// scores_t[j * rows + r] = q_t[:, r] . keys[j] for 4 keys and RV vectors of rows (L::kWidth each) starting at r0. A
// lane is one row, summed over the dimensions in order, so the lane width leaves every score as it is.
template <typename L, int RV>
inline void score_four_keys(const float* q_t, int64_t rows, int64_t r0, const float* const keys[4], int64_t dim, float* scores_t) {
  typename L::Vec acc[RV][4];
  for (int v = 0; v < RV; ++v)
    for (int j = 0; j < 4; ++j) acc[v][j] = L::zero();
  for (int64_t d = 0; d < dim; ++d) {
    typename L::Vec q[RV];
    for (int v = 0; v < RV; ++v) q[v] = L::load(q_t + d * rows + r0 + L::kWidth * v);
    for (int j = 0; j < 4; ++j) {
      const typename L::Vec k = L::broadcast(keys[j][d]);
      for (int v = 0; v < RV; ++v) acc[v][j] = L::fma(q[v], k, acc[v][j]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int v = 0; v < RV; ++v) L::store(scores_t + j * rows + r0 + L::kWidth * v, acc[v][j]);
}

// Rows [r0, ...) of four keys' scores in runs of 3 vectors, then single vectors, while whole vectors fit; returns
// the first row left.
template <typename L>
inline int64_t score_four_keys_in_runs(const float* q_t, int64_t rows, int64_t r0, const float* const keys[4], int64_t dim,
                                       float* scores_t) {
  for (; r0 + 3 * L::kWidth <= rows; r0 += 3 * L::kWidth) score_four_keys<L, 3>(q_t, rows, r0, keys, dim, scores_t);
  for (; r0 + L::kWidth <= rows; r0 += L::kWidth) score_four_keys<L, 1>(q_t, rows, r0, keys, dim, scores_t);
  return r0;
}
#endif

// scores_t[i * rows + r] = q_t[:, r] . keys[i] for the n keys and all (padded) rows.
void span_scores(const float* q_t, int64_t rows, const float* const* keys, int64_t n, int64_t dim, float* scores_t) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (; i + 4 <= n; i += 4) {
    int64_t r0 = 0;
#ifdef PAGEDSERVE_LANES16
    r0 = score_four_keys_in_runs<Lanes16>(q_t, rows, r0, keys + i, dim, scores_t + i * rows);
#endif
    score_four_keys_in_runs<Lanes8>(q_t, rows, r0, keys + i, dim, scores_t + i * rows);
  }
#endif
  for (; i < n; ++i) {
    float* s = scores_t + i * rows;
    std::fill(s, s + rows, 0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const float k = keys[i][d];
      const float* q = q_t + d * rows;
#pragma omp simd
      for (int64_t r = 0; r < rows; ++r) s[r] += q[r] * k;
    }
  }
}

// Online softmax over a span, one row per vector lane: running max and sum updated, scores replaced by
// exp(score - new max), and each row's factor for its old accumulator left in rescale. FastExp: torch's faster
// exponential (within 20 ULP), for probabilities that are rounded to bfloat16 next.
template <bool FastExp = false>
void span_softmax(float* scores_t, int64_t n, int64_t rows, float* running_max, float* running_sum, float* rescale) {
  using Vec = at::vec::Vectorized<float>;
  const auto exp = [](const Vec& x) { return FastExp ? x.exp_u20() : x.exp(); };
  for (int64_t r = 0; r < rows; r += Vec::size()) {
    Vec new_max = Vec::loadu(running_max + r);
    for (int64_t i = 0; i < n; ++i) new_max = at::vec::maximum(new_max, Vec::loadu(scores_t + i * rows + r));
    Vec sum(0.f);
    for (int64_t i = 0; i < n; ++i) {
      const Vec e = exp(Vec::loadu(scores_t + i * rows + r) - new_max);
      e.store(scores_t + i * rows + r);
      sum = sum + e;
    }
    const Vec factor = exp(Vec::loadu(running_max + r) - new_max);  // 0 on the first span
    factor.store(rescale + r);
    (Vec::loadu(running_sum + r) * factor + sum).store(running_sum + r);
    new_max.store(running_max + r);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// acc[r][d0 + d] += sum_i p_t[i * rows + r0 + r] * values[i][d0 + d] for 3 rows and 32 dims: each value vector loaded
// once for the three rows. A lane is one (row, dim), summed over the keys in order, so the lane width leaves every
// sum as it is.
template <typename L>
inline void accumulate_three_rows(const float* p_t, int64_t rows, int64_t r0, const float* const* values, int64_t n, int64_t dim,
                                  int64_t d0, float* acc) {
  constexpr int kVectors = 32 / L::kWidth;
  typename L::Vec a[3][kVectors];
  for (int r = 0; r < 3; ++r)
    for (int v = 0; v < kVectors; ++v) a[r][v] = L::load(acc + (r0 + r) * dim + d0 + L::kWidth * v);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = values[i] + d0;
    typename L::Vec value[kVectors];
    for (int v = 0; v < kVectors; ++v) value[v] = L::load(row + L::kWidth * v);
    for (int r = 0; r < 3; ++r) {
      const typename L::Vec w = L::broadcast(p_t[i * rows + r0 + r]);
      for (int v = 0; v < kVectors; ++v) a[r][v] = L::fma(w, value[v], a[r][v]);
    }
  }
  for (int r = 0; r < 3; ++r)
    for (int v = 0; v < kVectors; ++v) L::store(acc + (r0 + r) * dim + d0 + L::kWidth * v, a[r][v]);
}

#ifdef PAGEDSERVE_LANES16
using PrefillLanes = Lanes16;
#else
using PrefillLanes = Lanes8;
#endif
#endif

// acc[r] += sum_i p_t[i * padded + r] * values[i] for the rows' accumulators (dim floats each).
void span_values(const float* p_t, int64_t padded, const float* const* values, int64_t n, int64_t rows, int64_t dim, float* acc) {
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (dim % 32 == 0)
    for (; r + 3 <= rows; r += 3)
      for (int64_t d0 = 0; d0 < dim; d0 += 32) accumulate_three_rows<PrefillLanes>(p_t, padded, r, values, n, dim, d0, acc);
#endif
  for (; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const float w = p_t[i * padded + r];
      const float* v = values[i];
      float* a = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
    }
}

// ---- bfloat16 products for a bfloat16 cache (bf16_products) ----
// The scores and the products with v multiply bfloat16 pairs into float32 sums (AVX-512 BF16's dpbf16ps: each lane
// adds the products of a pair of values): q (scaled) is rounded to bfloat16 once per tile, the keys are read as the
// cache holds them, and each span's probabilities are rounded to bfloat16 for their product with v, as the AMX tiles'
// fresh attention rounds them (fresh_attention.cpp). The softmax, its running max and sums stay float32.
#if defined(__AVX512BF16__) && defined(PAGEDSERVE_LANES16)
#define PREFILL_BF16_PRODUCTS 1

inline __m512bh as_pairs(__m512i words) { return reinterpret_cast<__m512bh>(words); }

// Two vectors of floats rounded to bfloat16 (to nearest even) and paired lane by lane: lane r holds low's value r in
// its low half and high's in its high half, the order in which dpbf16ps takes a pair.
inline __m512i bf16_pairs(__m512 low, __m512 high) {
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(low)));
  const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(high)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// A bfloat16 pair of values (p[0] low, p[1] high) in every lane.
inline __m512bh broadcast_pair(const void* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return as_pairs(_mm512_set1_epi32(static_cast<int>(word)));
}

// q_pairs[d2 * padded + r]: rows r's dims 2 * d2 and 2 * d2 + 1 of q_t ([dim][padded]).
void pair_queries(const float* q_t, int64_t padded, int64_t dim, uint32_t* q_pairs) {
  for (int64_t d2 = 0; d2 < dim / 2; ++d2)
    for (int64_t r = 0; r < padded; r += 16)
      _mm512_storeu_si512(q_pairs + d2 * padded + r,
                          bf16_pairs(_mm512_loadu_ps(q_t + 2 * d2 * padded + r), _mm512_loadu_ps(q_t + (2 * d2 + 1) * padded + r)));
}

// scores_t[j * padded + r] = q . keys[j] for NK keys and RV vectors of rows from r0, over pairs of dims in order.
template <int RV, int NK>
inline void score_keys_bf16(const uint32_t* q_pairs, int64_t padded, int64_t r0, const c10::BFloat16* const* keys, int64_t dim,
                            float* scores_t) {
  __m512 acc[RV][NK];
  for (int v = 0; v < RV; ++v)
    for (int j = 0; j < NK; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = as_pairs(_mm512_loadu_si512(q_pairs + d2 * padded + r0 + 16 * v));
    for (int j = 0; j < NK; ++j) {
      const __m512bh k = broadcast_pair(keys[j] + 2 * d2);
      for (int v = 0; v < RV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], q[v], k);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(scores_t + j * padded + r0 + 16 * v, acc[v][j]);
}

template <int NK>
inline void score_rows_bf16(const uint32_t* q_pairs, int64_t padded, const c10::BFloat16* const* keys, int64_t dim, float* scores_t) {
  int64_t r0 = 0;
  for (; r0 + 48 <= padded; r0 += 48) score_keys_bf16<3, NK>(q_pairs, padded, r0, keys, dim, scores_t);
  for (; r0 < padded; r0 += 16) score_keys_bf16<1, NK>(q_pairs, padded, r0, keys, dim, scores_t);
}

void span_scores_bf16(const uint32_t* q_pairs, int64_t padded, const c10::BFloat16* const* keys, int64_t n, int64_t dim, float* scores_t) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) score_rows_bf16<4>(q_pairs, padded, keys + i, dim, scores_t + i * padded);
  for (; i < n; ++i) score_rows_bf16<1>(q_pairs, padded, keys + i, dim, scores_t + i * padded);
}

// v_pairs[i2 * dim + d]: value d of keys 2 * i2 (low half) and 2 * i2 + 1 (high half; zero past the span's n keys).
void pair_values(const c10::BFloat16* const* rows, int64_t n, int64_t dim, uint32_t* v_pairs) {
  for (int64_t i2 = 0; i2 < (n + 1) / 2; ++i2) {
    const c10::BFloat16* low = rows[2 * i2];
    const c10::BFloat16* high = 2 * i2 + 1 < n ? rows[2 * i2 + 1] : nullptr;
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + d)));
      const __m512i hi = high ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + d)))
                              : _mm512_setzero_si512();
      _mm512_storeu_si512(v_pairs + i2 * dim + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// p_pairs[i2 * padded + r]: row r's probabilities of keys 2 * i2 and 2 * i2 + 1 (zero past n), from scores_t.
void pair_probabilities(const float* scores_t, int64_t padded, int64_t n, uint32_t* p_pairs) {
  for (int64_t i2 = 0; i2 < (n + 1) / 2; ++i2)
    for (int64_t r = 0; r < padded; r += 16) {
      const __m512 high = 2 * i2 + 1 < n ? _mm512_loadu_ps(scores_t + (2 * i2 + 1) * padded + r) : _mm512_setzero_ps();
      _mm512_storeu_si512(p_pairs + i2 * padded + r, bf16_pairs(_mm512_loadu_ps(scores_t + 2 * i2 * padded + r), high));
    }
}

// acc[r][d0 ..] += sum over key pairs of row r's probabilities times the values, for R rows from r0 and V vectors of 16
// dims from d0: each vector of value pairs loaded once for the R rows.
template <int R, int V>
inline void accumulate_rows_bf16(const uint32_t* p_pairs, int64_t padded, int64_t r0, const uint32_t* v_pairs, int64_t pairs,
                                 int64_t dim, int64_t d0, float* acc) {
  __m512 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) a[r][v] = _mm512_loadu_ps(acc + (r0 + r) * dim + d0 + 16 * v);
  for (int64_t i2 = 0; i2 < pairs; ++i2) {
    __m512bh value[V];
    for (int v = 0; v < V; ++v) value[v] = as_pairs(_mm512_loadu_si512(v_pairs + i2 * dim + d0 + 16 * v));
    for (int r = 0; r < R; ++r) {
      const __m512bh p = broadcast_pair(p_pairs + i2 * padded + r0 + r);
      for (int v = 0; v < V; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], value[v], p);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (r0 + r) * dim + d0 + 16 * v, a[r][v]);
}

template <int R>
inline void accumulate_row_group_bf16(const uint32_t* p_pairs, int64_t padded, int64_t r0, const uint32_t* v_pairs, int64_t pairs,
                                      int64_t dim, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dim; d0 += 64) accumulate_rows_bf16<R, 4>(p_pairs, padded, r0, v_pairs, pairs, dim, d0, acc);
  for (; d0 < dim; d0 += 16) accumulate_rows_bf16<R, 1>(p_pairs, padded, r0, v_pairs, pairs, dim, d0, acc);
}

void span_values_bf16(const uint32_t* p_pairs, int64_t padded, const uint32_t* v_pairs, int64_t n, int64_t rows, int64_t dim,
                      float* acc) {
  const int64_t pairs = (n + 1) / 2;
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) accumulate_row_group_bf16<3>(p_pairs, padded, r, v_pairs, pairs, dim, acc);
  for (; r < rows; ++r) accumulate_row_group_bf16<1>(p_pairs, padded, r, v_pairs, pairs, dim, acc);
}
#endif

struct ChunkView {
  const float* query;  // the chunk's first query token
  int64_t query_stride;  // floats between tokens
  float* out;  // [query_len, H, D], contiguous
  const int64_t* table;
  int64_t context_len;  // tokens before the chunk
};

// A sliding window's mask over a span of n keys from span_start: a row at position p (the tile's rows from
// first_position on, group rows a position) sees no key at or before p - window.
void hide_passed_keys(float* scores_t, int64_t padded, int64_t rows, int64_t group, int64_t span_start, int64_t n,
                                        int64_t first_position, int64_t window) {
  const int64_t last_position = first_position + (rows - 1) / group;
  for (int64_t i = 0; i < n && span_start + i <= last_position - window; ++i)  // only keys some row's window has passed
    for (int64_t r = 0; r < rows; ++r)
      if (span_start + i <= first_position + r / group - window) scores_t[i * padded + r] = -std::numeric_limits<float>::infinity();
}

// One task: the tile's rows attend causally to keys [0, context_len + first + count) of the sequence; with a sliding
// window (Windowed, window > 0), a row at position p to keys (p - window, p] only. Windowed is a template argument so
// that the tile's loop without a window compiles as it does alone.
template <typename T, bool Windowed, bool Bf16 = false>
void attend_tile(const AttentionShape& s, const ChunkView& c, const PrefillTask& task, const T* k_cache, const T* v_cache,
                 int64_t span, int64_t window, TileScratch& w) {
  static_assert(!Bf16 || std::is_same_v<T, c10::BFloat16>, "bfloat16 products read a bfloat16 cache");
  const int64_t D = s.head_dim, rows = task.count * s.group, padded = round_up(rows, kLanes);
  std::fill(w.q_t.begin(), w.q_t.begin() + D * padded, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = c.query + (task.first + r / s.group) * c.query_stride + (task.kv_head * s.group + r % s.group) * D;
    for (int64_t d = 0; d < D; ++d) w.q_t[d * padded + r] = src[d] * s.scale;
  }
#if defined(PREFILL_BF16_PRODUCTS)
  if constexpr (Bf16) pair_queries(w.q_t.data(), padded, D, w.q_pairs.data());
#endif
  std::fill(w.acc.begin(), w.acc.begin() + rows * D, 0.f);
  std::fill(w.running_max.begin(), w.running_max.begin() + padded, -std::numeric_limits<float>::infinity());
  std::fill(w.running_sum.begin(), w.running_sum.begin() + padded, 0.f);
  const int64_t first_position = c.context_len + task.first, num_keys = first_position + task.count;
  // The first row's first key: the spans start there, as no row sees a key before it.
  const int64_t lowest_key = Windowed ? std::max<int64_t>(0, first_position - window + 1) : 0;
  for (int64_t span_start = lowest_key; span_start < num_keys; span_start += span) {
    const int64_t n = std::min(span, num_keys - span_start);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = span_start + i;
      const int64_t offset = c.table[key / s.block_size] * s.block_stride + (key % s.block_size) * s.row_stride +
                             task.kv_head * s.head_stride;
      if constexpr (Bf16) {
        w.key_rows_bf16[i] = k_cache + offset;
        w.value_rows_bf16[i] = v_cache + offset;
      } else {
        w.keys[i] = as_float(k_cache + offset, s.head_stride, w.key_rows.data() + i * D, D, s.head_stride);
        w.values[i] = as_float(v_cache + offset, s.head_stride, w.value_rows.data() + i * D, D, s.head_stride);
      }
    }
#if defined(PREFILL_BF16_PRODUCTS)
    if constexpr (Bf16) {
      span_scores_bf16(w.q_pairs.data(), padded, w.key_rows_bf16.data(), n, D, w.scores_t.data());
      pair_values(w.value_rows_bf16.data(), n, D, w.v_pairs.data());
    }
#endif
    if constexpr (!Bf16) span_scores(w.q_t.data(), padded, w.keys.data(), n, D, w.scores_t.data());
    if (s.softcap > 0.f) cap_scores(w.scores_t.data(), n * padded, s.softcap);
    for (int64_t i = std::max<int64_t>(0, first_position + 1 - span_start); i < n; ++i)  // causal: hide keys after a row
      for (int64_t r = 0; r < rows; ++r)
        if (span_start + i > first_position + r / s.group) w.scores_t[i * padded + r] = -std::numeric_limits<float>::infinity();
    if constexpr (Windowed) hide_passed_keys(w.scores_t.data(), padded, rows, s.group, span_start, n, first_position, window);
    // Every row sees its first key in the first span (it is at most kQueryTile keys after the span's start, and a span
    // holds more), so no row's max stays -inf (no inf - inf below).
    span_softmax<Bf16>(w.scores_t.data(), n, padded, w.running_max.data(), w.running_sum.data(), w.rescale.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) w.acc[r * D + d] *= w.rescale[r];
#if defined(PREFILL_BF16_PRODUCTS)
    if constexpr (Bf16) {
      pair_probabilities(w.scores_t.data(), padded, n, w.p_pairs.data());
      span_values_bf16(w.p_pairs.data(), padded, w.v_pairs.data(), n, rows, D, w.acc.data());
    }
#endif
    if constexpr (!Bf16) span_values(w.scores_t.data(), padded, w.values.data(), n, rows, D, w.acc.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / w.running_sum[r];
    float* dst = c.out + (task.first + r / s.group) * s.num_heads * D + (task.kv_head * s.group + r % s.group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = w.acc[r * D + d] * inv;
  }
}

}  // namespace

// The floats the prefill tiles' loops compute at a time in this build (1: no vector loops).
int64_t prefill_lanes() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return PrefillLanes::kWidth;
#else
  return 1;
#endif
}

// Whether this build's prefill attention multiplies in bfloat16 pairs over a bfloat16 cache (bf16_products): AVX-512 BF16.
bool prefill_bf16_products() {
#if defined(PREFILL_BF16_PRODUCTS)
  return true;
#else
  return false;
#endif
}

// query [B, H, D]; key_cache/value_cache [num_blocks, block_size, KV, D]; block_tables [B, max_blocks];
// seq_lens [B]. Returns [B, H, D] (contiguous). Query and result float32, the caches float32, bfloat16 or float16
// (int64 tables and lengths), contiguous but for the query's rows, read in place where each row's heads are contiguous
// (a view of the qkv GEMM's output).
at::Tensor paged_decode_attention(at::Tensor query_in, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t kv_format, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(query_in.dtype() == at::kFloat && query_in.dim() == 3, "query must be float32 [sequences, heads, head_dim]");
  const int64_t num_seqs = query_in.size(0), num_heads = query_in.size(1), head_dim = query_in.size(2);
  const bool rows_whole = query_in.stride(2) == 1 && query_in.stride(1) == head_dim;
  const at::Tensor query = rows_whole ? query_in : query_in.contiguous();
  check_caches(key_cache, value_cache);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(block_size <= kMaxBlockSize, "block_size must be <= ", kMaxBlockSize);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = at::empty({num_seqs, num_heads, head_dim}, query.options());
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const float* q_ptr = query.data_ptr<float>();
  const int64_t q_row_stride = query.stride(0);
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t head_stride = key_cache.size(3);  // row_width
  TORCH_CHECK(head_stride == row_width(head_dim, kv_format), "cache rows must be head_dim values (and an 8-bit row's scale)");
  const int64_t row_stride = num_kv_heads * head_stride;  // one token's K (or V) across heads
  const int64_t block_stride = block_size * row_stride;
  const float fscale = static_cast<float>(scale);

  const AttentionShape shape{num_heads, group, head_dim, block_size, row_stride, block_stride, fscale, head_stride,
                             static_cast<float>(softcap)};
  const DecodePlan plan(len_ptr, num_seqs, block_size, window);
  dispatch_cache_type(key_cache, kv_format, [&](auto element) {
    using T = decltype(element);
    const T* k_ptr = reinterpret_cast<const T*>(key_cache.data_ptr());
    const T* v_ptr = reinterpret_cast<const T*>(value_cache.data_ptr());
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (head_dim % 32 == 0) {
      decode_in_parts(shape, plan, out_ptr, [&] { return DecodeScratch(shape, plan.max_len); },
                      [&](const DecodePart& part, const DecodePart* next, DecodeScratch& w) {
                        const T* next_keys = next ? k_ptr + table_ptr[next->seq * max_blocks + next->first_block] * block_stride : nullptr;
                        attend_sequence_three_pass(shape, q_ptr + part.seq * q_row_stride, k_ptr, v_ptr, table_ptr + part.seq * max_blocks,
                                                   len_ptr[part.seq], plan.first_key[part.seq], part.first_block, part.end_block,
                                                   plan.max_len, w, next_keys);
                      });
      return;
    }
#endif
    decode_in_parts(shape, plan, out_ptr, [&] { return SequenceScratch(shape); },
                    [&](const DecodePart& part, const DecodePart*, SequenceScratch& w) {
                      attend_sequence(shape, q_ptr + part.seq * q_row_stride, k_ptr, v_ptr, table_ptr + part.seq * max_blocks, len_ptr[part.seq],
                                      plan.first_key[part.seq], part.first_block, part.end_block, w);
                    });
  });
  return out;
}

// Prefill chunks, all of a step's in one call. query [T, H, D] (token stride free, rows contiguous)
// holds every token of the step; chunk c's queries are rows [query_starts[c],
// query_starts[c] + query_lens[c]) at positions seq_lens[c] - query_lens[c] onwards, and its K/V
// (those of the chunk included, already written) are in the blocks of block_tables[c]. Writes those
// rows of out [T, H, D] (contiguous).
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, at::Tensor out, int64_t kv_format, int64_t window,
                             double softcap, bool bf16_products) {
  TORCH_CHECK(query.dtype() == at::kFloat && out.dtype() == at::kFloat, "query and out must be float32");
  TORCH_CHECK(!bf16_products || prefill_bf16_products(), "bf16_products needs a build with AVX-512 BF16 (prefill_bf16_products)");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be contiguous");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  check_caches(key_cache, value_cache);
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have query's shape");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.contiguous();
  auto starts = query_starts.contiguous(), qlens = query_lens.contiguous(), lens = seq_lens.contiguous();
  const int64_t num_chunks = tables.size(0), max_blocks = tables.size(1);
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t* qlen_ptr = qlens.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  const int64_t head_stride = key_cache.size(3);  // row_width
  TORCH_CHECK(head_stride == row_width(head_dim, kv_format), "cache rows must be head_dim values (and an 8-bit row's scale)");
  const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * head_stride;
  const AttentionShape shape{num_heads, group, head_dim, block_size, row_stride, block_size * row_stride, static_cast<float>(scale),
                             head_stride, static_cast<float>(softcap)};

  std::vector<PrefillTask> tasks;
  std::vector<int64_t> costs;
  for (int64_t c = 0; c < num_chunks; ++c) {
    TORCH_CHECK(qlen_ptr[c] >= 1 && qlen_ptr[c] <= len_ptr[c] && start_ptr[c] >= 0 && start_ptr[c] + qlen_ptr[c] <= query.size(0) &&
                    (len_ptr[c] + block_size - 1) / block_size <= max_blocks, "chunk ", c, " does not fit its query rows or block table");
    for (int64_t first = 0; first < qlen_ptr[c]; first += kQueryTile)
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        const int64_t count = std::min(kQueryTile, qlen_ptr[c] - first);
        tasks.push_back({c, g, first, count});
        const int64_t keys = len_ptr[c] - qlen_ptr[c] + first + count;
        costs.push_back(count * (window > 0 ? std::min(keys, window + count) : keys));
      }
  }
  const float* q_ptr = query.data_ptr<float>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const std::vector<int64_t> bounds = split_by_cost(costs.data(), num_tasks, std::min<int64_t>(at::get_num_threads(), num_tasks));
  dispatch_cache_type(key_cache, kv_format, [&](auto element) {
    using T = decltype(element);
    const T* k_ptr = reinterpret_cast<const T*>(key_cache.data_ptr());
    const T* v_ptr = reinterpret_cast<const T*>(value_cache.data_ptr());
    // bfloat16 products where asked and the cache holds bfloat16 rows of whole vectors; float32 products otherwise.
    const bool in_pairs = bf16_products && std::is_same_v<T, c10::BFloat16> && head_dim % 32 == 0;
    at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
      const int64_t span = std::max(kKeySpan, block_size);
      TileScratch scratch(kQueryTile * group, head_dim, span, in_pairs);
      for (int64_t part = begin; part < end; ++part)
        for (int64_t i = bounds[part]; i < bounds[part + 1]; ++i) {
          const int64_t c = tasks[i].chunk;
          const ChunkView view{q_ptr + start_ptr[c] * query.stride(0), query.stride(0), out_ptr + start_ptr[c] * num_heads * head_dim,
                               table_ptr + c * max_blocks, len_ptr[c] - qlen_ptr[c]};
#if defined(PREFILL_BF16_PRODUCTS)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (in_pairs) {
              if (window > 0)
                attend_tile<T, true, true>(shape, view, tasks[i], k_ptr, v_ptr, span, window, scratch);
              else
                attend_tile<T, false, true>(shape, view, tasks[i], k_ptr, v_ptr, span, 0, scratch);
              continue;
            }
          }
#endif
          if (window > 0)
            attend_tile<T, true>(shape, view, tasks[i], k_ptr, v_ptr, span, window, scratch);
          else
            attend_tile<T, false>(shape, view, tasks[i], k_ptr, v_ptr, span, 0, scratch);
        }
    });
  });
}

// rows [..., D + 4] of an 8-bit format (bytes, contiguous: e.g. a sequence's rows gathered from the cache) -> their
// values [..., D] in float32, as the kernels read them (dequantize_row); for the attention that runs in torch.
at::Tensor dequantize_kv_rows(const at::Tensor& rows, int64_t kv_format) {
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.is_contiguous() && rows.dim() >= 1 && rows.size(-1) > kScaleBytes,
              "rows must be contiguous bytes of 8-bit rows (head_dim values and a float32 scale)");
  const int64_t head_stride = rows.size(-1), head_dim = head_stride - kScaleBytes, num_rows = rows.numel() / head_stride;
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = head_dim;
  auto out = at::empty(shape, rows.options().dtype(at::kFloat));
  float* out_ptr = out.data_ptr<float>();
  dispatch_cache_type(rows, kv_format, [&](auto element) {
    using T = decltype(element);
    if constexpr (kEightBit<T>) {
      const T* in = reinterpret_cast<const T*>(rows.data_ptr());
      at::parallel_for(0, num_rows, 256, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) dequantize_row(in + r * head_stride, head_dim, out_ptr + r * head_dim);
      });
    }
  });
  return out;
}

// key/value [T, KV, D] (any token and head strides, rows contiguous) -> key_cache/value_cache
// [num_blocks, block_size, KV, D] at the flat slots of slot_mapping [T]. index_copy_ runs a generic
// strided loop with per-element index arithmetic; this is a copy of T rows, rounded to nearest even
// (as torch's .to()) when the cache stores bfloat16 or float16, and quantized (quantize_row) into a
// byte cache of an 8-bit format, whose rows are D + 4 bytes: with k_scale / v_scale where they are
// positive (a checkpoint's static scales), else with each row's own scale.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping, int64_t kv_format, double k_scale, double v_scale) {
  const bool narrow_source = key.scalar_type() == at::kBFloat16;  // a bfloat16 qkv GEMM's output, rounded there
  TORCH_CHECK((key.scalar_type() == at::kFloat || narrow_source) && value.scalar_type() == key.scalar_type(),
              "key and value must both be float32 or both bfloat16");
  check_caches(key_cache, value_cache);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t head_stride = row_width(head_dim, kv_format);
  TORCH_CHECK(slot_mapping.numel() == num_tokens && key_cache.size(2) == num_kv_heads && key_cache.size(3) == head_stride,
              "shapes of key, cache and slot_mapping disagree");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (num_tokens > 0) {
    const auto [low, high] = std::minmax_element(slots, slots + num_tokens);
    TORCH_CHECK(*low >= 0 && *high < num_slots, "slot ", *high, " outside the cache of ", num_slots, " slots (or ", *low, " < 0)");
  }
  const int64_t row = num_kv_heads * head_stride;
  const at::Tensor sources[2] = {key, value};
  const at::Tensor caches[2] = {key_cache, value_cache};
  const float fixed_scales[2] = {static_cast<float>(k_scale), static_cast<float>(v_scale)};
  std::vector<float> widened(narrow_source ? head_dim : 0);
  dispatch_cache_type(key_cache, kv_format, [&](auto element) {
    using T = decltype(element);
    for (int which = 0; which < 2; ++which) {
      const at::Tensor& src = sources[which];
      T* cache = reinterpret_cast<T*>(caches[which].data_ptr());
      for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          T* to = cache + slots[t] * row + h * head_stride;
          const int64_t offset = t * src.stride(0) + h * src.stride(1);
          const float* from;
          if (narrow_source) {
            const at::BFloat16* narrow = src.data_ptr<at::BFloat16>() + offset;
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
              std::memcpy(to, narrow, head_dim * sizeof(T));
              continue;
            }
            at::vec::convert(narrow, widened.data(), head_dim);
            from = widened.data();
          } else {
            from = src.data_ptr<float>() + offset;
          }
          if constexpr (std::is_same_v<T, float>)
            std::memcpy(to, from, head_dim * sizeof(float));
          else if constexpr (kEightBit<T>)
            quantize_row(from, head_dim, to, fixed_scales[which]);
          else
            at::vec::convert(from, to, head_dim);
        }
    }
  });
}
