// Fused element-wise layers for CPU float32 (and bfloat16 where a bfloat16 GEMM's output or input is): RMSNorm (with
// the residual add), SiLU-and-mul and rotary embedding. Each replaces several torch ops; at decode batch sizes the
// per-op overhead and the extra passes over memory cost more than the arithmetic. Also the argmax of logit rows, which
// torch computes one value at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "parallel_rows.h"
#include "silu_row.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// t's rows as the row-wise kernels read them: float32 (or bfloat16, where or_bfloat16: a bfloat16 GEMM's output) on
// the CPU, contiguous in its last dimension.
void check_rows(const at::Tensor& t, const char* name, bool or_bfloat16 = false) {
  const bool bfloat16 = or_bfloat16 && t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || bfloat16), name,
              or_bfloat16 ? " must be a float32 or bfloat16 CPU tensor" : " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// out = weight * x / sqrt(mean(x^2) + eps), as the reference: scale first, then weight.
void rms_norm_row(float* out, const float* x, const float* weight, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum_sq = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  const Vec inv(inv_rms);
  for (i = 0; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(weight + i) * (Vec::loadu(x + i) * inv)).store(out + i);
  for (; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

}  // namespace

namespace {

void check_norm_output(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "the normalized output must be float32 or bfloat16");
}

// The normalized row of x into out: as it is computed in float32, or rounded once to bfloat16 (as .to() rounds) through
// the float32 row buffer, for a GEMM that multiplies bfloat16.
void rms_norm_row_into(const at::Tensor& out, int64_t r, const float* x, const float* weight, int64_t n, float eps, float* buffer) {
  if (out.scalar_type() == at::kFloat) {
    rms_norm_row(out.data_ptr<float>() + r * n, x, weight, n, eps);
    return;
  }
  rms_norm_row(buffer, x, weight, n, eps);
  at::vec::convert(buffer, out.data_ptr<at::BFloat16>() + r * n, n);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType out_dtype) {
  check_rows(x, "x");
  check_norm_output(out_dtype);
  const int64_t n = x.size(-1);
  auto input = x.contiguous().view({-1, n});
  auto w = weight.contiguous();
  auto out = at::empty(input.sizes(), input.options().dtype(out_dtype));
  const float *in_ptr = input.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
  at::parallel_for(0, input.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    for (int64_t r = begin; r < end; ++r) rms_norm_row_into(out, r, in_ptr + r * n, w_ptr, n, static_cast<float>(eps), buffer.data());
  });
  return out.view(x.sizes());
}

// x may come in bfloat16 (a GEMM's output, rounded there): it is widened as it is added to the float32 residual.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps, at::ScalarType out_dtype) {
  check_rows(x, "x", /*or_bfloat16=*/true);
  check_rows(residual, "residual");
  check_norm_output(out_dtype);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  const int64_t n = x.size(-1);
  auto a = x.contiguous().view({-1, n});
  auto b = residual.contiguous().view({-1, n});
  auto w = weight.contiguous();
  auto sum = at::empty_like(b);
  auto out = at::empty(b.sizes(), b.options().dtype(out_dtype));
  const bool narrow_x = a.scalar_type() == at::kBFloat16;
  const float *b_ptr = b.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
  float* sum_ptr = sum.data_ptr<float>();
  at::parallel_for(0, a.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    for (int64_t r = begin; r < end; ++r) {
      float* s = sum_ptr + r * n;
      const float* x_row = s;
      if (narrow_x) {
        at::vec::convert(a.data_ptr<at::BFloat16>() + r * n, s, n);
      } else {
        x_row = a.data_ptr<float>() + r * n;
      }
      at::vec::map2<float>([](Vec p, Vec q) { return p + q; }, s, x_row, b_ptr + r * n, n);
      rms_norm_row_into(out, r, s, w_ptr, n, static_cast<float>(eps), buffer.data());
    }
  });
  return {out.view(x.sizes()), sum.view(x.sizes())};
}

