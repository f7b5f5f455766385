// LoRA products added to a linear layer's output, each row of the batch with its own adapter (or none).
//
// Rows come in groups that share an adapter (decode rows sorted by adapter, a prompt chunk's rows); a task takes up
// to four rows of one group: their x·A (the "shrink": K-long sums into the adapter's few columns) into a small
// buffer, then that times B added to their output (the "expand": each column's B row over its part of the output).
// Both loops keep four rows' accumulators in registers and read each weight vector once for the four, so the
// products run at the FMA rate where a GEMM library, tuned for wide matrices, would not on these skinny ones; and
// one call covers every adapter of the step, where torch would need several operations per adapter and layer.
//
// Each output is one float32 accumulation in a fixed order over k (then over the adapter's columns), whatever the
// batch: a row's result does not depend on the other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <vector>

#include "ops.h"
#include "vec_lanes.h"

namespace {

// Vectors of floats as wide as the build allows.
#if defined(__AVX512F__)
using Floats = Floats16;
#elif defined(__AVX2__) && defined(__FMA__)
using Floats = Floats8;
#else
struct Floats {
  using Vec = float;
  static constexpr int64_t kWidth = 1;
  static Vec zero() { return 0.f; }
  static Vec broadcast(float x) { return x; }
  static Vec load(const float* p) { return *p; }
  static void store(float* p, Vec v) { *p = v; }
  static Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
};
#endif

constexpr int64_t kTileRows = 4;
// Rows' work (multiply-adds) below which a call stays on one thread: waking the others would cost more.
constexpr int64_t kParallelMacs = 1 << 18;

// One adapter's weights for this layer, in the flat tensors: A transposed, [K][width] with width a whole number of
// vectors (zero columns padding it), and its parts.
struct Adapter {
  int32_t a_offset, width, parts_begin, parts_end;
};
// A part: the adapter's columns [c0, c1) write outputs [n0, n1); its B rows, [c1 - c0][n1 - n0], at b_offset.
struct Part {
  int32_t c0, c1, n0, n1, b_offset;
};

template <int M>
void shrink(const std::array<const float*, kTileRows>& x, int64_t k_len, const float* a, int64_t width, float* h) {
  using F = Floats;
  for (int64_t w = 0; w < width; w += F::kWidth) {
    typename F::Vec acc[M];
    for (int r = 0; r < M; ++r) acc[r] = F::zero();
    for (int64_t k = 0; k < k_len; ++k) {
      const typename F::Vec av = F::load(a + k * width + w);
      for (int r = 0; r < M; ++r) acc[r] = F::fma(F::broadcast(x[r][k]), av, acc[r]);
    }
    for (int r = 0; r < M; ++r) F::store(h + r * width + w, acc[r]);
  }
}

template <int M>
void expand(const float* h, int64_t width, const Part& part, const float* b, const std::array<float*, kTileRows>& out) {
  using F = Floats;
  const int64_t n_len = part.n1 - part.n0;
  const float* b_part = b + part.b_offset;
  int64_t n = 0;
  for (; n + F::kWidth <= n_len; n += F::kWidth) {
    typename F::Vec acc[M];
    for (int r = 0; r < M; ++r) acc[r] = F::load(out[r] + part.n0 + n);
    for (int64_t c = part.c0; c < part.c1; ++c) {
      const typename F::Vec bv = F::load(b_part + (c - part.c0) * n_len + n);
      for (int r = 0; r < M; ++r) acc[r] = F::fma(F::broadcast(h[r * width + c]), bv, acc[r]);
    }
    for (int r = 0; r < M; ++r) F::store(out[r] + part.n0 + n, acc[r]);
  }
  for (; n < n_len; ++n) {  // the outputs past the last whole vector
    for (int r = 0; r < M; ++r) {
      float sum = out[r][part.n0 + n];
      for (int64_t c = part.c0; c < part.c1; ++c) sum += h[r * width + c] * b_part[(c - part.c0) * n_len + n];
      out[r][part.n0 + n] = sum;
    }
  }
}

template <int M>
void tile(const std::array<const float*, kTileRows>& x, int64_t k_len, const Adapter& adapter, const float* a,
          const Part* parts, const float* b, const std::array<float*, kTileRows>& out, float* h) {
  shrink<M>(x, k_len, a + adapter.a_offset, adapter.width, h);
  for (int32_t p = adapter.parts_begin; p < adapter.parts_end; ++p) expand<M>(h, adapter.width, parts[p], b, out);
}

// A row of T as float32: the row itself, or its copy widened into buffer.
const float* float_row(const float* row, int64_t, float*) { return row; }
const float* float_row(const c10::BFloat16* row, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
  return buffer;
}

template <typename TX, typename TO>
void add_lora(at::Tensor& out, const at::Tensor& x, const int32_t* rows, const int32_t* groups, int64_t num_groups,
              const float* a, const float* b, const Adapter* adapters, const Part* parts) {
  const int64_t k_len = x.size(1), n_len = out.size(1), ldx = x.stride(0), ldo = out.stride(0);
  const TX* x_ptr = x.data_ptr<TX>();
  TO* out_ptr = out.data_ptr<TO>();
  struct Task {
    int32_t first, count, slot;
  };
  std::vector<Task> tasks;
  int64_t macs = 0, max_width = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int32_t begin = groups[3 * g], end = groups[3 * g + 1], slot = groups[3 * g + 2];
    const Adapter& adapter = adapters[slot];
    if (adapter.width == 0) continue;  // the adapter leaves this layer as it is
    for (int32_t r = begin; r < end; r += kTileRows) tasks.push_back({r, std::min<int32_t>(kTileRows, end - r), slot});
    max_width = std::max<int64_t>(max_width, adapter.width);
    macs += (end - begin) * adapter.width * (k_len + n_len);
  }
  if (tasks.empty()) return;
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(tasks.size()) * kParallelMacs / std::max<int64_t>(1, macs));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kTileRows * max_width);
    std::vector<float> x_buffer(std::is_same_v<TX, float> ? 0 : kTileRows * k_len);
    std::vector<float> out_buffer(std::is_same_v<TO, float> ? 0 : kTileRows * n_len);
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      std::array<const float*, kTileRows> x_rows{};
      std::array<float*, kTileRows> out_rows{};
      for (int r = 0; r < task.count; ++r) {
        const int64_t row = rows[task.first + r];
        x_rows[r] = float_row(x_ptr + row * ldx, k_len, x_buffer.data() + r * k_len);
        if constexpr (std::is_same_v<TO, float>) {
          out_rows[r] = out_ptr + row * ldo;
        } else {
          out_rows[r] = out_buffer.data() + r * n_len;
          for (int64_t n = 0; n < n_len; ++n) out_rows[r][n] = static_cast<float>(out_ptr[row * ldo + n]);
        }
      }
      const Adapter& adapter = adapters[task.slot];
      switch (task.count) {
        case 1: tile<1>(x_rows, k_len, adapter, a, parts, b, out_rows, h.data()); break;
        case 2: tile<2>(x_rows, k_len, adapter, a, parts, b, out_rows, h.data()); break;
        case 3: tile<3>(x_rows, k_len, adapter, a, parts, b, out_rows, h.data()); break;
        default: tile<4>(x_rows, k_len, adapter, a, parts, b, out_rows, h.data()); break;
      }
      if constexpr (!std::is_same_v<TO, float>) {
        for (int r = 0; r < task.count; ++r) {
          const int64_t row = rows[task.first + r];
          for (int64_t n = 0; n < n_len; ++n) out_ptr[row * ldo + n] = static_cast<TO>(out_rows[r][n]);
        }
      }
    }
  });
}

