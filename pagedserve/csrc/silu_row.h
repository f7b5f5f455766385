// SiLU-and-mul of one row, shared by the float32 layer (layer_ops.cpp) and the int8 gate-up GEMM that applies it as it
// scales its sums (int8_gemm.cpp), so both compute it the same way.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

// out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up, as torch computes silu.
inline void silu_and_mul_row(float* out, const float* gate, const float* up, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  at::vec::map2<float>([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; }, out, gate, up, width);
}

// The same of a bfloat16 row: widened, computed in float32 as above, rounded once to bfloat16 (torch's bfloat16 ops
// round silu(gate) first, then the product).
inline void silu_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  const auto silu_mul = [](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; };
  int64_t i = 0;
  for (; i + BVec::size() <= width; i += BVec::size()) {
    auto [g0, g1] = at::vec::convert_bfloat16_float(BVec::loadu(gate + i));
    auto [u0, u1] = at::vec::convert_bfloat16_float(BVec::loadu(up + i));
    at::vec::convert_float_bfloat16(silu_mul(g0, u0), silu_mul(g1, u1)).store(out + i);
  }
  for (; i < width; ++i) {
    const float g = gate[i];
    out[i] = c10::BFloat16(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}
