// x @ W.T with bfloat16 products summed in float32 and float32 out: the lm_head's GEMM where GEMMs multiply in
// bfloat16. oneDNN's bfloat16 GEMMs return bfloat16, and logits rounded to it come in steps of 1/8 at their usual
// size, tying tokens that are not tied; this kernel keeps the sums as they are. It runs on AVX-512 BF16 dot products
// (vdpbf16ps: two bfloat16 products per float32 lane) where the build has them; elsewhere a scalar loop takes the same
// pairs in the same order (for tests: it is far slower than float32 GEMMs, and the engine does not choose it there).
// Where the build has AMX tiles and the OS grants them, every call runs on the tiles instead (TDPBF16PS: 16 rows by
// 16 outputs by 32 inputs an instruction), whatever its row count, so that a row's sums do not depend on its batch.
//
// bf16_weights_linear multiplies the same packed weight by float32 x in float32: each bfloat16 weight widened to the
// float32 it stands for (a shift), its products with x's float32 values summed by FMAs. It reads the bytes of a
// bfloat16 weight and gives exact float32 products of its values, on processors whose bfloat16 dot products run
// slower than their float32 FMAs (AVX-512 without AMX tiles). Each sum takes its pairs in the same order whatever
// the step's row count, so a row's sums do not depend on its batch.
//
// The weight is packed once into pairs along k: block b holds output rows 16b..16b+15, and for each pair of inputs
// (2j, 2j+1) 16 x 2 bfloat16 values, row by row: one 64-byte vector per pair, what one vdpbf16ps multiplies. 16 such
// vectors in a row are an AMX tile of the weight as TDPBF16PS reads it, so the pairs are padded with zeros to a
// multiple of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#include "amx_tiles.h"
#include "tile_blocks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRowsPerBlock = 16;  // output rows (logits) per packed block: one float32 vector of sums
constexpr int kTileRows = 6;       // input rows a tile carries: 6 x 4 accumulators, 4 weight vectors and a broadcast
constexpr int kTileBlocks = 4;     //   fit the 32 vector registers
constexpr int64_t kChunkRows = 240; // input rows a task takes: their pairs stay in L2 while it sweeps its blocks
constexpr int64_t kPairsPerTile = 16;  // pairs of inputs in one AMX tile row (64 bytes of bfloat16)

