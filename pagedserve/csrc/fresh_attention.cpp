// Causal attention of prompts that start their sequences (no context in the cache), in bfloat16 on the AMX tiles:
// count sequences of one length side by side, as a prompt step lays them out. torch's flash kernel spends most of its
// time on such short sequences in setting up a small GEMM for each block of each head; here each block of 16 queries
// of one head is a few tile instructions.
//
// For a block of 16 queries (rows r0..r0+15 of one sequence and head): the scores q k^T of every key up to its last
// query, 16 keys a tile (TDPBF16PS over 32 dims a step), stored as float32; each row's causal softmax in float32 (its
// sum kept in float32, the probabilities rounded to bfloat16); then the probabilities times v, 32 keys a step into
// four tiles of 16 output dims, divided by the row's sum and rounded to bfloat16 once, as torch's bfloat16 flash
// kernel rounds its output. Each row's result depends on its own sequence only, whatever else is in the step.
//
// Keys and values are packed first, once for each sequence and kv head, into the order TDPBF16PS reads its second
// operand: for the scores, each tile row a pair of dims of 16 keys; for the product with v, each tile row a pair of
// keys of 16 dims. Keys past the sequence are zero.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "ops.h"

namespace {

#if defined(PAGEDSERVE_AMX_BF16)
constexpr int64_t kKeysPerScoreTile = 16;   // keys of one tile of scores: its 16 float32 columns
constexpr int64_t kKeysPerStep = 32;        // keys one tile of probabilities carries (16 pairs): the product's step
constexpr int64_t kDimsPerStep = 32;        // dims one tile of queries carries (16 pairs): the scores' step
constexpr int64_t kDimsPerSumTile = 16;     // output dims of one tile of sums
constexpr int64_t kSumTiles = 4;            // tiles of sums a pass over the keys fills: 64 output dims
constexpr int64_t kTileValues = kTileRows16 * 32;  // bfloat16 values of one tile: 16 rows of 64 bytes

using Bits = uint16_t;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

uint32_t pair_at(const Bits* row, int64_t dim) {
  uint32_t pair;
  std::memcpy(&pair, row + dim, sizeof(pair));
  return pair;
}

// A sequence's keys of one head ([len] rows `stride` values apart) as the scores' second operand: for each tile of 16
// keys and step of 32 dims, 16 rows (dim pairs) of 16 keys x 2 values.
void pack_keys(const Bits* keys, int64_t stride, int64_t len, int64_t dims, int64_t padded_len, Bits* out) {
  const int64_t steps = dims / kDimsPerStep;
  for (int64_t tile = 0; tile < padded_len / kKeysPerScoreTile; ++tile) {
    for (int64_t step = 0; step < steps; ++step) {
      auto* packed = reinterpret_cast<uint32_t*>(out + (tile * steps + step) * kTileValues);
      for (int64_t n = 0; n < kKeysPerScoreTile; ++n) {
        const int64_t key = tile * kKeysPerScoreTile + n;
        const Bits* row = keys + key * stride + step * kDimsPerStep;
        for (int64_t p = 0; p < kTileRows16; ++p) packed[p * kKeysPerScoreTile + n] = key < len ? pair_at(row, 2 * p) : 0;
      }
    }
  }
}

// A sequence's values of one head as the product's second operand: for each step of 32 keys and tile of 16 dims,
// 16 rows (key pairs) of 16 dims x 2 values.
void pack_values(const Bits* values, int64_t stride, int64_t len, int64_t dims, int64_t padded_len, Bits* out) {
  const int64_t dim_tiles = dims / kDimsPerSumTile;
  for (int64_t step = 0; step < padded_len / kKeysPerStep; ++step) {
    for (int64_t dim_tile = 0; dim_tile < dim_tiles; ++dim_tile) {
      Bits* packed = out + (step * dim_tiles + dim_tile) * kTileValues;
      for (int64_t p = 0; p < kTileRows16; ++p) {
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t key = step * kKeysPerStep + 2 * p + half;
          const Bits* row = values + key * stride + dim_tile * kDimsPerSumTile;
          for (int64_t d = 0; d < kDimsPerSumTile; ++d) packed[p * 32 + 2 * d + half] = key < len ? row[d] : 0;
        }
      }
    }
  }
}

