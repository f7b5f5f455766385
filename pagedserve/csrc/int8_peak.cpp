// How fast the processor's vector units multiply 8-bit integers into sums: independent chains of the widest
// unsigned-by-signed byte multiply-add it has (VNNI's vpdpbusd on its widest vectors, else vpmaddubsw with 16-bit sums,
// as the Q4 blocks' products keep them within a block), in registers, on every thread. `bench machine` reports it as
// the limit of integer products where torch's int8 GEMM has no kernel for these vectors: no loop that multiplies bytes
// on these units beats it.
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Independent chains: enough to cover a multiply-add's latency at the rate the units issue it, few enough for the
// compiler to keep in AVX2's 16 registers. A fused multiply-add into 32 bits (dpbusd) takes its sums as an operand, so
// each chain's turn differs from the others' with the same bytes. maddubs gives its products apart from the sums, so
// each chain multiplies its own sums' bytes (else one product of unchanged bytes would serve every chain and turn).
constexpr int kChains = 8;

// The widest vectors and their byte multiply-add; the sums' operand role as the comment above says.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
using Vec = __m512i;
inline Vec multiply_add(Vec sums, Vec u, Vec s) { return _mm512_dpbusd_epi32(sums, u, s); }
constexpr bool kSumsAreOperands = true;
#elif defined(__AVX512BW__)
using Vec = __m512i;
inline Vec multiply_add(Vec sums, Vec u, Vec s) { return _mm512_add_epi16(sums, _mm512_maddubs_epi16(u, s)); }
constexpr bool kSumsAreOperands = false;
#elif defined(__AVX2__) && defined(__AVXVNNI__)
using Vec = __m256i;
inline Vec multiply_add(Vec sums, Vec u, Vec s) { return _mm256_dpbusd_avx_epi32(sums, u, s); }
constexpr bool kSumsAreOperands = true;
#elif defined(__AVX2__)
using Vec = __m256i;
inline Vec multiply_add(Vec sums, Vec u, Vec s) { return _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, s)); }
constexpr bool kSumsAreOperands = false;
#endif

#if defined(__AVX2__)
#define PAGEDSERVE_INT8_VECTORS 1
constexpr int64_t kVecBytes = sizeof(Vec);

inline Vec splat(char value) {
  Vec v;
  std::memset(&v, value, sizeof v);
  return v;
}

inline int32_t first_lane(Vec v) {
  int32_t lane;
  std::memcpy(&lane, &v, sizeof lane);
  return lane;
}
#endif

#ifdef PAGEDSERVE_INT8_VECTORS
// `iterations` turns of every chain, on one thread; a lane of each chain's sums, added up. A function of its own, out of
// the OpenMP region, so that the compiler keeps every chain's sums in a register.
__attribute__((noinline)) int64_t turns(int64_t iterations, char seed) {
  // Named sums, not an array: the compiler keeps each in a register of its own.
  Vec a0 = splat(3), a1 = splat(4), a2 = splat(5), a3 = splat(6), a4 = splat(7), a5 = splat(8), a6 = splat(9),
      a7 = splat(10);
  const Vec u = splat(seed), s = splat(3);
#define PAGEDSERVE_TURN(a) a = multiply_add(a, u, kSumsAreOperands ? s : a)
  for (int64_t i = 0; i < iterations; ++i) {
    PAGEDSERVE_TURN(a0); PAGEDSERVE_TURN(a1); PAGEDSERVE_TURN(a2); PAGEDSERVE_TURN(a3);
    PAGEDSERVE_TURN(a4); PAGEDSERVE_TURN(a5); PAGEDSERVE_TURN(a6); PAGEDSERVE_TURN(a7);
  }
#undef PAGEDSERVE_TURN
  return first_lane(a0) + first_lane(a1) + first_lane(a2) + first_lane(a3) + first_lane(a4) + first_lane(a5) +
         first_lane(a6) + first_lane(a7);
}
#endif

volatile int64_t g_sink;  // the sums' lanes end here, so the loops are not optimized away

}  // namespace

int64_t int8_vector_products(int64_t iterations, int64_t num_threads) {
#ifdef PAGEDSERVE_INT8_VECTORS
  int64_t total = 0, sink = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total, sink)
  {
    sink += turns(iterations, static_cast<char>(1 + omp_get_thread_num()));
    total += iterations * kChains * kVecBytes;
  }
  g_sink = sink;
  return total;
#else
  (void)iterations;
  (void)num_threads;
  return 0;  // no byte multiply-add on these vectors
#endif
}