int64_t padded_pairs(int64_t k) { return ((k + 1) / 2 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile; }

uint16_t bf16_bits(float value) { return c10::BFloat16(value).x; }  // rounded to nearest even

float bf16_value(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// x [rows, k] in dtype, zero past k to 2 x pairs values: x itself where it comes so, else torch's conversion
// (vectorized). In bfloat16, rows x pairs words, each the values of inputs 2j (low half) and 2j + 1 (high half).
at::Tensor padded_rows(const at::Tensor& x, int64_t pairs, at::ScalarType dtype) {
  if (x.scalar_type() == dtype && x.is_contiguous() && x.size(1) == 2 * pairs) return x;
  auto out = at::empty({x.size(0), 2 * pairs}, x.options().dtype(dtype));
  if (x.size(1) < 2 * pairs) out.narrow(1, x.size(1), 2 * pairs - x.size(1)).zero_();
  out.narrow(1, 0, x.size(1)).copy_(x);
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

constexpr int kFloatTileRows = 8;     // bf16_weights_linear's tiles: 8 x 3 accumulators, 3 widened weight vectors,
constexpr int kFloatTileBlocks = 3;   //   a broadcast and the mask of the odd inputs fit the 32 vector registers
constexpr int64_t kFloatChunkRows = 120;  // input rows a task takes: their float32 values stay in L2 as it sweeps
constexpr int64_t kFloatStepPairs = 128;  // pairs a task's tiles take at a time: that part of its panel stays in L1

// What a float tile multiplies: x's rows (x_stride floats apart, from the first pair's values), `pairs` pairs of the
// weight's blocks (block_stride words apart, from the first pair's), and the sums (ld apart; columns of them wanted),
// which it adds to where `accumulate` (the pairs before these are in them).
struct FloatTile {
  const float* x;
  int64_t x_stride;
  const uint16_t* w;
  int64_t block_stride;
  int64_t pairs;
  float* out;
  int64_t ld;
  int64_t columns;
  bool accumulate;
};

// A tile of rows x (blocks x 16) float32 sums: for each pair, the even input's product with the low halves (the
// weights widened by a shift), then the odd input's with the high halves (the low bits masked off). A sum continued
// from the sums stored takes the same steps as one that never left the registers.
#if defined(__AVX512F__)
template <int Rows, int Blocks>
void float_tile(const FloatTile& t) {
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __mmask16 wanted[Blocks];  // each block's columns that are stored (and read back where accumulating)
  for (int b = 0; b < Blocks; ++b) {
    const int64_t left = std::clamp<int64_t>(t.columns - b * kRowsPerBlock, 0, kRowsPerBlock);
    wanted[b] = static_cast<__mmask16>((1u << left) - 1);
  }
  __m512 sums[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b)
      sums[r][b] = t.accumulate ? _mm512_maskz_loadu_ps(wanted[b], t.out + r * t.ld + b * kRowsPerBlock) : _mm512_setzero_ps();
  for (int64_t j = 0; j < t.pairs; ++j) {
    const uint16_t* pair = t.w + j * 2 * kRowsPerBlock;
    __m512 weights[Blocks];
    for (int b = 0; b < Blocks; ++b)
      weights[b] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(pair + b * t.block_stride), 16));
    for (int r = 0; r < Rows; ++r) {
      const __m512 input = _mm512_set1_ps(t.x[r * t.x_stride + 2 * j]);
      for (int b = 0; b < Blocks; ++b) sums[r][b] = _mm512_fmadd_ps(input, weights[b], sums[r][b]);
    }
    for (int b = 0; b < Blocks; ++b)
      weights[b] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(pair + b * t.block_stride), high_halves));
    for (int r = 0; r < Rows; ++r) {
      const __m512 input = _mm512_set1_ps(t.x[r * t.x_stride + 2 * j + 1]);
      for (int b = 0; b < Blocks; ++b) sums[r][b] = _mm512_fmadd_ps(input, weights[b], sums[r][b]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) _mm512_mask_storeu_ps(t.out + r * t.ld + b * kRowsPerBlock, wanted[b], sums[r][b]);
}
#else
template <int Rows, int Blocks>
void float_tile(const FloatTile& t) {
  for (int r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(t.columns, Blocks * kRowsPerBlock); ++c) {
      const uint16_t* block = t.w + (c / kRowsPerBlock) * t.block_stride + (c % kRowsPerBlock) * 2;
      const float* x = t.x + r * t.x_stride;
      float sum = t.accumulate ? t.out[r * t.ld + c] : 0.f;
      for (int64_t j = 0; j < t.pairs; ++j) {  // in the vector loop's order, each product fused with its sum
        const uint16_t* weight = block + j * 2 * kRowsPerBlock;
        sum = std::fma(x[2 * j], bf16_value(weight[0]), sum);
        sum = std::fma(x[2 * j + 1], bf16_value(weight[1]), sum);
      }
      t.out[r * t.ld + c] = sum;
    }
  }
}
#endif

template <int Blocks>
void float_tile_of_rows(int rows, const FloatTile& t) {
  switch (rows) {
    case 8: float_tile<8, Blocks>(t); break;
    case 7: float_tile<7, Blocks>(t); break;
    case 6: float_tile<6, Blocks>(t); break;
    case 5: float_tile<5, Blocks>(t); break;
    case 4: float_tile<4, Blocks>(t); break;
    case 3: float_tile<3, Blocks>(t); break;
    case 2: float_tile<2, Blocks>(t); break;
    default: float_tile<1, Blocks>(t); break;
  }
}

void any_float_tile(int rows, int blocks, const FloatTile& t) {
  static_assert(kFloatTileBlocks == 3 && kFloatTileRows == 8, "the switches below spell out the tile sizes");
  switch (blocks) {
    case 3: float_tile_of_rows<3>(rows, t); break;
    case 2: float_tile_of_rows<2>(rows, t); break;
    default: float_tile_of_rows<1>(rows, t); break;
  }
}