template <typename In, typename Out>
void silu_and_mul_rows(const at::Tensor& input, at::Tensor& out, int64_t width) {
  const In* in_ptr = input.data_ptr<In>();
  Out* out_ptr = out.data_ptr<Out>();
  at::parallel_for(0, input.size(0), grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_and_mul_row(out_ptr + r * width, in_ptr + r * 2 * width, in_ptr + r * 2 * width + width, width);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(gate_up.device().is_cpu() && (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "gate_up must be a float32 or bfloat16 CPU tensor");
  const auto in_dtype = gate_up.scalar_type(), to = out_dtype.value_or(in_dtype);
  TORCH_CHECK(to == in_dtype || (in_dtype == at::kFloat && to == at::kBFloat16),
              "out_dtype must be gate_up's dtype, or bfloat16 for a float32 gate_up");
  const int64_t width = gate_up.size(-1) / 2;
  auto input = gate_up.contiguous().view({-1, 2 * width});
  auto out = at::empty({input.size(0), width}, input.options().dtype(to));
  if (in_dtype == at::kBFloat16) {
    silu_and_mul_rows<c10::BFloat16, c10::BFloat16>(input, out, width);
  } else if (to == at::kBFloat16) {
    silu_and_mul_rows<float, c10::BFloat16>(input, out, width);
  } else {
    silu_and_mul_rows<float, float>(input, out, width);
  }
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  return out.view(sizes);
}

namespace {

// Neox-style rotation of x [tokens, heads, head_dim] in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in
// float32.
void rotate_head(float* x1, float* x2, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float a = x1[d], b = x2[d];
    x1[d] = a * cos[d] - b * sin[d];
    x2[d] = b * cos[half + d] + a * sin[half + d];
  }
}

// A bfloat16 x (a bfloat16 qkv GEMM's output) is widened a head at a time, rotated as float32 is, and rounded once.
template <typename T>
void rotate_in_place(at::Tensor& x, const int64_t* positions, const float* cos_ptr, const float* sin_ptr, int64_t head_dim) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), half = head_dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* x_ptr = x.data_ptr<T>();
  at::parallel_for(0, num_tokens, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_ptr + positions[t] * head_dim;
      const float* sin = sin_ptr + positions[t] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* head = x_ptr + t * token_stride + h * head_stride;
        if constexpr (std::is_same_v<T, float>) {
          rotate_head(head, head + half, cos, sin, half);
        } else {
          at::vec::convert(head, widened.data(), head_dim);
          rotate_head(widened.data(), widened.data() + half, cos, sin, half);
          at::vec::convert(widened.data(), head, head_dim);
        }
      }
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache) {
  check_rows(query, "query", /*or_bfloat16=*/true);
  check_rows(key, "key", /*or_bfloat16=*/true);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key must have one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous(), "cos/sin caches must be contiguous");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(cos_cache.size(1) == head_dim, "cos/sin caches must have head_dim columns");
  const int64_t* pos = positions.data_ptr<int64_t>();
  // Checked here, on the raw ids (no torch op per layer): a bad position would read outside the caches.
  const int64_t* pos_end = pos + positions.numel();
  if (pos != pos_end) {
    const auto [low, high] = std::minmax_element(pos, pos_end);
    TORCH_CHECK(*low >= 0 && *high < cos_cache.size(0), "position ", *high, " beyond the rotary cache (or ", *low, " < 0)");
  }
  const float *cos = cos_cache.data_ptr<float>(), *sin = sin_cache.data_ptr<float>();
  if (query.scalar_type() == at::kBFloat16) {
    rotate_in_place<at::BFloat16>(query, pos, cos, sin, head_dim);
    rotate_in_place<at::BFloat16>(key, pos, cos, sin, head_dim);
  } else {
    rotate_in_place<float>(query, pos, cos, sin, head_dim);
    rotate_in_place<float>(key, pos, cos, sin, head_dim);
  }
}

// The index torch.argmax gives for one row: the first NaN if there is one, else the first largest value.
int64_t argmax_row(const float* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(x + i));  // NaN-propagating
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; i < n; ++i) top = std::isnan(x[i]) || x[i] > top ? x[i] : top;
  if (std::isnan(top)) return std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x;
  const Vec target(top);
  for (i = 0; i + Vec::size() <= n; i += Vec::size())
    if (Vec::loadu(x + i).eq(target).zero_mask() != (1 << Vec::size()) - 1) break;  // a lane equals the max
  return std::find(x + i, x + n, top) - x;
}

// torch.argmax(x, dim=-1) of a [rows, n] float32 tensor, with its NaN and tie rules: torch's own reduction
// carries the index along, one value at a time, several times slower on a decode batch's logit rows
// than this vectorized max-then-find (docs/cpu.md).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "x must be a contiguous [rows, n > 0] tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) indices[r] = argmax_row(data + r * n, n);
  });
  return out;
}