// The tile intrinsics paste their tile numbers into the instruction's text, so each combination is spelled out (by the
// macros below). A tile register is not renamed: loading a tile waits for the products that read it, so consecutive
// loads alternate between two tiles.

// One step of 32 dims of the scores of two key tiles (the second where `two`): the queries' chunk in tile Q, the keys'
// in tiles 6 and 7, the sums in tiles 0 and 1.
#define PAGEDSERVE_SCORE_STEP(Q)                                                                                      \
  void score_step_##Q(const Bits* queries, int64_t query_stride_bytes, const Bits* first, const Bits* second, bool two) { \
    _tile_loadd(Q, queries, query_stride_bytes);                                                                      \
    _tile_loadd(6, first, 64);                                                                                        \
    _tile_dpbf16ps(0, Q, 6);                                                                                          \
    if (two) {                                                                                                        \
      _tile_loadd(7, second, 64);                                                                                     \
      _tile_dpbf16ps(1, Q, 7);                                                                                        \
    }                                                                                                                 \
  }
PAGEDSERVE_SCORE_STEP(4)
PAGEDSERVE_SCORE_STEP(5)

// Sum tile t += tile P x tile V.
#define PAGEDSERVE_ADD_PRODUCT(P, V)             \
  void add_product_##P##_##V(int64_t sum_tile) { \
    switch (sum_tile) {                          \
      case 0: _tile_dpbf16ps(0, P, V); break;    \
      case 1: _tile_dpbf16ps(1, P, V); break;    \
      case 2: _tile_dpbf16ps(2, P, V); break;    \
      default: _tile_dpbf16ps(3, P, V); break;   \
    }                                            \
  }
PAGEDSERVE_ADD_PRODUCT(4, 6)
PAGEDSERVE_ADD_PRODUCT(4, 7)
PAGEDSERVE_ADD_PRODUCT(5, 6)
PAGEDSERVE_ADD_PRODUCT(5, 7)

// One step of 32 keys of the products with v into sum tiles 0..tiles-1: the probabilities in tile P, the values in
// tiles 6 and 7 by turns.
#define PAGEDSERVE_VALUE_STEP(P)                                                                                \
  void value_step_##P(const Bits* probs, int64_t probs_stride_bytes, const Bits* values, int64_t tiles) {       \
    _tile_loadd(P, probs, probs_stride_bytes);                                                                  \
    for (int64_t t = 0; t < tiles; ++t) {                                                                       \
      if (t % 2 == 0) {                                                                                         \
        _tile_loadd(6, values + t * kTileValues, 64);                                                           \
        add_product_##P##_6(t);                                                                                 \
      } else {                                                                                                  \
        _tile_loadd(7, values + t * kTileValues, 64);                                                           \
        add_product_##P##_7(t);                                                                                 \
      }                                                                                                         \
    }                                                                                                           \
  }
PAGEDSERVE_VALUE_STEP(4)
PAGEDSERVE_VALUE_STEP(5)

constexpr int64_t kLanes = 16;  // floats of an AVX-512 vector (the tiles' machines have AVX-512)

// 16 floats rounded to bfloat16 to nearest even, as torch rounds.
__m256i rounded_to_bfloat16(__m512 values) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values));
#else
  return at::vec::cvtfp32_bf16(values);
#endif
}

// A block of up to 16 queries: the sequence's rows first_query.. of one head, and where its output goes.
struct Block {
  const Bits* query;  // its first row
  int64_t rows, first_query;
  const Bits* packed_keys;
  const Bits* packed_values;
  Bits* out;  // its first row's output
  int64_t keys() const { return first_query + rows; }  // its last query sees keys 0..keys()-1
  int64_t steps_len() const { return round_up(keys(), kKeysPerStep); }
};

// Probabilities of a block ready for its product with v.
struct Probabilities {
  std::vector<Bits> values;  // 16 rows of the scratch's probs_stride, zero past each row's last key
  float inverse_sums[kTileRows16];
};