// A task's rows (`rows` of x's, x_stride floats apart) against its panel (`blocks` blocks of `pairs` pairs), into out:
// kFloatStepPairs pairs at a time for all of its rows, so that part of the panel is read from L1 by every tile.
void float_task(const float* x, int64_t x_stride, int64_t rows, const uint16_t* panel, int64_t pairs, int blocks, float* out,
                int64_t ld, int64_t columns) {
  for (int64_t first = 0; first < pairs; first += kFloatStepPairs) {
    const int64_t step_pairs = std::min(kFloatStepPairs, pairs - first);
    for (int64_t r = 0; r < rows; r += kFloatTileRows) {
      const FloatTile t{x + r * x_stride + 2 * first, x_stride, panel + first * 2 * kRowsPerBlock, pairs * 2 * kRowsPerBlock,
                        step_pairs, out + r * ld, ld, columns, first > 0};
      any_float_tile(static_cast<int>(std::min<int64_t>(kFloatTileRows, rows - r)), blocks, t);
    }
  }
}

// A weight as the kernels read it: blocks of 16 outputs by `pairs` pairs of bfloat16 (32 words a pair), packed
// (pack_bf16_pairs), or GGUF blocks in records (pack_tile_blocks) that a task dequantizes into the same pairs, a step
// of 16 pairs (one record of each of its blocks) at a time.
constexpr int64_t kStepsAhead = 4;  // steps of records fetched ahead of their dequantization

struct WeightPairs {
  const uint16_t* packed = nullptr;
  const uint8_t* records = nullptr;
  static constexpr int64_t record_bytes = kTileBlockRecordBytes;
  int64_t blocks = 0, pairs = 0;

  int64_t block_words() const { return pairs * 2 * kRowsPerBlock; }
  int64_t steps() const { return pairs / kTileBlockPairs; }

  // Where a task finds the pairs of blocks first_block..first_block + count - 1, one after another: in place, or in
  // scratch, which fill() or fill_step() fill.
  const uint16_t* panel(int64_t first_block, int64_t count, std::vector<uint16_t>& scratch) const {
    if (packed != nullptr) return packed + first_block * block_words();
    if (scratch.size() < static_cast<size_t>(count * block_words())) scratch.resize(count * block_words());
    return scratch.data();
  }

  // Step s of the count blocks' records dequantized into their panel, the records kStepsAhead steps on fetched.
  void fill_step(int64_t first_block, int64_t count, int64_t s, uint16_t* panel) const {
    for (int64_t b = 0; b < count; ++b) {
      const uint8_t* record = records + ((first_block + b) * steps() + s) * record_bytes;
      if (s + kStepsAhead < steps())
        for (int64_t line = 0; line < record_bytes; line += 64) __builtin_prefetch(record + kStepsAhead * record_bytes + line, 0, 3);
      dequantize_tile_record(record, panel + b * block_words() + s * kTileBlockPairs * 2 * kRowsPerBlock);
    }
  }

  void fill(int64_t first_block, int64_t count, uint16_t* panel) const {
    for (int64_t s = 0; s < steps(); ++s) fill_step(first_block, count, s, panel);
  }
};

// The m x out_features sums split into tasks of chunk_rows rows by panel_blocks blocks, spread over the threads, each
// panel's chunks one after another (so each thread takes as many rows of its panels as the other, and a panel is read
// or dequantized once for all of its chunks); a task takes its panel of the weight's pairs (WeightPairs::panel), and
// its rows go in groups of group_rows to tile(first row, rows, the panel, its first block, blocks, columns, the
// scratch the tiles fill with the panel from its records as this group goes, or nullptr). Where the weight is in
// records, the panel is filled before its first task's groups, unless the tiles fill it as that task's first group
// goes (tiles_fill). Each thread calls enter() before its tasks and leave() after them.
template <typename Tile, typename Enter, typename Leave>
void for_each_tile(int64_t m, const WeightPairs& weight, int64_t out_features, int64_t chunk_rows, int64_t panel_blocks,
                   int64_t group_rows, bool tiles_fill, Tile tile, Enter enter, Leave leave) {
  const int64_t blocks = weight.blocks;
  const int64_t panels = (blocks + panel_blocks - 1) / panel_blocks, chunks = (m + chunk_rows - 1) / chunk_rows;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    enter();
    thread_local std::vector<uint16_t> scratch;  // kept by the thread: a panel's pairs are written before they are read
    int64_t filled_block = -1;  // the first block of the panel in scratch, in this call
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks, first_block = (task / chunks) * panel_blocks;
      const int task_blocks = static_cast<int>(std::min<int64_t>(panel_blocks, blocks - first_block));
      const int64_t columns = std::min<int64_t>(task_blocks * kRowsPerBlock, out_features - first_block * kRowsPerBlock);
      const uint16_t* panel = weight.panel(first_block, task_blocks, scratch);
      const bool to_fill = weight.records != nullptr && filled_block != first_block;
      if (to_fill && !tiles_fill) weight.fill(first_block, task_blocks, scratch.data());
      filled_block = first_block;
      const int64_t first_row = chunk * chunk_rows, last_row = std::min(m, (chunk + 1) * chunk_rows);
      for (int64_t r = first_row; r < last_row; r += group_rows) {
        uint16_t* fill_into = to_fill && tiles_fill && r == first_row ? scratch.data() : nullptr;
        tile(r, std::min(group_rows, last_row - r), panel, first_block, task_blocks, columns, fill_into);
      }
    }
    leave();
  });
}

