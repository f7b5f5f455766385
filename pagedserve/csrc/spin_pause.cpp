// How long one turn of an OpenMP thread's spin takes. libgomp's waiting threads spin GOMP_SPINCOUNT turns, each a
// `pause` on x86, before they sleep; how long a pause lasts is the processor design's, so the count that makes a spin
// of a given length is the machine's (pagedserve/openmp.py).
#include <algorithm>
#include <chrono>

#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

double spin_pause_seconds() {
#if defined(__x86_64__) || defined(__i386__)
  constexpr int kTurns = 100000;
  double fastest = 1.0;
  for (int round = 0; round < 5; ++round) {  // the fastest of a few rounds: a round the OS interrupts runs long
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kTurns; ++i) _mm_pause();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    fastest = std::min(fastest, took.count() / kTurns);
  }
  return fastest;
#else
  return 0.0;  // no x86 pause: unknown
#endif
}
