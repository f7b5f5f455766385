// Vectors of floats for the kernels' loops: 8 lanes where the build has AVX2 and FMA, 16 where it has AVX-512.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

struct Floats8 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
  static __m256 fold(Vec a) { return a; }  // to 8 lanes, for the horizontal sums
};

// The sum of a vector's 8 lanes.
inline float horizontal_sum(__m256 a) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}

// The largest magnitude of n floats (n a multiple of 8), a NaN passed over: MAXPS returns its second operand when the
// first is a NaN.
inline float largest_magnitude(const float* src, int64_t n) {
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 largest = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) largest = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + i), magnitude_bits), largest);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif

#if defined(__AVX512F__)
struct Floats16 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
  static __m256 fold(Vec a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
};
#endif