// One thread's scratch for blocks of a sequence of up to padded_len keys. Its rows are a cache line longer than the
// keys: rows a power of two apart would all fall in the same sets of the cache, and a tile touches 16 of them. The
// probabilities are kept for two blocks: a block's product with v runs while the next block's scores are rounded
// (attend_blocks).
struct Scratch {
  int64_t dims, query_stride, out_stride, scores_stride, probs_stride;
  float scale;
  std::vector<Bits> queries;  // 16 x dims: the block's queries, zero rows past the sequence
  std::vector<float> scores;  // 16 rows of scores_stride
  Probabilities probs[2];
  std::vector<float> sums;  // 16 x 64: a pass's output sums
  Scratch(int64_t dims, int64_t query_stride, int64_t out_stride, int64_t padded_len, float scale)
      : dims(dims), query_stride(query_stride), out_stride(out_stride), scores_stride(padded_len + 64 / sizeof(float)),
        probs_stride(padded_len + 64 / sizeof(Bits)), scale(scale), queries(kTileRows16 * dims), scores(kTileRows16 * scores_stride),
        sums(kTileRows16 * kSumTiles * kDimsPerSumTile) {
    for (auto& p : probs) p.values.resize(kTileRows16 * probs_stride);
  }
};

// The block's scores q k^T into the scratch, 16 keys a tile, up to its last query's keys.
void score_block(const Block& block, Scratch& scratch) {
  for (int64_t i = 0; i < kTileRows16; ++i) {
    Bits* row = scratch.queries.data() + i * scratch.dims;
    if (i < block.rows) {
      std::memcpy(row, block.query + i * scratch.query_stride, scratch.dims * sizeof(Bits));
    } else {
      std::fill_n(row, scratch.dims, Bits{0});
    }
  }
  const int64_t steps = scratch.dims / kDimsPerStep, key_tiles = (block.keys() + kKeysPerScoreTile - 1) / kKeysPerScoreTile;
  const int64_t query_stride_bytes = scratch.dims * sizeof(Bits), scores_stride_bytes = scratch.scores_stride * sizeof(float);
  for (int64_t tile = 0; tile < key_tiles; tile += 2) {
    const bool two = tile + 1 < key_tiles;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t step = 0; step < steps; ++step) {
      const Bits* queries = scratch.queries.data() + step * kDimsPerStep;
      const Bits* first = block.packed_keys + (tile * steps + step) * kTileValues;
      const Bits* second = first + steps * kTileValues;
      if (step % 2 == 0) {
        score_step_4(queries, query_stride_bytes, first, second, two);
      } else {
        score_step_5(queries, query_stride_bytes, first, second, two);
      }
    }
    _tile_stored(0, scratch.scores.data() + tile * kKeysPerScoreTile, scores_stride_bytes);
    if (two) _tile_stored(1, scratch.scores.data() + (tile + 1) * kKeysPerScoreTile, scores_stride_bytes);
  }
}

// Each row's causal softmax of the block's scores (row i sees keys 0..first_query + i) as bfloat16 probabilities, and
// one over its float32 sum; the rows past the block's are zero.
void softmax_block(const Block& block, const Scratch& scratch, Probabilities& probs) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t steps_len = block.steps_len();
  const __m512 scales = _mm512_set1_ps(scratch.scale), minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < block.rows; ++i) {
    const float* scores = scratch.scores.data() + i * scratch.scores_stride;
    Bits* row = probs.values.data() + i * scratch.probs_stride;
    const int64_t seen = block.first_query + i + 1, vectors_len = round_up(seen, kLanes);
    // The last vector's keys past `seen` read as -inf, whose exponential is 0.
    const auto last_lanes = static_cast<__mmask16>((1u << (seen - (vectors_len - kLanes))) - 1);
    auto scores_at = [&](int64_t j) {
      return j + kLanes <= seen ? _mm512_loadu_ps(scores + j) : _mm512_mask_loadu_ps(minus_infinity, last_lanes, scores + j);
    };
    __m512 max_vec = minus_infinity;
    for (int64_t j = 0; j < vectors_len; j += kLanes) max_vec = _mm512_max_ps(max_vec, scores_at(j));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max_vec) * scratch.scale);
    __m512 sum_vec = _mm512_setzero_ps();
    for (int64_t j = 0; j < vectors_len; j += kLanes) {
      const __m512 e = Vec(_mm512_fmsub_ps(scores_at(j), scales, shift)).exp_u20();
      sum_vec = _mm512_add_ps(sum_vec, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + j), rounded_to_bfloat16(e));
    }
    probs.inverse_sums[i] = 1.f / _mm512_reduce_add_ps(sum_vec);
    std::fill(row + vectors_len, row + steps_len, Bits{0});
  }
  for (int64_t i = block.rows; i < kTileRows16; ++i) std::fill_n(probs.values.data() + i * scratch.probs_stride, steps_len, Bits{0});
}

