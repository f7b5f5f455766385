// GGUF Q4_0 / Q4_1 blocks repacked once into the records the bfloat16 GEMM's tiles dequantize (tile_blocks.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>

#include "gguf_block.h"
#include "ops.h"
#include "tile_blocks.h"

namespace {

uint16_t half_bits(float value) { return c10::Half(value).x; }

// Record of output block b and GGUF block c from the weight's rows (row_bytes each, n of them).
void pack_record(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t qtype, int64_t b, int64_t c, uint8_t* record) {
  const int64_t block_bytes = quantized_block_bytes(qtype);
  uint16_t* halves = reinterpret_cast<uint16_t*>(record);
  uint8_t* values = record + kTileBlockHeader;
  for (int64_t o = 0; o < kTileBlockOutputs && b * kTileBlockOutputs + o < n; ++o) {
    const uint8_t* block = w + (b * kTileBlockOutputs + o) * row_bytes + c * block_bytes;
    const float d = half_at(block);
    std::memcpy(halves + o, block, 2);
    halves[kTileBlockOutputs + o] = half_bits(block_min(block, qtype, d));  // -8d is exact in a half as d is
    const uint8_t* q = nibbles_of(block, qtype);  // byte i: value i in the low nibble, i + 16 in the high one
    const auto value = [q](int64_t i) { return i < 16 ? q[i] & 0x0F : q[i - 16] >> 4; };
    for (int64_t j = 0; j < kTileBlockPairs; ++j) values[16 * j + o] = static_cast<uint8_t>(value(2 * j) | value(2 * j + 1) << 4);
  }
}

}  // namespace

at::Tensor pack_tile_blocks(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = quantized_block_bytes(qtype);
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, "tile blocks take GGUF Q4_0 (2) or Q4_1 (3) blocks, not type id ", qtype);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  TORCH_CHECK(weight.size(1) % bytes == 0, "rows of ", weight.size(1), " bytes are not whole blocks of ", bytes);
  const int64_t n = weight.size(0), row_bytes = weight.size(1), num_blocks = row_bytes / bytes;
  const int64_t output_blocks = (n + kTileBlockOutputs - 1) / kTileBlockOutputs;
  const int64_t record_bytes = kTileBlockRecordBytes;
  auto packed = at::zeros({output_blocks, num_blocks, record_bytes}, weight.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, output_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < num_blocks; ++c) pack_record(w, row_bytes, n, qtype, b, c, out + (b * num_blocks + c) * record_bytes);
  });
  return packed;
}
