// How many rows of a row-wise kernel one thread takes at a time (at::parallel_for's grain), shared by the kernels
// that split their rows among threads.
#pragma once
#include <algorithm>
#include <cstdint>

// Rows go to other threads only when there is enough work to pay for waking them.
inline constexpr int64_t kParallelGrainElements = 1 << 15;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelGrainElements / std::max<int64_t>(1, row_elements));
}