#if defined(PAGEDSERVE_AMX_BF16)
constexpr int64_t kRowGroup = 32;      // input rows AMX tiles cover at once: two tiles of sums for each block
constexpr int64_t kPanelBlocks = 2;    // blocks of 16 outputs a task sweeps: its panel of the weight is read once
constexpr int64_t kTileChunkRows = 256; // input rows a task takes: their pairs stay in L2 while it sweeps its panel
constexpr int64_t kStepsLead = 2;       // steps of a panel dequantized ahead of the tiles that read them

// Tile `tile` of sums into out (leading dimension ld): whole where its 16 x 16 are all wanted, else through scratch.
void store_sums(int tile, float* out, int64_t ld, int64_t rows, int64_t columns, float* scratch) {
  if (rows <= 0 || columns <= 0) return;
  if (rows >= kTileRows16 && columns >= kRowsPerBlock) {
    store_sum_tile(tile, out, ld * static_cast<int64_t>(sizeof(float)));
    return;
  }
  store_sum_tile(tile, scratch, kRowsPerBlock * sizeof(float));
  const int64_t kept_columns = std::min<int64_t>(columns, kRowsPerBlock);
  for (int64_t r = 0; r < std::min<int64_t>(rows, kTileRows16); ++r) {
    std::memcpy(out + r * ld, scratch + r * kRowsPerBlock, kept_columns * sizeof(float));
  }
}

// RowTiles x 16 rows of x's pairs (zero rows past `rows`) against Blocks packed blocks: each sum accumulates the
// same tiles in the same order whatever the other rows are. Tiles 0-3 hold the sums (row tile r, block b: 2r + b), 4-5
// the input's row tiles, 6-7 the blocks.
// Where a fill is given, the panel w (its scratch, of blocks first_block...) is dequantized from the weight's records as
// the tiles go, kStepsLead steps ahead of the tiles that read it: a tile load of rows that vector stores just wrote
// waits for them to leave the store buffer.
struct PanelFill {
  const WeightPairs* weight = nullptr;
  int64_t first_block = 0;
  uint16_t* panel = nullptr;
};

