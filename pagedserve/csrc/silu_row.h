// SiLU-and-mul of one row, shared by the float32 layer (layer_ops.cpp) and the int8 gate-up GEMM that applies it as it
// scales its sums (int8_gemm.cpp), so both compute it the same way.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

// silu(g) * u = g / (1 + exp(-g)) * u, as torch computes silu: the float32 rows' formula, whatever they are written in.
inline at::vec::Vectorized<float> silu_and_mul_exact(at::vec::Vectorized<float> g, at::vec::Vectorized<float> u) {
  return g / (at::vec::Vectorized<float>(1.f) + g.neg().exp()) * u;
}

// out[i] = silu(gate[i]) * up[i].
inline void silu_and_mul_row(float* out, const float* gate, const float* up, int64_t width) {
  at::vec::map2<float>(silu_and_mul_exact, out, gate, up, width);
}

// silu(g) * u of float32 vectors whose result is rounded to bfloat16 next: where the build has AVX-512, exp in its
// faster form and the reciprocal as an estimate and one Newton step (a few float32 ulps off, far below bfloat16's
// step) rather than the division, which bounds the exact loop. g is kept above -87 inside the sigmoid so that
// exp(-g) stays finite and the Newton step never meets inf * 0; the product still takes g itself (and its NaN).
inline at::vec::Vectorized<float> silu_and_mul_to_round(at::vec::Vectorized<float> g, at::vec::Vectorized<float> u) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 bounded = _mm512_max_ps(_mm512_set1_ps(-87.f), g);
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), Vec(_mm512_sub_ps(_mm512_setzero_ps(), bounded)).exp_u20());
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return Vec(_mm512_mul_ps(_mm512_mul_ps(g, r), u));
#else
  return g / (Vec(1.f) + g.neg().exp()) * u;
#endif
}

// The same of a bfloat16 row: widened, computed in float32 as above, rounded once to bfloat16 (torch's bfloat16 ops
// round silu(gate) first, then the product).
inline void silu_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t width) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  int64_t i = 0;
  for (; i + BVec::size() <= width; i += BVec::size()) {
    auto [g0, g1] = at::vec::convert_bfloat16_float(BVec::loadu(gate + i));
    auto [u0, u1] = at::vec::convert_bfloat16_float(BVec::loadu(up + i));
    at::vec::convert_float_bfloat16(silu_and_mul_to_round(g0, u0), silu_and_mul_to_round(g1, u1)).store(out + i);
  }
  for (; i < width; ++i) {
    const float g = gate[i];
    out[i] = c10::BFloat16(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

// The float32 row's values rounded to bfloat16 (the input of a GEMM that multiplies it rounded so): the same bits as
// the float32 row's output converted after, without writing it out wide first.
inline void silu_and_mul_row(c10::BFloat16* out, const float* gate, const float* up, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  int64_t i = 0;
  for (; i + BVec::size() <= width; i += BVec::size()) {
    const Vec low = silu_and_mul_exact(Vec::loadu(gate + i), Vec::loadu(up + i));
    const Vec high = silu_and_mul_exact(Vec::loadu(gate + i + Vec::size()), Vec::loadu(up + i + Vec::size()));
    at::vec::convert_float_bfloat16(low, high).store(out + i);
  }
  if (i < width) {  // the last values through the float32 row's own loop
    float rest[BVec::size()];
    silu_and_mul_row(rest, gate + i, up + i, width - i);
    for (int64_t j = 0; j < width - i; ++j) out[i + j] = c10::BFloat16(rest[j]);
  }
}
