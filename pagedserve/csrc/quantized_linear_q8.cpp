// Linear layer on GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) with the activations
// rounded to 8 bits, a scale for each 32 values (the Q8 rounding llama.cpp and vLLM's GGUF kernels apply), so that a
// block's products are integer dot products.
//
// Turning a block's 32 values into float32 takes more instructions than reading its bytes from memory does time, so
// the float32 kernel (quantized_linear.cpp) is bound by that conversion on processors without wide vector units.
// Here the block's values stay bytes: with x's block rounded to q_x at scale d_x, and the weight's value written as
// d * c + o with c centred on 0 (a Q4 nibble less 8, offset m + 8d: Q4_0's is 0; a 5-bit value less 16, offset m + 16d;
// a Q6_K value less 32, offset 0, with a scale d for each 16 values; a Q8_0 byte as it is, offset 0),
//   sum_j x_j (d c_j + o)  ~  d * d_x * sum_j c_j q_x,j  +  o * sum_j x_j,
// an integer dot product of 32 byte pairs and one multiply-add; the sum of x over the block is kept exact, so only the
// rounding of x to q_x departs from the float32 product. Centred values keep x's rounding error from being multiplied
// by the nibbles' mean.
//
// Each output is accumulated over the blocks in order, the same whatever rows come with it: a row's product does not
// depend on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf_block.h"
#include "gguf_sub_blocks.h"
#include "ops.h"
#include "vec_lanes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// The panels' 64-byte layout and byte dot products (dpbusd), where the build has AVX-512 VNNI and byte-wide AVX-512.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANELS_VNNI 1
#endif

namespace {

// x's rows rounded per block of 32 values: q = nearbyint(x * 127 / max|x|) (symmetric, so -q is always an int8),
// with the block's scale max|x| / 127, its exact sum, the sum of its q and, where a Q6_K weight multiplies them, that
// of its first 16 q (half_sums, else null: Q6_K sums its halves apart).
// Held block-major (every row's block 0, then every row's block 1, ...): a group's products read one block of
// consecutive rows at a time, so the rows' bytes are one contiguous run however wide a row is, rather than one cache
// line per row a row's width apart.
struct RoundedRows {
  int64_t rows;
  std::unique_ptr<int8_t[]> values;
  std::unique_ptr<float[]> scales, sums;
  std::unique_ptr<int32_t[]> value_sums, half_sums;
  int64_t index(int64_t row, int64_t block) const { return block * rows + row; }
  const int8_t* block_values(int64_t row, int64_t block) const { return values.get() + index(row, block) * kBlockValues; }
};

// Storage every element of which is written before it is read: no value-initialising pass over it.
template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline int32_t sum_of_lanes(__m256i a) {
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1)));
}
#endif

// A block of x (32 values at in) into `rounded` at index b.
inline void round_block(const float* in, int64_t b, RoundedRows& rounded) {
  int8_t* out = rounded.values.get() + b * kBlockValues;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(in + 8 * i);
  const float amax = largest_magnitude(in, kBlockValues);
  const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];  // cvtps rounds to nearest even, as nearbyint does
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // packs works within 128-bit halves: the permute puts the 8 groups of 4 bytes back in value order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  rounded.scales[b] = amax / 127.f;
  rounded.sums[b] = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  if (rounded.half_sums) {
    rounded.half_sums[b] = sum_of_lanes(_mm256_add_epi32(q[0], q[1]));
    rounded.value_sums[b] = rounded.half_sums[b] + sum_of_lanes(_mm256_add_epi32(q[2], q[3]));
  } else {
    rounded.value_sums[b] = sum_of_lanes(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  }
#else
  float amax = 0.f, sum = 0.f;
  for (int64_t j = 0; j < kBlockValues; ++j) {
    amax = std::max(amax, std::fabs(in[j]));
    sum += in[j];
  }
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int32_t value_sum = 0;
  for (int64_t j = 0; j < kBlockValues; ++j) {
    out[j] = static_cast<int8_t>(std::nearbyint(in[j] * inverse));
    value_sum += out[j];
    if (rounded.half_sums && j == kBlockValues / 2 - 1) rounded.half_sums[b] = value_sum;
  }
  rounded.scales[b] = amax / 127.f;
  rounded.sums[b] = sum;
  rounded.value_sums[b] = value_sum;
#endif
}

