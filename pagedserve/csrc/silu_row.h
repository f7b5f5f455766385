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
