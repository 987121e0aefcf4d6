/* The machine's int8 multiply-add peak, for benchmarks/int8_peak.py: the rate the quantized kernels'
 * integer products are held to (prompt processing and many-row decode steps are bound by it).
 *
 * Semantics: each of num_threads threads runs `iters` passes of CHAINS independent chains of the widest int8
 * product this build has: AVX512-VNNI, vpdpbusd on 512 bits (64 byte products); AVX2, vpmaddubsw on 256
 * bits (32 byte products) plus the vpaddw that accumulates its pair sums, as the kernels do. Returns the
 * byte products run over all threads (0 on a build without one); `sink` takes a value of every chain, so
 * the compiler keeps them. 10 chains cover the instructions' latency (4-5 cycles) on two pipes and stay
 * in registers (12 were spilled). */
#include <omp.h>
#include <stdint.h>

#include "simd.h"

#define CHAINS 10
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define PER 64
typedef __m512i chain_t;
#define STEP(a) a = _mm512_dpbusd_epi32(a, u, v)
#define START(c) _mm512_set1_epi32(c)
#define LOW(a) _mm_cvtsi128_si32(_mm512_castsi512_si128(a))
#elif defined(__AVX2__)
#define PER 32
typedef __m256i chain_t;
/* each chain's product reads its own last sum as the unsigned bytes: nothing is loop-invariant */
#define STEP(a) a = _mm256_add_epi16(_mm256_maddubs_epi16(a, v), v)
#define START(c) _mm256_set1_epi16(c)
#define LOW(a) _mm_cvtsi128_si32(_mm256_castsi256_si128(a))
#else
#define PER 0
#endif

#if PER > 0
/* One thread's chains, named (an array in the parallel region was spilled to the stack). */
static __attribute__((noinline)) int32_t chains(int64_t iters) {
#if PER == 64
    const __m512i u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(-5);
#else
    const __m256i v = _mm256_set1_epi8(-5);
#endif
    chain_t a0 = START(0), a1 = START(1), a2 = START(2), a3 = START(3), a4 = START(4), a5 = START(5);
    chain_t a6 = START(6), a7 = START(7), a8 = START(8), a9 = START(9);
    for (int64_t i = 0; i < iters; i++) {
        STEP(a0), STEP(a1), STEP(a2), STEP(a3), STEP(a4), STEP(a5), STEP(a6), STEP(a7), STEP(a8), STEP(a9);
    }
    __asm__ volatile("" ::"x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5), "x"(a6), "x"(a7), "x"(a8), "x"(a9));
    return LOW(a0) ^ LOW(a9);
}
#endif

int64_t int8_peak(int64_t iters, int num_threads, int32_t *sink) {
    int32_t total = 0;
#if PER > 0
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    total += chains(iters);
#endif
    *sink = total;
    return (int64_t)PER * CHAINS * iters * num_threads;
}