// Rows rounded together, block by block: the stores run on through one block's rows while the loads stay in the tile.
constexpr int64_t kRoundTileRows = 64;

RoundedRows round_rows(const float* x, int64_t rows, int64_t k, bool half_sums) {
  const int64_t row_blocks = k / kBlockValues, num_blocks = rows * row_blocks;
  RoundedRows rounded{rows, uninitialized<int8_t>(rows * k), uninitialized<float>(num_blocks), uninitialized<float>(num_blocks),
                      uninitialized<int32_t>(num_blocks), half_sums ? uninitialized<int32_t>(num_blocks) : nullptr};
  at::parallel_for(0, rows, std::max<int64_t>(1, 2048 / row_blocks), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kRoundTileRows)
      for (int64_t block = 0; block < row_blocks; ++block)
        for (int64_t row = tile; row < std::min(end, tile + kRoundTileRows); ++row)
          round_block(x + row * k + block * kBlockValues, rounded.index(row, block), rounded);
  });
  return rounded;
}

// How a panel holds a type's values: 4 vectors of nibble bytes (the Q4 types), or 8 of bytes.
constexpr bool holds_nibbles(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ4_K; }
// Whether a type's values have an offset beside their scale (value = d * q + m).
constexpr bool has_offset(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ4_K || qtype == kQ5_K; }
// Q6_K's scales are for 16 values each: a 32-value block's products are summed in two halves.
constexpr bool scaled_in_halves(int64_t qtype) { return qtype == kQ6_K; }

// Whether the panels are fetched ahead (fetch_row) for steps of one or two rows: where their products take less time
// than their bytes take to come from memory (a panel of bytes; a Q4 one where VNNI's dpbusd multiplies its bytes).
constexpr bool fetches_ahead(int64_t qtype) {
#if defined(PANELS_VNNI)
  return true;
#else
  return !holds_nibbles(qtype);
#endif
}

// Panels: the blocks of a group of output rows side by side (8 rows, one 32-byte vector; 16 where VNNI's 64-byte dpbusd
// multiplies them), so that one maddubs (dpbusd) multiplies 4 values of each row of the group by the same 4 bytes of x,
// broadcast. Each block's unpacking is then shared by every input row of a step, and an output's sums land in a vector
// lane of their own with no horizontal sum. Per group and per block of 32 values (a K-quant's sub-block): the rows' two
// scale words (gguf_sub_blocks.h: fp16 d, then m or 0; a K-quant's in float32: d * scale, then the offset or Q6_K's
// second half's scale); then the values in vectors of 4 bytes per row, lane c (4 bytes) for row c:
//   Q4 types: 4 vectors; vector s holds nibble bytes 4s..4s+3 of each row (values 4s.. in the low nibbles, 16 + 4s.. in
//       the high ones, as Q4_0's blocks pair them; Q4_K's are paired so when packed);
//   the others: 8 vectors; vector t holds values 4t..4t+3 of each row.
// Rows past the weight's last (in a last group of fewer rows) are zeros. With VNNI a Q8_0 value is held plus 128, as
// an unsigned byte: dpbusd multiplies unsigned by signed bytes into int32 without saturating, so the block's sum then
// loses 128 times x's sum, as a Q4 block's loses 8 times it; AVX2's maddubs saturates its int16 pairs, so there the
// values stay signed and their signs move onto x's bytes. The other types' values are unsigned as stored. The panels
// are made and read by the same build, so the group's width and the Q8_0 values' offset are the build's.
#if defined(PANELS_VNNI)
constexpr int64_t kGroupRows = 16;
constexpr int32_t kQ8PanelOffset = 128;
#else
constexpr int64_t kGroupRows = 8;
constexpr int32_t kQ8PanelOffset = 0;
#endif
constexpr int64_t kPanelVectorBytes = 4 * kGroupRows;
// What a panel's values are held plus (the centre taken off them), and so what each block's integer sum loses times x's
// sum of q.
constexpr int32_t panel_value_offset(int64_t qtype) {
  if (qtype == kQ8_0) return kQ8PanelOffset;
  if (holds_nibbles(qtype)) return kQ4Centre;
  return qtype == kQ6_K ? 32 : 16;
}
constexpr int64_t panel_word_bytes(int64_t qtype) { return is_k_quant(qtype) ? 4 : 2; }
constexpr int64_t panel_scale_bytes(int64_t qtype) { return 2 * kGroupRows * panel_word_bytes(qtype); }
constexpr int64_t panel_value_bytes(int64_t qtype) { return (holds_nibbles(qtype) ? 4 : 8) * kPanelVectorBytes; }
constexpr int64_t panel_record_bytes(int64_t qtype) { return panel_scale_bytes(qtype) + panel_value_bytes(qtype); }

