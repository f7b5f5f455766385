// GGUF Q4 blocks in the order the bfloat16 GEMM's tiles read a weight (tile_blocks.cpp packs them, bf16_gemm.cpp reads
// them): a weight in Q4 blocks is 0.31 of its bytes in bfloat16, and a decode step of a few tens of rows on the AMX
// tiles waits on reading its weights. A task dequantizes its panel of the weight into the pairs pack_bf16_pairs makes,
// the same bits: a block's values d * q + m are exact in float32 (d and m are halves, q has 4 bits), rounded to
// bfloat16 to nearest even as pack_bf16_pairs rounds the dequantized weight. (Q8_0 blocks, 0.53 of the bytes, took
// longer to dequantize than their bfloat16 values take to read.)
//
// Record (b, c) holds outputs 16b..16b+15 and inputs 32c..32c+31 (the GGUF block c of each of the 16 rows): 16 halves
// d, 16 halves m (Q4_0: -8d), then for each pair of inputs (2j, 2j+1), j < 16, a byte per output: input 2j in the low
// nibble, 2j + 1 in the high one. Outputs past the weight's rows are zeros (d = m = 0).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "gguf_block.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

constexpr int64_t kTileBlockOutputs = 16;  // outputs of a record: one tile of the weight
constexpr int64_t kTileBlockPairs = 16;    // pairs of inputs of a record: one GGUF block of 32 values
constexpr int64_t kTileBlockHeader = 2 * kTileBlockOutputs * 2;  // the halves d and m
constexpr int64_t kTileBlockRecordBytes = kTileBlockHeader + kTileBlockPairs * kTileBlockOutputs;

// The 16 rows of 16 pairs of bfloat16 (32 words a row) a record dequantizes to, into `pairs` (row j at pairs + 32j).
inline void dequantize_tile_record(const uint8_t* record, uint16_t* pairs) {
  const uint8_t* values = record + kTileBlockHeader;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32)));
  // cvtne2ps puts the even inputs' 16 values in words 0-15 and the odd ones' in 16-31; a pair is (even, odd).
  const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                              20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t j = 0; j < kTileBlockPairs; ++j) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 16 * j)));
    const __m512i even = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), odd = _mm512_srli_epi32(bytes, 4);
    const __m512 even_values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), d, m);
    const __m512 odd_values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), d, m);
    const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd_values, even_values));
    _mm512_storeu_si512(pairs + 32 * j, _mm512_permutexvar_epi16(pair_order, rounded));
  }
#else
  for (int64_t o = 0; o < kTileBlockOutputs; ++o) {
    const float d = half_at(record + 2 * o), m = half_at(record + 32 + 2 * o);
    for (int64_t j = 0; j < kTileBlockPairs; ++j) {
      const uint8_t byte = values[16 * j + o];
      const int even = byte & 0x0F, odd = byte >> 4;
      pairs[32 * j + 2 * o] = c10::BFloat16(static_cast<float>(even) * d + m).x;
      pairs[32 * j + 2 * o + 1] = c10::BFloat16(static_cast<float>(odd) * d + m).x;
    }
  }
#endif
}
