// What the kernels reading GGUF blocks share: the types' ids and block shapes, and where a Q4_0 / Q4_1 / Q8_0 block
// (the types every kernel reads) keeps its scale, its offset and its values.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

constexpr int64_t kBlockValues = 32;
// gguf's GGMLQuantizationType ids: the types every kernel on blocks reads, and those only the integer panels read
// (gguf_sub_blocks.h).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

// Values per stored block and bytes per stored block of a type the panels read; {0, 0} for any other.
struct StoredBlock {
  int64_t values, bytes;
};
inline StoredBlock stored_block(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};  // fp16 d, 16 bytes of nibbles
    case kQ4_1: return {32, 20};  // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ5_0: return {32, 22};  // fp16 d, 32 high bits, 16 bytes of nibbles
    case kQ5_1: return {32, 24};  // fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles
    case kQ8_0: return {32, 34};  // fp16 d, 32 int8
    case kQ4_K: return {256, 144};  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    case kQ5_K: return {256, 176};  // as Q4_K, with 32 bytes of high bits before the nibbles
    case kQ6_K: return {256, 210};  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
    default: return {0, 0};
  }
}

// Bytes per 32-value block of a type every kernel on blocks reads (Q4_0, Q4_1, Q8_0); 0 for any other.
inline int64_t quantized_block_bytes(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 ? stored_block(qtype).bytes : 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The middle of a Q4 nibble's range: a Q4_0 value is d * (q - kQ4Centre).
constexpr int32_t kQ4Centre = 8;

// The offset added to d * q in a block: Q4_1 stores it, Q4_0's is -8d (exact in float32), Q8_0 has none.
inline float block_min(const uint8_t* block, int64_t qtype, float d) {
  return qtype == kQ4_1 ? half_at(block + 2) : (qtype == kQ4_0 ? -kQ4Centre * d : 0.f);
}

// Where a Q4 block's 16 bytes of nibbles start (byte i: value i in the low nibble, value i + 16 in the high one).
inline const uint8_t* nibbles_of(const uint8_t* block, int64_t qtype) { return block + (qtype == kQ4_1 ? 4 : 2); }

// A GEMV that multiplies a weight row's blocks faster than they come from memory outruns the hardware prefetcher,
// which follows the reads and fetches too little ahead of them: such a loop fetches the row this many rows ahead of
// the one it multiplies (fetch_row).
constexpr int64_t kFetchAheadRows = 4;

inline void fetch_row(const uint8_t* row, int64_t row_bytes) {
  for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 3);
}

// The checks of GGUF blocks [N, whole blocks of block_bytes a row] uint8.
inline void check_rows_of_blocks(const at::Tensor& weight, int64_t block_bytes) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  TORCH_CHECK(weight.size(1) % block_bytes == 0, "rows of ", weight.size(1), " bytes are not whole blocks of ", block_bytes);
}

// The checks of GGUF blocks [N, whole blocks a row] uint8 of a type every kernel reads. Returns the bytes of one block.
inline int64_t checked_block_rows(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = quantized_block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "unsupported GGUF quantization type id ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
  check_rows_of_blocks(weight, bytes);
  return bytes;
}

// A linear layer's bias of n outputs: float32 [n], or none. Returns its values, or nullptr.
inline const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(), "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// The checks of a linear layer's arguments on GGUF blocks: x [M, K] float32, weight [N, K / 32 * block bytes] uint8 of a
// supported type, bias [N] float32 or none. Returns the bias's values, or nullptr.
inline const float* checked_linear_args(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  const int64_t bytes = quantized_block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "unsupported GGUF quantization type id ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlockValues == 0 && weight.size(1) == k / kBlockValues * bytes, "weight rows of ", weight.size(1),
              " bytes do not hold ", k, " values of this type");
  return checked_bias(bias, weight.size(0));
}