void pack_panel_record(const uint8_t* weight, int64_t n, int64_t row_bytes, int64_t first_row, int64_t b, int64_t qtype,
                       uint8_t* record) {
  std::memset(record, 0, panel_record_bytes(qtype));
  const int64_t word = panel_word_bytes(qtype);
  uint8_t* values = record + panel_scale_bytes(qtype);
  for (int64_t c = 0; c < kGroupRows && first_row + c < n; ++c) {
    const SubBlock sub = sub_block(weight + (first_row + c) * row_bytes, b, qtype);
    std::memcpy(record + word * c, sub.words[0], word);
    std::memcpy(record + word * (kGroupRows + c), sub.words[1], word);
    if (holds_nibbles(qtype)) {
      uint8_t nibbles[16];
      for (int j = 0; j < 16; ++j) nibbles[j] = static_cast<uint8_t>(sub.q[j] | sub.q[j + 16] << 4);
      for (int64_t s = 0; s < 4; ++s) std::memcpy(values + s * kPanelVectorBytes + 4 * c, nibbles + 4 * s, 4);
    } else {
      for (int64_t t = 0; t < 8; ++t) std::memcpy(values + t * kPanelVectorBytes + 4 * c, sub.q + 4 * t, 4);
    }
  }
  if (qtype == kQ8_0 && kQ8PanelOffset == 128)
    for (int64_t j = 0; j < panel_value_bytes(qtype); ++j) values[j] ^= 0x80;  // int8 v -> uint8 v + 128
}

#if defined(__AVX2__) && defined(__FMA__)
// A panel's vectors: one lane of 4 bytes (or one float) per row of the group.
#if defined(PANELS_VNNI)
struct PanelLanes {
  using Ints = __m512i;
  using Floats = __m512;
  static Ints load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Ints low_nibbles(Ints a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
  static Ints high_nibbles(Ints a) { return low_nibbles(_mm512_srli_epi16(a, 4)); }
  // A Q8_0 panel's bytes are already the unsigned operand (values plus 128), and x's bytes the signed one.
  static Ints q8_weight(Ints stored) { return stored; }
  static Ints q8_input(Ints x, const uint8_t*) { return x; }
  static Ints broadcast_word(const int8_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    return _mm512_set1_epi32(word);
  }
  static Ints zero() { return _mm512_setzero_si512(); }
  static Ints dot(Ints sums, Ints u, Ints s) { return _mm512_dpbusd_epi32(sums, u, s); }
  static Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
  static Ints less(Ints a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static Floats halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Floats floats(Ints a) { return _mm512_cvtepi32_ps(a); }
  static Floats broadcast(float x) { return _mm512_set1_ps(x); }
  static Floats zero_floats() { return _mm512_setzero_ps(); }
  static Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
  static Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
  static Floats load_floats(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Floats a) { _mm512_storeu_ps(p, a); }
};
#else
struct PanelLanes {
  using Ints = __m256i;
  using Floats = __m256;
  static Ints load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Ints low_nibbles(Ints a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x0F)); }
  static Ints high_nibbles(Ints a) { return low_nibbles(_mm256_srli_epi16(a, 4)); }
  // A Q8_0 value's magnitude is the unsigned operand, and its sign moves onto x's byte at `stored` (the same lane).
  static Ints q8_weight(Ints stored) { return _mm256_abs_epi8(stored); }
  static Ints q8_input(Ints x, const uint8_t* stored) { return _mm256_sign_epi8(x, load(stored)); }
  static Ints broadcast_word(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p))); }
  static Ints zero() { return _mm256_setzero_si256(); }
  static Ints add(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
  static Ints less(Ints a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static Floats halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Floats floats(Ints a) { return _mm256_cvtepi32_ps(a); }
  static Floats broadcast(float x) { return _mm256_set1_ps(x); }
  static Floats zero_floats() { return _mm256_setzero_ps(); }
  static Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
  static Floats fma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
  static Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Floats a) { _mm256_storeu_ps(p, a); }
};
#endif

