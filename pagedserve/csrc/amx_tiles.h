// AMX tiles as the kernels that run on them use them (bf16_gemm.cpp, fresh_attention.cpp): PAGEDSERVE_AMX_BF16 where the
// build has them, the permission Linux wants before a thread touches them, and one configuration for every kernel.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define PAGEDSERVE_AMX_BF16 1

inline constexpr int kTileRows16 = 16;  // rows of every AMX tile: 16 input rows, 16 pairs of a weight block, 16 rows of sums

// Linux grants AMX tile state to a process that asks (its 8 KB are saved at every switch); asked once.
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, every one 16 rows of 64 bytes: 16 x 16 float32 sums, or 16 rows of 16 pairs of bfloat16. A thread sets it
// before its first tile instruction of a parallel region and releases the tiles after its last.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows16;
    config.colsb[t] = 64;
  }
  // The compiler does not see ldtilecfg read the whole struct and may drop the stores above without this barrier.
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The tile intrinsics paste their tile numbers into the instruction's text: sum tiles 0-3, named at run time here.
inline void store_sum_tile(int64_t tile, float* out, int64_t stride_bytes) {
  switch (tile) {
    case 0: _tile_stored(0, out, stride_bytes); break;
    case 1: _tile_stored(1, out, stride_bytes); break;
    case 2: _tile_stored(2, out, stride_bytes); break;
    default: _tile_stored(3, out, stride_bytes); break;
  }
}

inline void zero_sum_tile(int64_t tile) {
  switch (tile) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}
#endif
