// int8 GEMMs with dynamic activation scales (W8A8): each row of the activations (times a per-column multiplier where
// the weight was smoothed, SmoothQuant's x / s) is rounded to int8 with a scale of its own, multiplied by int8 weights
// (a scale per output channel) into int32 sums by oneDNN's integer kernels (AVX-512 VNNI / AMX int8 where the
// processor has them), and the sums are scaled back by row and column in one pass. Rounding and scaling here rather
// than in torch ops spares the passes over memory that each torch op makes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "parallel_rows.h"
#include "silu_row.h"

namespace {

// q = round(x * m / scale), scale = max |x * m| / 127 (symmetric: int8's -128 is never used, so -q is always
// representable); m: the column multipliers, or none.
template <typename T>
float quantize_row(int8_t* q, float* scaled, const T* x, const float* m, int64_t n) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) {
    scaled[i] = m != nullptr ? static_cast<float>(x[i]) * m[i] : static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(scaled[i]));
  }
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(scaled[i] * inverse));
  return amax / 127.f;
}

template <typename T>
void quantize_rows(const at::Tensor& x, const float* multipliers, at::Tensor& q, at::Tensor& scales) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* in = x.data_ptr<T>();
  int8_t* out = q.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(n);
    for (int64_t r = begin; r < end; ++r) s[r] = quantize_row(out + r * n, scaled.data(), in + r * n, multipliers, n);
  });
}

// out[r, c] = sums[r, c] * row_scales[r] * col_scales[c] (+ bias[c]), in out's dtype.
template <typename T>
void scale_sums(const at::Tensor& sums, const at::Tensor& row_scales, const at::Tensor& col_scales, const float* bias, at::Tensor& out) {
  const int64_t rows = sums.size(0), n = sums.size(1);
  const int32_t* acc = sums.data_ptr<int32_t>();
  const float *rs = row_scales.data_ptr<float>(), *cs = col_scales.data_ptr<float>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      T* dst = o + r * n;
      const float row = rs[r];
      if (bias != nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(static_cast<float>(a[c]) * row * cs[c] + bias[c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(static_cast<float>(a[c]) * row * cs[c]);
      }
    }
  });
}

// out[r, :] = silu(gate) * up of row r's scaled sums, gate the first half of its columns and up the second.
void scale_sums_silu_and_mul(const at::Tensor& sums, const at::Tensor& row_scales, const at::Tensor& col_scales, at::Tensor& out) {
  const int64_t rows = sums.size(0), n = sums.size(1), half = n / 2;
  const int32_t* acc = sums.data_ptr<int32_t>();
  const float *rs = row_scales.data_ptr<float>(), *cs = col_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(n);  // one row's gate and up, kept in cache between the two passes
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      const float row = rs[r];
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) scaled[c] = static_cast<float>(a[c]) * row * cs[c];
      silu_and_mul_row(o + r * half, scaled.data(), scaled.data() + half, half);
    }
  });
}

// x's rows (times the column multipliers, if given) rounded to int8 at max |row| / 127: (int8 rows, float32 scales).
std::tuple<at::Tensor, at::Tensor> round_rows(const at::Tensor& x, const c10::optional<at::Tensor>& multipliers) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  auto input = x.contiguous();
  at::Tensor m;
  if (multipliers.has_value() && multipliers->defined()) {
    m = multipliers->to(at::kFloat).contiguous();
    TORCH_CHECK(m.numel() == input.size(1), "multipliers must hold one value per column of x (", input.size(1), ")");
  }
  const float* m_ptr = m.defined() ? m.data_ptr<float>() : nullptr;
  auto q = at::empty(input.sizes(), input.options().dtype(at::kChar));
  auto scales = at::empty({input.size(0)}, input.options().dtype(at::kFloat));
  if (input.scalar_type() == at::kFloat) {
    quantize_rows<float>(input, m_ptr, q, scales);
  } else {
    quantize_rows<at::BFloat16>(input, m_ptr, q, scales);
  }
  return {q, scales};
}

// x's rows rounded to int8 (times the multipliers) and multiplied by weight into int32 sums.
std::tuple<at::Tensor, at::Tensor> int8_sums(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scales,
                                             const c10::optional<at::Tensor>& input_multipliers) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight must be int8 [out_features, in_features]");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.numel() == weight.size(0),
              "weight_scales must be float32, one per output feature");
  TORCH_CHECK(x.size(-1) == weight.size(1), "x's last dimension (", x.size(-1), ") must be weight's in_features (", weight.size(1), ")");
  auto [q, row_scales] = round_rows(x.reshape({-1, weight.size(1)}), input_multipliers);
  return {at::_int_mm(q, weight.t()), row_scales};
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scales,
                       const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                       const c10::optional<at::Tensor>& input_multipliers) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  auto [sums, row_scales] = int8_sums(x, weight, weight_scales, input_multipliers);
  const int64_t out_features = weight.size(0);
  auto out = at::empty({sums.size(0), out_features}, x.options().dtype(out_dtype));
  at::Tensor bias_values;
  if (bias.has_value() && bias->defined()) bias_values = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  auto col_scales = weight_scales.contiguous();
  if (out_dtype == at::kFloat) {
    scale_sums<float>(sums, row_scales, col_scales, bias_ptr, out);
  } else {
    scale_sums<at::BFloat16>(sums, row_scales, col_scales, bias_ptr, out);
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  return out.view(out_shape);
}

at::Tensor int8_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scales,
                                    const c10::optional<at::Tensor>& input_multipliers) {
  TORCH_CHECK(weight.size(0) % 2 == 0, "a gate-up weight has an even number of output features (gate, then up)");
  auto [sums, row_scales] = int8_sums(x, weight, weight_scales, input_multipliers);
  const int64_t width = weight.size(0) / 2;
  auto out = at::empty({sums.size(0), width}, x.options().dtype(at::kFloat));
  scale_sums_silu_and_mul(sums, row_scales, weight_scales.contiguous(), out);
  auto out_shape = x.sizes().vec();
  out_shape.back() = width;
  return out.view(out_shape);
}