// The exact integer sum of a block's products for one input row, one lane per weight row of the group: bytes of the
// weight (unsigned) times x's bytes (signed) broadcast 4 at a time; for Q6_K, the sums of its two halves apart. With VNNI
// dpbusd adds each 4 products into int32, into two sums taken in turn (each dpbusd waits on the one before it into the
// same sum); AVX2's maddubs gives int16 pairs, which a Q4 block (products below 16 * 127) can add up in int16 over its
// 32 values before one madd widens them, while other blocks' pairs are widened at once. Integer sums, so their order
// does not change the result.
template <int64_t qtype>
struct BlockDots {
  using Ints = PanelLanes::Ints;
  Ints sums[2] = {PanelLanes::zero(), PanelLanes::zero()};
  static constexpr int sum_of(int t) { return scaled_in_halves(qtype) ? t / 4 : t & 1; }
#if defined(PANELS_VNNI)
  void add(int t, Ints u, Ints s) { sums[sum_of(t)] = PanelLanes::dot(sums[sum_of(t)], u, s); }
  Ints total() const { return PanelLanes::add(sums[0], sums[1]); }
#else
  void add(int t, Ints u, Ints s) {
    const Ints pairs = _mm256_maddubs_epi16(u, s);
    if constexpr (holds_nibbles(qtype)) sums[0] = _mm256_add_epi16(sums[0], pairs);
    else sums[sum_of(t)] = _mm256_add_epi32(sums[sum_of(t)], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  Ints total() const {
    return holds_nibbles(qtype) ? _mm256_madd_epi16(sums[0], _mm256_set1_epi16(1)) : _mm256_add_epi32(sums[0], sums[1]);
  }
#endif
  Ints half(int h) const { return sums[h]; }
};

// A record's scale words i (0: d; 1: m, or Q6_K's second scale) of the group's rows.
template <int64_t qtype>
PanelLanes::Floats scale_words(const uint8_t* record, int i) {
  if constexpr (panel_word_bytes(qtype) == 4) return PanelLanes::load_floats(reinterpret_cast<const float*>(record) + i * kGroupRows);
  else return PanelLanes::halves(record + 2 * i * kGroupRows);
}

// acc[i * kGroupRows + c] for the `rows` input rows starting at `first` and the weight rows of the group whose records
// start at `group`: per output, over the blocks in order, sums * (d * d_x), then the offset times x's sum (Q6_K: each
// half's sums times its own d * d_x). A block's 8 vectors of weight bytes stay in registers while every row passes; the
// accumulators are in memory, touched once a block (and first written by block 0, so they need no zeroing pass).
template <int64_t qtype>
void rows_times_group(const RoundedRows& rounded, int64_t first, int64_t rows, int64_t k, const uint8_t* group, float* acc) {
  using L = PanelLanes;
  constexpr int32_t centre = panel_value_offset(qtype);
  const int64_t num_blocks = k / kBlockValues, record_bytes = panel_record_bytes(qtype);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* record = group + b * record_bytes;
    const uint8_t* values = record + panel_scale_bytes(qtype);
    // w[t]: values 4t..4t+3 of each row, as the unsigned operand (PanelLanes::q8_weight for a Q8_0 row's).
    L::Ints w[8];
    for (int t = 0; t < 8; ++t) {
      if constexpr (!holds_nibbles(qtype)) {
        const L::Ints stored = L::load(values + t * kPanelVectorBytes);
        w[t] = qtype == kQ8_0 ? L::q8_weight(stored) : stored;
      } else {
        const L::Ints packed = L::load(values + (t % 4) * kPanelVectorBytes);
        w[t] = t < 4 ? L::low_nibbles(packed) : L::high_nibbles(packed);
      }
    }
    const L::Floats d = scale_words<qtype>(record, 0);
    // The offset of a centred value (m + centre * d), or Q6_K's second half's scale.
    L::Floats second = L::zero_floats();
    if constexpr (has_offset(qtype)) second = L::fma(L::broadcast(centre), d, scale_words<qtype>(record, 1));
    if constexpr (scaled_in_halves(qtype)) second = scale_words<qtype>(record, 1);
    const int8_t* xq = rounded.block_values(first, b);
    for (int64_t i = 0; i < rows; ++i) {
      BlockDots<qtype> dots;
      for (int t = 0; t < 8; ++t) {
        const L::Ints x = L::broadcast_word(xq + i * kBlockValues + 4 * t);
        if constexpr (qtype == kQ8_0) dots.add(t, w[t], L::q8_input(x, values + t * kPanelVectorBytes));
        else dots.add(t, w[t], x);
      }
      const int64_t xb = rounded.index(first + i, b);
      const L::Floats prior = b == 0 ? L::zero_floats() : L::load_floats(acc + i * kGroupRows);
      const L::Floats x_scale = L::broadcast(rounded.scales[xb]);
      L::Floats a;
      if constexpr (scaled_in_halves(qtype)) {
        const int32_t first_half = rounded.half_sums[xb], second_half = rounded.value_sums[xb] - first_half;
        a = L::fma(L::floats(L::less(dots.half(0), centre * first_half)), L::mul(d, x_scale), prior);
        a = L::fma(L::floats(L::less(dots.half(1), centre * second_half)), L::mul(second, x_scale), a);
      } else {
        L::Ints sums = dots.total();
        if constexpr (centre != 0) sums = L::less(sums, centre * rounded.value_sums[xb]);
        a = L::fma(L::floats(sums), L::mul(d, x_scale), prior);
        if constexpr (has_offset(qtype)) a = L::fma(second, L::broadcast(rounded.sums[xb]), a);
      }
      L::store(acc + i * kGroupRows, a);
    }
  }
}
#else
// Builds without AVX2 have no VNNI, so their Q8_0 panels hold the values as they are, signed.
static_assert(kQ8PanelOffset == 0, "the scalar path reads a Q8_0 panel's bytes as signed values");

// Scale word i of row c of a record, as a float.
inline float scale_word(const uint8_t* record, int64_t qtype, int i, int64_t c) {
  const uint8_t* word = record + panel_word_bytes(qtype) * (i * kGroupRows + c);
  if (panel_word_bytes(qtype) == 2) return half_at(word);
  float value;
  std::memcpy(&value, word, sizeof(value));
  return value;
}

// Value j of row c of a record, the centre taken off.
inline int32_t centred_value(const uint8_t* values, int64_t qtype, int64_t c, int64_t j) {
  if (!holds_nibbles(qtype)) {
    const uint8_t byte = values[(j / 4) * kPanelVectorBytes + 4 * c + j % 4];
    return (qtype == kQ8_0 ? static_cast<int8_t>(byte) : static_cast<int32_t>(byte)) - panel_value_offset(qtype);
  }
  const int64_t v = j % 16;
  const uint8_t byte = values[(v / 4) * kPanelVectorBytes + 4 * c + v % 4];
  return (j < 16 ? byte & 0x0F : byte >> 4) - panel_value_offset(qtype);
}

template <int64_t qtype>
void rows_times_group(const RoundedRows& rounded, int64_t first, int64_t rows, int64_t k, const uint8_t* group, float* acc) {
  const int64_t num_blocks = k / kBlockValues, record_bytes = panel_record_bytes(qtype);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < kGroupRows; ++c) {
      float a = 0.f;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* record = group + b * record_bytes;
        const uint8_t* values = record + panel_scale_bytes(qtype);
        const int8_t* xq = rounded.block_values(first + i, b);
        const int64_t xb = rounded.index(first + i, b);
        int32_t halves[2] = {0, 0};
        for (int64_t j = 0; j < kBlockValues; ++j) halves[j / 16] += centred_value(values, qtype, c, j) * xq[j];
        const float d = scale_word(record, qtype, 0, c), x_scale = rounded.scales[xb];
        if (scaled_in_halves(qtype)) {
          a = std::fma(static_cast<float>(halves[0]), d * x_scale, a);
          a = std::fma(static_cast<float>(halves[1]), scale_word(record, qtype, 1, c) * x_scale, a);
        } else {
          a = std::fma(static_cast<float>(halves[0] + halves[1]), d * x_scale, a);
          if (has_offset(qtype))
            a = std::fma(std::fma(static_cast<float>(panel_value_offset(qtype)), d, scale_word(record, qtype, 1, c)), rounded.sums[xb], a);
        }
      }
      acc[i * kGroupRows + c] = a;
    }
}
#endif