// The block's probabilities times v, 64 output dims a pass over its keys, divided by each row's sum into its output.
void value_block(const Block& block, Scratch& scratch, const Probabilities& probs) {
  const int64_t dim_tiles = scratch.dims / kDimsPerSumTile, steps = block.steps_len() / kKeysPerStep;
  const int64_t probs_stride_bytes = scratch.probs_stride * sizeof(Bits), sums_stride = kSumTiles * kDimsPerSumTile;
  for (int64_t first_tile = 0; first_tile < dim_tiles; first_tile += kSumTiles) {
    const int64_t tiles = std::min(kSumTiles, dim_tiles - first_tile);
    for (int64_t t = 0; t < tiles; ++t) zero_sum_tile(t);
    for (int64_t step = 0; step < steps; ++step) {
      const Bits* p = probs.values.data() + step * kKeysPerStep;
      const Bits* values = block.packed_values + (step * dim_tiles + first_tile) * kTileValues;
      if (step % 2 == 0) {
        value_step_4(p, probs_stride_bytes, values, tiles);
      } else {
        value_step_5(p, probs_stride_bytes, values, tiles);
      }
    }
    for (int64_t t = 0; t < tiles; ++t) store_sum_tile(t, scratch.sums.data() + t * kDimsPerSumTile, sums_stride * sizeof(float));
    for (int64_t i = 0; i < block.rows; ++i) {
      Bits* row = block.out + i * scratch.out_stride + first_tile * kDimsPerSumTile;
      const float* sums = scratch.sums.data() + i * sums_stride;
      const __m512 inverse_sum = _mm512_set1_ps(probs.inverse_sums[i]);
      for (int64_t t = 0; t < tiles; ++t) {
        const __m512 values = _mm512_mul_ps(_mm512_loadu_ps(sums + t * kDimsPerSumTile), inverse_sum);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + t * kDimsPerSumTile), rounded_to_bfloat16(values));
      }
    }
  }
}

// Blocks in turn, one behind the other: a block's scores, then the previous block's product with v, then this
// block's softmax. What a phase reads was written a phase earlier: the tiles do not wait on vector stores of the line
// before, nor the vectors on tile stores.
void attend_blocks(const Block* blocks, int64_t count, Scratch& scratch) {
  for (int64_t b = 0; b < count; ++b) {
    score_block(blocks[b], scratch);
    if (b > 0) value_block(blocks[b - 1], scratch, scratch.probs[(b - 1) % 2]);
    softmax_block(blocks[b], scratch, scratch.probs[b % 2]);
  }
  if (count > 0) value_block(blocks[count - 1], scratch, scratch.probs[(count - 1) % 2]);
}
#endif

void check_rows_of_heads(const at::Tensor& t, const char* name, int64_t rows, int64_t dims) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kBFloat16 && t.size(0) == rows && t.size(2) == dims, name,
              " must be bfloat16 [", rows, ", heads, ", dims, "]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == dims, name, "'s heads must be contiguous within a row");
}

}  // namespace

