// x @ W.T with bfloat16 products summed in float32 and float32 out: the lm_head's GEMM where GEMMs multiply in
// bfloat16. oneDNN's bfloat16 GEMMs return bfloat16, and logits rounded to it come in steps of 1/8 at their usual
// size, tying tokens that are not tied; this kernel keeps the sums as they are. It runs on AVX-512 BF16 dot products
// (vdpbf16ps: two bfloat16 products per float32 lane) where the build has them; elsewhere a scalar loop takes the same
// pairs in the same order (for tests: it is far slower than float32 GEMMs, and the engine does not choose it there).
//
// The weight is packed once into pairs along k: block b holds output rows 16b..16b+15, and for each pair of inputs
// (2j, 2j+1) 16 x 2 bfloat16 values, row by row: one 64-byte vector per pair, what one vdpbf16ps multiplies.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRowsPerBlock = 16;  // output rows (logits) per packed block: one float32 vector of sums
constexpr int kTileRows = 6;       // input rows a tile carries: 6 x 4 accumulators, 4 weight vectors and a broadcast
constexpr int kTileBlocks = 4;     //   fit the 32 vector registers
constexpr int64_t kChunkRows = 240; // input rows a task takes: their pairs stay in L2 while it sweeps its blocks

uint16_t bf16_bits(float value) { return c10::BFloat16(value).x; }  // rounded to nearest even

float bf16_value(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// rows x pairs words, each the bfloat16 values of inputs 2j (low half) and 2j + 1 (high half), zero past k.
std::vector<uint32_t> input_pairs(const float* x, int64_t rows, int64_t k, int64_t pairs) {
  std::vector<uint32_t> out(rows * pairs, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) out[r * pairs + c / 2] |= static_cast<uint32_t>(bf16_bits(x[r * k + c])) << (16 * (c % 2));
  }
  return out;
}

// A tile of rows x (blocks x 16) sums: x's rows (as pairs) against `blocks` consecutive packed blocks, stored into out
// (leading dimension ld), columns past `columns` left alone.
#if defined(__AVX512BF16__)
template <int Rows, int Blocks>
void tile(const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld, int64_t columns) {
  __m512 sums[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) sums[r][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh weights[Blocks];
    for (int b = 0; b < Blocks; ++b) weights[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + j) * 2 * kRowsPerBlock);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh input = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + j]));
      for (int b = 0; b < Blocks; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], input, weights[b]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      const int64_t left = columns - b * kRowsPerBlock;
      if (left >= kRowsPerBlock) {
        _mm512_storeu_ps(out + r * ld + b * kRowsPerBlock, sums[r][b]);
      } else if (left > 0) {
        _mm512_mask_storeu_ps(out + r * ld + b * kRowsPerBlock, static_cast<__mmask16>((1u << left) - 1), sums[r][b]);
      }
    }
  }
}
#else
template <int Rows, int Blocks>
void tile(const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld, int64_t columns) {
  for (int r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(columns, Blocks * kRowsPerBlock); ++c) {
      const uint16_t* block = w + (c / kRowsPerBlock) * pairs * 2 * kRowsPerBlock + (c % kRowsPerBlock) * 2;
      float sum = 0.f;
      for (int64_t j = 0; j < pairs; ++j) {  // as vdpbf16ps: the odd input's product first, then the even one's
        const uint32_t pair = x[r * pairs + j];
        const uint16_t* weight = block + j * 2 * kRowsPerBlock;
        sum += bf16_value(static_cast<uint16_t>(pair >> 16)) * bf16_value(weight[1]);
        sum += bf16_value(static_cast<uint16_t>(pair & 0xffff)) * bf16_value(weight[0]);
      }
      out[r * ld + c] = sum;
    }
  }
}
#endif

template <int Blocks>
void tile_of_rows(int rows, const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld, int64_t columns) {
  switch (rows) {
    case 6: tile<6, Blocks>(x, pairs, w, out, ld, columns); break;
    case 5: tile<5, Blocks>(x, pairs, w, out, ld, columns); break;
    case 4: tile<4, Blocks>(x, pairs, w, out, ld, columns); break;
    case 3: tile<3, Blocks>(x, pairs, w, out, ld, columns); break;
    case 2: tile<2, Blocks>(x, pairs, w, out, ld, columns); break;
    default: tile<1, Blocks>(x, pairs, w, out, ld, columns); break;
  }
}

void any_tile(int rows, int blocks, const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld, int64_t columns) {
  static_assert(kTileBlocks == 4 && kTileRows == 6, "the switches below spell out the tile sizes");
  switch (blocks) {
    case 4: tile_of_rows<4>(rows, x, pairs, w, out, ld, columns); break;
    case 3: tile_of_rows<3>(rows, x, pairs, w, out, ld, columns); break;
    case 2: tile_of_rows<2>(rows, x, pairs, w, out, ld, columns); break;
    default: tile_of_rows<1>(rows, x, pairs, w, out, ld, columns); break;
  }
}

}  // namespace

bool bf16_dot_products() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a 2-D CPU tensor [out_features, in_features]");
  const auto values = weight.detach().to(at::kFloat).contiguous();
  const int64_t n = values.size(0), k = values.size(1);
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock, pairs = (k + 1) / 2;
  auto packed = at::zeros({blocks, pairs, 2 * kRowsPerBlock}, values.options().dtype(at::kShort));
  const float* src = values.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < kRowsPerBlock && b * kRowsPerBlock + i < n; ++i) {
        const float* row = src + (b * kRowsPerBlock + i) * k;
        for (int64_t c = 0; c < k; ++c) dst[(b * pairs + c / 2) * 2 * kRowsPerBlock + i * 2 + c % 2] = bf16_bits(row[c]);
      }
    }
  });
  return packed;
}

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort && packed.size(2) == 2 * kRowsPerBlock,
              "packed must come from pack_bf16_pairs");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kRowsPerBlock && out_features <= packed.size(0) * kRowsPerBlock,
              "out_features (", out_features, ") must be the packed weight's");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor");
  const int64_t pairs = packed.size(1);
  const int64_t k = x.size(-1);
  TORCH_CHECK((k + 1) / 2 == pairs, "x's last dimension (", k, ") must be the packed weight's in_features");
  const auto rows_in = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = rows_in.size(0), blocks = packed.size(0);
  const auto pairs_of_x = input_pairs(rows_in.data_ptr<float>(), m, k, pairs);
  at::Tensor sums;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->numel() == m * out_features,
                "out must be a contiguous float32 tensor of ", m, " x ", out_features, " values");
    sums = out->view({m, out_features});
  } else {
    sums = at::empty({m, out_features}, rows_in.options());
  }
  float* o = sums.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  const int64_t panels = (blocks + kTileBlocks - 1) / kTileBlocks, chunks = (m + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task / panels, first_block = (task % panels) * kTileBlocks;
      const int tile_blocks = static_cast<int>(std::min<int64_t>(kTileBlocks, blocks - first_block));
      const int64_t columns = std::min<int64_t>(tile_blocks * kRowsPerBlock, out_features - first_block * kRowsPerBlock);
      const int64_t last_row = std::min(m, (chunk + 1) * kChunkRows);
      for (int64_t r = chunk * kChunkRows; r < last_row; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, last_row - r));
        any_tile(rows, tile_blocks, pairs_of_x.data() + r * pairs, pairs, w + first_block * pairs * 2 * kRowsPerBlock,
                 o + r * out_features + first_block * kRowsPerBlock, out_features, columns);
      }
    }
  });
  auto out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  return sums.view(out_shape);
}