// Input rows walked together past a task's groups: their rounded bytes stay in L2 meanwhile.
constexpr int64_t kPanelChunkRows = 64;

// out's rows are out_stride floats apart: a part of a fused layer writes its columns of the whole layer's output.
template <int64_t qtype>
void panels_linear(const RoundedRows& rounded, int64_t m, int64_t k, const uint8_t* panels, int64_t n, const float* bias, float* out,
                   int64_t out_stride) {
  const int64_t group_bytes = k / kBlockValues * panel_record_bytes(qtype), num_groups = (n + kGroupRows - 1) / kGroupRows;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(kPanelChunkRows, m) * kGroupRows);
    for (int64_t chunk = 0; chunk < m; chunk += kPanelChunkRows) {
      const int64_t rows = std::min(kPanelChunkRows, m - chunk);
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = panels + g * group_bytes;
        if (fetches_ahead(qtype) && rows <= 2 && g + 1 < end) fetch_row(group + group_bytes, group_bytes);
        rows_times_group<qtype>(rounded, chunk, rows, k, group, acc.data());
        const int64_t first_col = g * kGroupRows, cols = std::min(kGroupRows, n - first_col);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c)
            out[(chunk + i) * out_stride + first_col + c] = acc[i * kGroupRows + c] + (bias ? bias[first_col + c] : 0.f);
      }
    }
  });
}