void check_table(const at::Tensor& t, int64_t columns, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 2 && t.size(1) == columns,
              name, " must be a contiguous int32 CPU tensor of ", columns, " columns");
}

}  // namespace

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& groups, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& adapters, const at::Tensor& parts) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0), "out and x must be [rows, features] of the same rows");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "out and x must be contiguous in their last dimension");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() && b.is_contiguous(),
              "a and b must be contiguous float32 tensors");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous(), "rows must be a contiguous int32 tensor");
  check_table(groups, 3, "groups");
  check_table(adapters, sizeof(Adapter) / sizeof(int32_t), "adapters");
  check_table(parts, sizeof(Part) / sizeof(int32_t), "parts");
  const auto* adapter_table = reinterpret_cast<const Adapter*>(adapters.data_ptr<int32_t>());
  const auto* part_table = reinterpret_cast<const Part*>(parts.data_ptr<int32_t>());
  auto run = [&](auto x_type, auto out_type) {
    add_lora<decltype(x_type), decltype(out_type)>(out, x, rows.data_ptr<int32_t>(), groups.data_ptr<int32_t>(), groups.size(0),
                                                   a.data_ptr<float>(), b.data_ptr<float>(), adapter_table, part_table);
  };
  const bool x_float = x.scalar_type() == at::kFloat, out_float = out.scalar_type() == at::kFloat;
  TORCH_CHECK((x_float || x.scalar_type() == at::kBFloat16) && (out_float || out.scalar_type() == at::kBFloat16),
              "out and x must be float32 or bfloat16");
  if (x_float && out_float) run(float{}, float{});
  else if (x_float) run(float{}, c10::BFloat16{});
  else if (out_float) run(c10::BFloat16{}, float{});
  else run(c10::BFloat16{}, c10::BFloat16{});
}