template <int RowTiles, int Blocks>
void matrix_tile(const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld, int64_t rows,
                 int64_t columns, float* scratch, const PanelFill& fill) {
  const int64_t x_stride = pairs * static_cast<int64_t>(sizeof(uint32_t));
  const int64_t block_values = pairs * 2 * kRowsPerBlock;
  const int64_t steps = pairs / kPairsPerTile;
  if (fill.weight != nullptr)
    for (int64_t s = 0; s < std::min(kStepsLead, steps); ++s) fill.weight->fill_step(fill.first_block, Blocks, s, fill.panel);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < pairs; j += kPairsPerTile) {
    const int64_t lead = j / kPairsPerTile + kStepsLead;
    if (fill.weight != nullptr && lead < steps) fill.weight->fill_step(fill.first_block, Blocks, lead, fill.panel);
    _tile_loadd(4, x + j, x_stride);
    _tile_loadd(6, w + j * 2 * kRowsPerBlock, 64);
    if (Blocks == 2) _tile_loadd(7, w + block_values + j * 2 * kRowsPerBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Blocks == 2) _tile_dpbf16ps(1, 4, 7);
    if (RowTiles == 2) {
      _tile_loadd(5, x + kTileRows16 * pairs + j, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (Blocks == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_sums(0, out, ld, rows, columns, scratch);
  if (Blocks == 2) store_sums(1, out + kRowsPerBlock, ld, rows, columns - kRowsPerBlock, scratch);
  if (RowTiles == 2) {
    store_sums(2, out + kTileRows16 * ld, ld, rows - kTileRows16, columns, scratch);
    if (Blocks == 2) store_sums(3, out + kTileRows16 * ld + kRowsPerBlock, ld, rows - kTileRows16, columns - kRowsPerBlock, scratch);
  }
}

void any_matrix_tile(int row_tiles, int blocks, const uint32_t* x, int64_t pairs, const uint16_t* w, float* out, int64_t ld,
                     int64_t rows, int64_t columns, float* scratch, const PanelFill& fill) {
  static_assert(kPanelBlocks == 2 && kRowGroup == 2 * kTileRows16, "the branches below spell out the tile counts");
  if (row_tiles == 2) {
    blocks == 2 ? matrix_tile<2, 2>(x, pairs, w, out, ld, rows, columns, scratch, fill)
                : matrix_tile<2, 1>(x, pairs, w, out, ld, rows, columns, scratch, fill);
  } else {
    blocks == 2 ? matrix_tile<1, 2>(x, pairs, w, out, ld, rows, columns, scratch, fill)
                : matrix_tile<1, 1>(x, pairs, w, out, ld, rows, columns, scratch, fill);
  }
}

// The rows of x's last group where m is not a whole number of groups, zero after them: the tiles read whole groups,
// and x has m rows.
const uint32_t* last_group_rows(const uint32_t* x, int64_t m, int64_t pairs) {
  thread_local std::vector<uint32_t> group;
  const int64_t first = m / kRowGroup * kRowGroup;
  group.assign(kRowGroup * pairs, 0u);
  std::memcpy(group.data(), x + first * pairs, (m - first) * pairs * sizeof(uint32_t));
  return group.data();
}

// The sums of m rows on the tiles: tasks of a chunk of rows by a panel of blocks.
void matrix_tiles_linear(const uint32_t* x, int64_t m, const WeightPairs& weight, float* o, int64_t out_features) {
  const int64_t pairs = weight.pairs;
  const int64_t whole_rows = m / kRowGroup * kRowGroup;
  const uint32_t* last_group = whole_rows < m ? last_group_rows(x, m, pairs) : nullptr;
  for_each_tile(
      m, weight, out_features, kTileChunkRows, kPanelBlocks, kRowGroup, true,
      [&](int64_t r, int64_t rows, const uint16_t* panel, int64_t first_block, int task_blocks, int64_t columns, uint16_t* fill_into) {
        alignas(64) float scratch[kTileRows16 * kRowsPerBlock];  // a tile's sums where not all of them are wanted
        const PanelFill fill = fill_into != nullptr ? PanelFill{&weight, first_block, fill_into} : PanelFill{};
        const uint32_t* group = r < whole_rows ? x + r * pairs : last_group;
        any_matrix_tile(rows > kTileRows16 ? 2 : 1, task_blocks, group, pairs, panel,
                        o + r * out_features + first_block * kRowsPerBlock, out_features, rows, columns, scratch, fill);
      },
      configure_tiles, [] { _tile_release(); });
}
#endif

}  // namespace

bool bf16_dot_products() {
#if defined(__AVX512BF16__)
  return true;
#else
  return bf16_matrix_tiles();
#endif
}

bool bf16_matrix_tiles() {
#if defined(PAGEDSERVE_AMX_BF16)
  return amx_granted();
#else
  return false;
#endif
}

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a 2-D CPU tensor [out_features, in_features]");
  const auto values = weight.detach().to(at::kFloat).contiguous();
  const int64_t n = values.size(0), k = values.size(1);
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock, pairs = padded_pairs(k);
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

namespace {

// packed as WeightPairs: pack_bf16_pairs's int16 pairs, or pack_tile_blocks's uint8 records.
WeightPairs weight_pairs(const at::Tensor& packed) {
  WeightPairs weight;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed must come from pack_bf16_pairs or pack_tile_blocks");
  weight.blocks = packed.size(0);
  if (packed.scalar_type() == at::kShort) {
    TORCH_CHECK(packed.size(2) == 2 * kRowsPerBlock, "packed must come from pack_bf16_pairs");
    weight.packed = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
    weight.pairs = packed.size(1);
  } else {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(2) == kTileBlockRecordBytes,
                "packed must come from pack_bf16_pairs or pack_tile_blocks");
    weight.records = packed.data_ptr<uint8_t>();
    weight.pairs = packed.size(1) * kTileBlockPairs;
  }
  return weight;
}

}  // namespace

namespace {

// The m x out_features float32 sums' tensor: out (viewed so) where given, else a new one.
at::Tensor sums_of(const at::Tensor& x, int64_t m, int64_t out_features, const c10::optional<at::Tensor>& out) {
  if (!out.has_value() || !out->defined()) return at::empty({m, out_features}, x.options().dtype(at::kFloat));
  TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->numel() == m * out_features,
              "out must be a contiguous float32 tensor of ", m, " x ", out_features, " values");
  return out->view({m, out_features});
}

// x's rows ([m, k]) against weight, checked to have out_features and x's k.
at::Tensor checked_rows(const at::Tensor& x, const WeightPairs& weight, int64_t out_features) {
  TORCH_CHECK(out_features > (weight.blocks - 1) * kRowsPerBlock && out_features <= weight.blocks * kRowsPerBlock,
              "out_features (", out_features, ") must be the packed weight's");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor");
  const int64_t k = x.size(-1);
  TORCH_CHECK(padded_pairs(k) == weight.pairs, "x's last dimension (", k, ") must be the packed weight's in_features");
  return x.reshape({-1, k});
}

// sums ([m, out_features]) in x's shape, its last dimension out_features.
at::Tensor in_shape_of(const at::Tensor& sums, const at::Tensor& x, int64_t out_features) {
  auto out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  return sums.view(out_shape);
}

}  // namespace

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& out,
                             bool tiles) {
  const WeightPairs weight = weight_pairs(packed);
  const auto rows_in = checked_rows(x, weight, out_features);
  const int64_t m = rows_in.size(0), pairs = weight.pairs;
  const bool on_tiles = tiles && bf16_matrix_tiles();
  const auto x_pairs = padded_rows(rows_in, pairs, at::kBFloat16);
  const auto* pairs_of_x = reinterpret_cast<const uint32_t*>(x_pairs.data_ptr<at::BFloat16>());
  at::Tensor sums = sums_of(x, m, out_features, out);
  float* o = sums.data_ptr<float>();
#if defined(PAGEDSERVE_AMX_BF16)
  if (on_tiles) {
    matrix_tiles_linear(pairs_of_x, m, weight, o, out_features);
  } else
#endif
  {
    for_each_tile(
        m, weight, out_features, kChunkRows, kTileBlocks, kTileRows, false,
        [&](int64_t r, int64_t rows, const uint16_t* panel, int64_t first_block, int task_blocks, int64_t columns, uint16_t*) {
          any_tile(static_cast<int>(rows), task_blocks, pairs_of_x + r * pairs, pairs, panel,
                   o + r * out_features + first_block * kRowsPerBlock, out_features, columns);
        },
        [] {}, [] {});
  }
  return in_shape_of(sums, x, out_features);
}

bool bf16_weights_vector() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_weights_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& out) {
  const WeightPairs weight = weight_pairs(packed);
  TORCH_CHECK(weight.packed != nullptr, "packed must come from pack_bf16_pairs");
  const auto rows_in = checked_rows(x, weight, out_features);
  const int64_t m = rows_in.size(0), pairs = weight.pairs;
  const auto x_floats = padded_rows(rows_in, pairs, at::kFloat);
  const float* values = x_floats.data_ptr<float>();
  at::Tensor sums = sums_of(x, m, out_features, out);
  float* o = sums.data_ptr<float>();
  for_each_tile(
      m, weight, out_features, kFloatChunkRows, kFloatTileBlocks, kFloatChunkRows, false,
      [&](int64_t r, int64_t rows, const uint16_t* panel, int64_t first_block, int task_blocks, int64_t columns, uint16_t*) {
        float_task(values + r * 2 * pairs, 2 * pairs, rows, panel, pairs, task_blocks, o + r * out_features + first_block * kRowsPerBlock,
                   out_features, columns);
      },
      [] {}, [] {});
  return in_shape_of(sums, x, out_features);
}