constexpr const char* kPanelTypes = "Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14";

// The values and bytes of one stored block of a type the panels read, checked.
StoredBlock checked_panel_type(int64_t qtype) {
  const StoredBlock stored = stored_block(qtype);
  TORCH_CHECK(stored.bytes > 0, "unsupported GGUF quantization type id ", qtype, " (supported: ", kPanelTypes, ")");
  return stored;
}

}  // namespace

std::tuple<int64_t, int64_t> gguf_block_shape(int64_t qtype) {
  const StoredBlock stored = stored_block(qtype);
  return {stored.values, stored.bytes};
}

// GGUF blocks [N, K / values per block * block bytes] -> the panels quantized_linear_q8 reads (layout above
// pack_panel_record): [ceil(N / kGroupRows), K / 32 * record bytes].
at::Tensor pack_q8_panels(const at::Tensor& weight, int64_t qtype) {
  const StoredBlock stored = checked_panel_type(qtype);
  check_rows_of_blocks(weight, stored.bytes);
  const int64_t n = weight.size(0), row_bytes = weight.size(1), num_blocks = row_bytes / stored.bytes * (stored.values / kBlockValues);
  const int64_t num_groups = (n + kGroupRows - 1) / kGroupRows, record_bytes = panel_record_bytes(qtype);
  auto out = at::empty({num_groups, num_blocks * record_bytes}, weight.options());
  const uint8_t* w_ptr = weight.data_ptr<uint8_t>();
  uint8_t* out_ptr = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < num_blocks; ++b)
        pack_panel_record(w_ptr, n, row_bytes, g * kGroupRows, b, qtype, out_ptr + (g * num_blocks + b) * record_bytes);
  });
  return out;
}

