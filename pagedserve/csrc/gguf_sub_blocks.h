// GGUF rows read 32 values at a time, for every type the integer panels take (quantized_linear_q8.cpp): the legacy
// 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q4_K, Q5_K, Q6_K), whose 256-value super-blocks hold
// 8 sub-blocks of 32 values with scales of their own (16 values a scale for Q6_K).
//
// A sub-block comes out as its stored integers q (unsigned bytes; Q8_0's as the int8 bits they are) and two scale
// words, in the form the panel keeps them: the legacy types' fp16 d and m as stored (m only for Q4_1 and Q5_1); a
// K-quant's scales multiplied out in float32, exactly (an fp16 times a 6-bit or int8 scale fits float32's significand):
// Q4_K and Q5_K give d * scale and -dmin * min, Q6_K the scales of its two halves of 16 values.
#pragma once
#include <cstdint>
#include <cstring>

#include "gguf_block.h"

constexpr bool is_k_quant(int64_t qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

struct SubBlock {
  uint8_t q[32];
  uint8_t words[2][4];  // 2 bytes each (fp16) for the legacy types, 4 (float32) for the K-quants
};

namespace gguf_sub_blocks {

inline void put_float(uint8_t* word, float value) { std::memcpy(word, &value, sizeof(value)); }

// Values j and j + 16 of a 32-value block from its 16 nibble bytes (low nibble, high nibble), plus high bits.
inline void legacy_nibbles(const uint8_t* nibbles, uint32_t high_bits, SubBlock& out) {
  for (int j = 0; j < 16; ++j) {
    out.q[j] = static_cast<uint8_t>((nibbles[j] & 0x0F) | (((high_bits >> j) & 1) << 4));
    out.q[j + 16] = static_cast<uint8_t>((nibbles[j] >> 4) | (((high_bits >> (j + 16)) & 1) << 4));
  }
}

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes (llama.cpp's get_scale_min_k4).
inline void scale_and_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// Sub-block j of a Q4_K / Q5_K super-block: 32 nibbles (low ones for even j, high for odd) of bytes 32 * (j / 2)..,
// Q5_K's fifth bit from bit j of its 32 high-bit bytes.
inline void k4_or_k5(const uint8_t* block, int j, bool five_bits, SubBlock& out) {
  const float d = half_at(block), dmin = half_at(block + 2);
  int scale, min;
  scale_and_min(block + 4, j, scale, min);
  const uint8_t* high = block + 16;
  const uint8_t* nibbles = block + (five_bits ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) {
    const int nibble = j % 2 ? nibbles[l] >> 4 : nibbles[l] & 0x0F;
    out.q[l] = static_cast<uint8_t>(nibble | (five_bits ? ((high[l] >> j) & 1) << 4 : 0));
  }
  put_float(out.words[0], d * static_cast<float>(scale));
  put_float(out.words[1], -(dmin * static_cast<float>(min)));
}

// Sub-block j of a Q6_K super-block: half h = j / 4 of it, part s = j % 4 of that half: the low nibbles (s < 2) or high
// ones of 32 bytes at 64h + 32 * (s % 2), bits 2s, 2s + 1 of the half's 32 high-bit bytes; scales 2j and 2j + 1.
inline void k6(const uint8_t* block, int j, SubBlock& out) {
  const int h = j / 4, s = j % 4;
  const uint8_t* low = block + 64 * h + 32 * (s % 2);
  const uint8_t* high = block + 128 + 32 * h;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int l = 0; l < 32; ++l) {
    const int nibble = s < 2 ? low[l] & 0x0F : low[l] >> 4;
    out.q[l] = static_cast<uint8_t>(nibble | ((high[l] >> (2 * s)) & 3) << 4);
  }
  put_float(out.words[0], d * static_cast<float>(scales[2 * j]));
  put_float(out.words[1], d * static_cast<float>(scales[2 * j + 1]));
}

}  // namespace gguf_sub_blocks

// Sub-block b (values 32b..32b + 31) of a row of `qtype` blocks at `row`.
inline SubBlock sub_block(const uint8_t* row, int64_t b, int64_t qtype) {
  using namespace gguf_sub_blocks;
  SubBlock out{};
  const StoredBlock stored = stored_block(qtype);
  const int64_t per_block = stored.values / kBlockValues;
  const uint8_t* block = row + b / per_block * stored.bytes;
  const int j = static_cast<int>(b % per_block);
  uint32_t high_bits = 0;
  switch (qtype) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      const bool has_min = qtype == kQ4_1 || qtype == kQ5_1, five_bits = qtype == kQ5_0 || qtype == kQ5_1;
      const uint8_t* after_scales = block + (has_min ? 4 : 2);
      if (five_bits) std::memcpy(&high_bits, after_scales, 4);
      legacy_nibbles(after_scales + (five_bits ? 4 : 0), high_bits, out);
      std::memcpy(out.words[0], block, 2);
      if (has_min) std::memcpy(out.words[1], block + 2, 2);
      break;
    }
    case kQ8_0:
      std::memcpy(out.q, block + 2, 32);
      std::memcpy(out.words[0], block, 2);
      break;
    case kQ4_K:
    case kQ5_K: k4_or_k5(block, j, qtype == kQ5_K, out); break;
    case kQ6_K: k6(block, j, out); break;
  }
  return out;
}

// The float32 values of a sub-block of `qtype`, as gguf dequantizes them: a scale times the integer less the type's centre
// (Q4_0's 8, Q5_0's 16, Q6_K's 32), plus the block's offset where it has one (Q4_1 and Q5_1 store it; Q4_K and Q5_K
// as minus dmin times the sub-block's min). Every product of a scale and an integer is exact in float32, so the one
// rounding is the offset's addition, as gguf's.
inline void sub_block_values(const SubBlock& sub, int64_t qtype, float* out) {
  using namespace gguf_sub_blocks;
  float scales[2], offset = 0.f;
  int centre = 0;
  if (is_k_quant(qtype)) {
    std::memcpy(&scales[0], sub.words[0], 4);
    std::memcpy(&scales[1], sub.words[qtype == kQ6_K ? 1 : 0], 4);
    if (qtype == kQ6_K) centre = 32;
    else std::memcpy(&offset, sub.words[1], 4);
  } else {
    scales[0] = scales[1] = half_at(sub.words[0]);
    if (qtype == kQ4_1 || qtype == kQ5_1) offset = half_at(sub.words[1]);
    centre = qtype == kQ4_0 ? kQ4Centre : (qtype == kQ5_0 ? 16 : 0);
  }
  for (int l = 0; l < 32; ++l) {
    const int q = qtype == kQ8_0 ? static_cast<int8_t>(sub.q[l]) : sub.q[l] - centre;
    out[l] = scales[l / 16] * static_cast<float>(q) + offset;
  }
}