bool fresh_attention_on_tiles(int64_t head_dim) {
#if defined(PAGEDSERVE_AMX_BF16)
  return bf16_matrix_tiles() && head_dim > 0 && head_dim % kDimsPerStep == 0;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor fresh_causal_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t count,
                                  double scale) {
  TORCH_CHECK(query.dim() == 3 && count > 0 && query.size(0) % count == 0, "query must be [count * length, heads, head_dim]");
  const int64_t total = query.size(0), heads = query.size(1), dims = query.size(2);
  TORCH_CHECK(fresh_attention_on_tiles(dims), "fresh_causal_attention runs on AMX tiles, with a head_dim a multiple of 32 "
              "(fresh_attention_on_tiles)");
  check_rows_of_heads(query, "query", total, dims);
  check_rows_of_heads(key, "key", total, dims);
  check_rows_of_heads(value, "value", total, dims);
  const int64_t kv_heads = key.size(1);
  TORCH_CHECK(value.size(1) == kv_heads && heads % kv_heads == 0, "query heads must be a multiple of key and value heads");
  auto out = at::empty({total, heads, dims}, query.options());
#if defined(PAGEDSERVE_AMX_BF16)
  const int64_t len = total / count, padded_len = round_up(len, kKeysPerStep), group = heads / kv_heads;
  const int64_t packed_values_per_head = padded_len * dims;
  auto packed = at::empty({2, count * kv_heads, packed_values_per_head}, query.options());
  const auto* q = reinterpret_cast<const Bits*>(query.data_ptr<at::BFloat16>());
  const auto* k = reinterpret_cast<const Bits*>(key.data_ptr<at::BFloat16>());
  const auto* v = reinterpret_cast<const Bits*>(value.data_ptr<at::BFloat16>());
  auto* packed_keys = reinterpret_cast<Bits*>(packed[0].data_ptr<at::BFloat16>());
  auto* packed_values = reinterpret_cast<Bits*>(packed[1].data_ptr<at::BFloat16>());
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t first_row = (sh / kv_heads) * len, head_offset = (sh % kv_heads) * dims;
      pack_keys(k + first_row * key.stride(0) + head_offset, key.stride(0), len, dims, padded_len,
                packed_keys + sh * packed_values_per_head);
      pack_values(v + first_row * value.stride(0) + head_offset, value.stride(0), len, dims, padded_len,
                  packed_values + sh * packed_values_per_head);
    }
  });
  // Work items: for one sequence and kv head, a block of 16 queries and the block as far from the end as it is from the
  // start (together as many keys as any other pair), for each head that shares the kv head. The threads take them in
  // turn from one counter, so that none waits long on another at the end, and a thread's next item mostly reads the
  // packed keys and values its last one read.
  const int64_t blocks = (len + kTileRows16 - 1) / kTileRows16, pairs = (blocks + 1) / 2;
  auto* o = reinterpret_cast<Bits*>(out.data_ptr<at::BFloat16>());
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    configure_tiles();
    Scratch scratch(dims, query.stride(0), heads * dims, padded_len, static_cast<float>(scale));
    std::vector<Block> item_blocks;
    for (int64_t item = next_item++; item < count * kv_heads * pairs; item = next_item++) {
      const int64_t sh = item / pairs, pair = item % pairs, mirror = blocks - 1 - pair;
      item_blocks.clear();
      for (const int64_t block : {pair, mirror}) {
        if (block == mirror && mirror == pair && !item_blocks.empty()) break;  // the middle block of an odd count
        const int64_t first_query = block * kTileRows16, row = (sh / kv_heads) * len + first_query;
        for (int64_t head = (sh % kv_heads) * group; head < (sh % kv_heads + 1) * group; ++head) {
          item_blocks.push_back({q + row * query.stride(0) + head * dims, std::min<int64_t>(kTileRows16, len - first_query),
                                 first_query, packed_keys + sh * packed_values_per_head, packed_values + sh * packed_values_per_head,
                                 o + (row * heads + head) * dims});
        }
      }
      attend_blocks(item_blocks.data(), static_cast<int64_t>(item_blocks.size()), scratch);
    }
    _tile_release();
  });
#endif
  return out;
}