namespace {

// The checks of one weight's panels of n rows of k values in qtype.
void check_part(const at::Tensor& panels, int64_t qtype, int64_t n, int64_t k) {
  checked_panel_type(qtype);
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  panels.size(0) == (n + kGroupRows - 1) / kGroupRows && panels.size(1) == k / kBlockValues * panel_record_bytes(qtype),
              "panels do not hold ", n, " rows of ", k, " values of this type (make them with pack_q8_panels)");
}

// The checks of x [M, K] float32, K whole blocks.
void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlockValues == 0, "x's rows of ", x.size(1), " values are not whole blocks of ", kBlockValues);
}

// One weight's products on its panels (checked: check_part) into columns [0, n) of out (rows out_stride apart), x
// rounded already.
void part_linear(const RoundedRows& rounded, int64_t m, int64_t k, const at::Tensor& panels, int64_t qtype, int64_t n,
                 const float* bias, float* out, int64_t out_stride) {
  const uint8_t* p = panels.data_ptr<uint8_t>();
  switch (qtype) {
    case kQ4_0: panels_linear<kQ4_0>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ4_1: panels_linear<kQ4_1>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ5_0: panels_linear<kQ5_0>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ5_1: panels_linear<kQ5_1>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ8_0: panels_linear<kQ8_0>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ4_K: panels_linear<kQ4_K>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ5_K: panels_linear<kQ5_K>(rounded, m, k, p, n, bias, out, out_stride); break;
    case kQ6_K: panels_linear<kQ6_K>(rounded, m, k, p, n, bias, out, out_stride); break;
  }
}

}  // namespace

// x [M, K] float32; the panels (pack_q8_panels) of the parts of a fused weight, each [out_features[i], K] in GGUF blocks
// of its own type; bias [sum of out_features] float32 or undefined. Returns x @ dequantized(weight).T + bias, the parts'
// outputs side by side, [M, sum of out_features], with x rounded to 8 bits per block of 32 values (once, for every
// part).
at::Tensor quantized_linear_q8_parts(const at::Tensor& x, const std::vector<at::Tensor>& panels, const std::vector<int64_t>& qtypes,
                                     const std::vector<int64_t>& out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!panels.empty() && panels.size() == qtypes.size() && panels.size() == out_features.size(),
              "one type and one output size for each part's panels");
  check_input(x);
  const int64_t m = x.size(0), k = x.size(1);
  int64_t n = 0;
  bool halves = false;
  for (size_t i = 0; i < panels.size(); ++i) {
    check_part(panels[i], qtypes[i], out_features[i], k);
    n += out_features[i];
    halves = halves || scaled_in_halves(qtypes[i]);
  }
  const float* bias_ptr = checked_bias(bias, n);
  auto out = at::empty({m, n}, x.options());
  const RoundedRows rounded = round_rows(x.data_ptr<float>(), m, k, halves);
  int64_t first_col = 0;
  for (size_t i = 0; i < panels.size(); ++i) {
    part_linear(rounded, m, k, panels[i], qtypes[i], out_features[i], bias_ptr ? bias_ptr + first_col : nullptr,
                out.data_ptr<float>() + first_col, n);
    first_col += out_features[i];
  }
  return out;
}

// x [M, K] float32; panels (pack_q8_panels) of a weight [out_features, K] in GGUF blocks; bias [out_features] float32
// or undefined. Returns x @ dequantized(weight).T + bias, [M, out_features], with x rounded to 8 bits per block of 32
// values.
at::Tensor quantized_linear_q8(const at::Tensor& x, const at::Tensor& panels, int64_t qtype, int64_t out_features,
                               const c10::optional<at::Tensor>& bias) {
  checked_panel_type(qtype);
  check_input(x);
  const int64_t m = x.size(0), k = x.size(1);
  check_part(panels, qtype, out_features, k);
  const float* bias_ptr = checked_bias(bias, out_features);
  auto out = at::empty({m, out_features}, x.options());
  const RoundedRows rounded = round_rows(x.data_ptr<float>(), m, k, scaled_in_halves(qtype));
  part_linear(rounded, m, k, panels, qtype, out_features, bias_ptr, out.data_ptr<float>(), out_features);
  return out;
}
