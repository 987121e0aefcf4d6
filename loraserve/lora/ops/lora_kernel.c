/* Fused multi-LoRA shrink + expand on CPU, for float32 or bfloat16, loaded through ctypes by lora_cpu.py.
 *
 * Semantics (the pure-torch twin is lora_torch.add_lora): for every active token p of the step
 * (token_ids[p], grouped into segments of one slot each) and every slice q of the layer (packed
 * qkv / gate_up have several, a plain layer one), with s the segment's slot and r = ranks[s, q]:
 *     t = scale[p] * A[s, q*R : q*R + r, :] @ x[token]                             (shrink)
 *     y[token, off[q] : off[q+1]] += t @ Bt[s, q*R : q*R + r, off[q] : off[q+1]]   (expand)
 * (scale[p] is the token's per-request LoRA scale, 1 when the step has none; it scales the float32 sums
 * before t is stored, so t is rounded once.) A is [L, n*R, in] and Bt is [L, n*R, out], both contiguous: the block-diagonal slot buffers of
 * LinearWithLoRA. Only their non-zero blocks are read (never the off-diagonal zeros of a packed
 * layer, never the rows past an adapter's rank), so a decode step streams each adapter's weights
 * from memory once. x, y, A and Bt share one element type. In bfloat16, products are summed in
 * float32 and each element of y is rounded back to bf16 once (to nearest even). t is rounded to bf16
 * (to nearest even) before the expand in builds with AVX512-BF16, whose expand multiplies bf16 pairs,
 * as the torch twin and PEFT round it (theirs is a bf16 matmul's output); the other builds keep t in
 * float32. vdpbf16ps treats denormals as zero and flushes them, so with AVX512-BF16 a bf16 denormal in
 * x, A, Bt or in a row of y the expand adds to counts as zero.
 *
 * Why a kernel: a decode step with many adapters is memory-bound (16 adapters x 2 tokens read
 * ~300 MB of adapter weights per step for a 135M model), and torch's bmm path reads the zero
 * blocks too and pays ~10 dispatches per layer. Work is split over OpenMP threads; the library is
 * loaded after torch, so it shares torch's libgomp and its thread pool.
 *
 * Built with -march=native (loraserve/native/build.py), so the feature macros pick the code:
 * float32 runs AVX-512, AVX2 + FMA or scalar code; bfloat16 runs AVX-512 (vdpbf16ps dot products in
 * both halves where the CPU has AVX512-BF16, else bf16 -> fp32 widening and fp32 FMAs), AVX2, or
 * scalar code.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
#endif
#if W == 16 /* simd.h's AVX-512 level (F + BW + VL) */
#define LORA_AVX512 1 /* bf16: 32 values per vector, tails through masked loads and stores */
#ifdef __AVX512BF16__
#define LORA_BF16_DOT 1 /* vdpbf16ps / vcvtne2ps2bf16: the bf16 expand works on pairs of rank */
#endif
#endif

/* Expand columns per work item, at most, in a step whose segments are all one token group or less
 * (decode), and in float32: narrow items keep each thread's prefetches running ahead in an even
 * trickle, which draws more DRAM bandwidth than wide items in a many-adapter decode step. A bf16 step
 * with a longer segment reads each block of Bt once for all its token groups (the later ones find it
 * in L1), so the width there is the most (up to 4 * CHUNK) that keeps a [max_rank, width] block within
 * LONG_BLOCK_BYTES: fewer, wider items cut the per-item work. float32 was slower with wider items,
 * so it keeps 64 (the timings: benchmarks/README.md, "Kernel tuning figures"). The width only splits
 * columns among items, each column's sum is the same: results do not change. */
#define CHUNK 64
#define LONG_BLOCK_BYTES 8192

enum { LORA_F32 = 0, LORA_BF16 = 1 }; /* element type of x, y, A and Bt (and of a write record) */
typedef uint16_t bf16;

/* Vector bf16 <-> fp32: simd.h's pair layout (vbf16_even / vbf16_odd widen, vbf16_narrow rounds back);
 * sums and axpys do not care about the order. */
#ifdef LORA_AVX512
/* acc += the pairwise products of 32 bf16 values, in float32. */
static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    return _mm512_fmadd_ps(vbf16_even(a), vbf16_even(b), _mm512_fmadd_ps(vbf16_odd(a), vbf16_odd(b), acc));
#endif
}
#ifdef LORA_BF16_DOT
/* The pair layout of the dot-product expand. vdpbf16ps multiplies the two bf16 halves of each 32-bit
 * lane; interleaving rows k and k+1 of Bt with unpacklo / unpackhi_epi16 pairs them up, but the two
 * unpacks work within 128-bit lanes: of 32 columns c = 8 * L + m (L the 128-bit lane, m < 8), the
 * "lo" vector holds those with m < 4 in its 32-bit lane 4 * L + m, the "hi" vector those with m >= 4
 * in lane 4 * L + m - 4. y enters that layout through the same unpacks (against zero: a bf16 in the
 * high half of a 32-bit lane is its float32) and leaves it through one permute per 32 columns. */
static inline __m512 widen_lo(__m512i v) {
    return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
}
static inline __m512 widen_hi(__m512i v) {
    return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
}
/* 32 bf16 values of columns in order from the lo / hi float32 layout, each rounded to nearest even
 * (vcvtne2ps2bf16 flushes denormals to zero, as the vdpbf16ps that produced them already did). */
static inline __m512i narrow_lohi(__m512 lo, __m512 hi) {
    /* after the conversion, word w < 16 is lo's lane w and word 16 + w hi's lane w */
    static const uint16_t order[32] __attribute__((aligned(64))) = {
        0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,  7,  20, 21, 22, 23,
        8,  9,  10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    return _mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif
#elif defined(LORA_AVX2)
static inline __m256 dot_pairs(__m256 acc, __m256i a, __m256i b) {
    return _mm256_fmadd_ps(vbf16_even(a), vbf16_even(b), _mm256_fmadd_ps(vbf16_odd(a), vbf16_odd(b), acc));
}
#endif

/* Register blocking: a shrink work item is ROW_BLOCK rows of A against TOKEN_BLOCK tokens at a time,
 * so every vector of A or x loaded feeds several dot products (one row against one token re-read x
 * for every row and spent its time in horizontal sums); an expand pass widens each vector of Bt once
 * for TOKEN_BLOCK tokens. AVX2 has 16 vector registers, AVX-512 32: hence the smaller token block. */
#define ROW_BLOCK 4
#ifdef LORA_AVX512
#define TOKEN_BLOCK 4
#else
#define TOKEN_BLOCK 2
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The element of t for bfloat16 layers: bf16 where the build rounds t before the expand (AVX512-BF16:
 * the shrink stores it rounded, so the expand reads each pair {t[k], t[k + 1]} as one 32-bit word,
 * never converting it again per column chunk), else float32. */
#ifdef LORA_BF16_DOT
typedef bf16 tbf16;
static inline float tbf16_to_f32(tbf16 v) { return bf16_to_f32(v); }
static inline tbf16 f32_to_tbf16(float v) { return f32_to_bf16(v); }
#else
typedef float tbf16;
static inline float tbf16_to_f32(tbf16 v) { return v; }
static inline tbf16 f32_to_tbf16(float v) { return v; }
#endif
static inline int64_t t_elem_size(int elem) {
    return elem == LORA_BF16 ? (int64_t)sizeof(tbf16) : (int64_t)sizeof(float);
}

#ifdef LORA_AVX512
/* out[tk * ld + r] = the sum of acc[r][tk]'s 16 lanes, for all ROW_BLOCK rows and tk < T (<= 4):
 * one transpose-and-add tree for the 16 sums instead of 16 horizontal reductions (~50 instructions
 * instead of ~140). First across 128-bit lanes: token tk's partial sums of row r end up in 128-bit
 * lane tk of w[r]; then within lanes: lane tk of the result holds rows 0..3 of token tk, in order,
 * which is exactly out[tk * ld : tk * ld + 4]. Missing tokens (tk >= T) are zeros. */
ALWAYS_INLINE __m512 sums_4x4(__m512 acc[ROW_BLOCK][TOKEN_BLOCK], int T) {
    __m512 w[ROW_BLOCK];
    for (int r = 0; r < ROW_BLOCK; ++r) {
        __m512 v[4];
        for (int tk = 0; tk < 4; ++tk) v[tk] = tk < T ? acc[r][tk] : _mm512_setzero_ps();
        /* {v0.L0 + v0.L2, v0.L1 + v0.L3, v1.L0 + v1.L2, v1.L1 + v1.L3}, and the same of v2, v3 */
        const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
        w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    /* per 128-bit lane: {w0[0] + w0[2], w1[0] + w1[2], w0[1] + w0[3], w1[1] + w1[3]}, the same of w2, w3 */
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
}
ALWAYS_INLINE void store_sums_4x4(__m512 acc[ROW_BLOCK][TOKEN_BLOCK], int T, float *out, int64_t ld) {
    const __m512 sums = sums_4x4(acc, T);
    _mm_storeu_ps(out, _mm512_castps512_ps128(sums));
    if (T > 1) _mm_storeu_ps(out + ld, _mm512_extractf32x4_ps(sums, 1));
    if (T > 2) _mm_storeu_ps(out + 2 * ld, _mm512_extractf32x4_ps(sums, 2));
    if (T > 3) _mm_storeu_ps(out + 3 * ld, _mm512_extractf32x4_ps(sums, 3));
}
#ifdef LORA_BF16_DOT
/* The same sums rounded to bf16 (to nearest even; vcvtneps2bf16, which flushes denormals to zero as the
 * vdpbf16ps that reads them would), 4 per token. */
ALWAYS_INLINE void store_sums_4x4_bf16(__m512 acc[ROW_BLOCK][TOKEN_BLOCK], int T, bf16 *out, int64_t ld) {
    const __m256i sums = (__m256i)_mm512_cvtneps_pbh(sums_4x4(acc, T));
    const __m128i lo = _mm256_castsi256_si128(sums), hi = _mm256_extracti128_si256(sums, 1);
    /* 8 bytes a token through memcpy: a row of t starts on any even address when max_rank % 4 != 0. */
    uint64_t words[4] = {(uint64_t)_mm_cvtsi128_si64(lo), (uint64_t)_mm_extract_epi64(lo, 1),
                         (uint64_t)_mm_cvtsi128_si64(hi), (uint64_t)_mm_extract_epi64(hi, 1)};
    for (int tk = 0; tk < T; ++tk) memcpy(out + tk * ld, &words[tk], sizeof words[tk]);
}
#endif
#endif

/* The per-token scale of a scaled step (sc[tk], NULL: none) applied to the float32 accumulators before
 * they are summed and stored, so t is rounded once, after the scale (as the torch twin rounds it). */
#define SCALE_ACCS(acc, R, T, sc, vtype, mul, set1)                                            \
    do {                                                                                        \
        if (sc)                                                                                 \
            for (int tk_ = 0; tk_ < (T); ++tk_) {                                               \
                const vtype s_ = set1((sc)[tk_]);                                               \
                for (int r_ = 0; r_ < (R); ++r_) acc[r_][tk_] = mul(acc[r_][tk_], s_);          \
            }                                                                                   \
    } while (0)

/* out[tk * ld + r] = sc[tk] * a[r * n : (r + 1) * n] . xs[tk][0 : n] for r < R, tk < T (sc NULL: a
 * scale of 1; float32 sums, stored
 * as tbf16). Inlined with constant R and T, the R * T sums live in registers. */
ALWAYS_INLINE void shrink_block_bf16(const bf16 *a, int64_t n, int R, const bf16 *const *xs, int T,
                                     const float *sc, tbf16 *out, int64_t ld) {
    if (R > ROW_BLOCK || T > TOKEN_BLOCK) __builtin_unreachable();
    int64_t j = 0;
#if defined(LORA_AVX512)
    __m512 acc[ROW_BLOCK][TOKEN_BLOCK];
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) acc[r][tk] = _mm512_setzero_ps();
    for (; j < n; j += 32) {
        const __mmask32 m = mask32_first(n - j);
        __m512i av[ROW_BLOCK];
        for (int r = 0; r < R; ++r) av[r] = _mm512_maskz_loadu_epi16(m, a + r * n + j);
        for (int tk = 0; tk < T; ++tk) {
            const __m512i xv = _mm512_maskz_loadu_epi16(m, xs[tk] + j);
            for (int r = 0; r < R; ++r) acc[r][tk] = dot_pairs(acc[r][tk], av[r], xv);
        }
    }
    SCALE_ACCS(acc, R, T, sc, __m512, _mm512_mul_ps, _mm512_set1_ps);
    if (R == ROW_BLOCK) {
#ifdef LORA_BF16_DOT
        store_sums_4x4_bf16(acc, T, out, ld);
#else
        store_sums_4x4(acc, T, out, ld);
#endif
        return;
    }
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = f32_to_tbf16(_mm512_reduce_add_ps(acc[r][tk]));
    return;
#elif defined(LORA_AVX2)
    __m256 acc[ROW_BLOCK][TOKEN_BLOCK];
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) acc[r][tk] = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m256i av[ROW_BLOCK];
        for (int r = 0; r < R; ++r) av[r] = _mm256_loadu_si256((const __m256i *)(a + r * n + j));
        for (int tk = 0; tk < T; ++tk) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs[tk] + j));
            for (int r = 0; r < R; ++r) acc[r][tk] = dot_pairs(acc[r][tk], av[r], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = vhsum(acc[r][tk]);
#else
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = 0.0f;
#endif
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) {
            float sum = tbf16_to_f32(out[tk * ld + r]);
            for (int64_t i = j; i < n; ++i) sum += bf16_to_f32(a[r * n + i]) * bf16_to_f32(xs[tk][i]);
            out[tk * ld + r] = f32_to_tbf16(sc ? sum * sc[tk] : sum);
        }
}

ALWAYS_INLINE void shrink_block_f32(const float *a, int64_t n, int R, const float *const *xs, int T,
                                    const float *sc, float *out, int64_t ld) {
    if (R > ROW_BLOCK || T > TOKEN_BLOCK) __builtin_unreachable();
    int64_t j = 0;
#if defined(LORA_AVX512)
    __m512 acc[ROW_BLOCK][TOKEN_BLOCK];
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) acc[r][tk] = _mm512_setzero_ps();
    for (; j < n; j += 16) {
        const __mmask16 m = mask16_first(n - j);
        __m512 av[ROW_BLOCK];
        for (int r = 0; r < R; ++r) av[r] = _mm512_maskz_loadu_ps(m, a + r * n + j);
        for (int tk = 0; tk < T; ++tk) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xs[tk] + j);
            for (int r = 0; r < R; ++r) acc[r][tk] = _mm512_fmadd_ps(av[r], xv, acc[r][tk]);
        }
    }
    SCALE_ACCS(acc, R, T, sc, __m512, _mm512_mul_ps, _mm512_set1_ps);
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = _mm512_reduce_add_ps(acc[r][tk]);
    return;
#elif defined(LORA_AVX2)
    __m256 acc[ROW_BLOCK][TOKEN_BLOCK];
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) acc[r][tk] = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 av[ROW_BLOCK];
        for (int r = 0; r < R; ++r) av[r] = _mm256_loadu_ps(a + r * n + j);
        for (int tk = 0; tk < T; ++tk) {
            const __m256 xv = _mm256_loadu_ps(xs[tk] + j);
            for (int r = 0; r < R; ++r) acc[r][tk] = _mm256_fmadd_ps(av[r], xv, acc[r][tk]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = vhsum(acc[r][tk]);
#else
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) out[tk * ld + r] = 0.0f;
#endif
    for (int r = 0; r < R; ++r)
        for (int tk = 0; tk < T; ++tk) {
            float sum = out[tk * ld + r];
            for (int64_t i = j; i < n; ++i) sum += a[r * n + i] * xs[tk][i];
            out[tk * ld + r] = sc ? sum * sc[tk] : sum;
        }
}

#ifdef LORA_BF16_DOT
/* c[tk] += the pair products of ranks k and k + 1: b0 / b1 hold 64 columns of row k, n0 / n1 of row
 * k + 1, or zeros when k is an odd rank's last (`last`: then t[k + 1] is not read either). */
ALWAYS_INLINE void expand_pair(__m512 c[TOKEN_BLOCK][4], int T, const bf16 *const *ts, int64_t k, int last,
                               __m512i b0, __m512i b1, __m512i n0, __m512i n1) {
    const __m512i w[4] = {_mm512_unpacklo_epi16(b0, n0), _mm512_unpackhi_epi16(b0, n0),
                          _mm512_unpacklo_epi16(b1, n1), _mm512_unpackhi_epi16(b1, n1)};
    for (int tk = 0; tk < T; ++tk) {
        uint32_t pair = ts[tk][k]; /* {t[k], t[k + 1]}: the low half is the first */
        if (!last) memcpy(&pair, ts[tk] + k, sizeof pair);
        const __m512bh coef = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int u = 0; u < 4; ++u) c[tk][u] = _mm512_dpbf16_ps(c[tk][u], (__m512bh)w[u], coef);
    }
}
#endif

/* ys[tk][j] += sum_{k < rank} ts[tk][k] * b[k * ld + j] for j < width, tk < T: each vector of b is
 * loaded (and widened or interleaved) once for the T tokens; y is widened once and rounded once. With
 * AVX512-BF16, ts holds t as the shrink stored it: rounded to bf16. */
ALWAYS_INLINE void expand_block_bf16(bf16 *const *ys, const tbf16 *const *ts, int T, const bf16 *b, int64_t ld,
                                     int64_t rank, int64_t width) {
    if (T > TOKEN_BLOCK) __builtin_unreachable();
    int64_t j = 0;
#if defined(LORA_BF16_DOT)
    /* t (rounded to bf16 by the shrink): ranks k and k + 1 in one vdpbf16ps, the 32-bit word
     * {t[k], t[k + 1]} broadcast against rows k and k + 1 of Bt interleaved (pair layout above); an
     * odd rank's last row pairs with zeros, and no row past the rank is read. */
    for (; j < width; j += 64) {
        const __mmask32 m0 = mask32_first(width - j), m1 = mask32_first(width - j - 32);
        __m512 c[TOKEN_BLOCK][4];
        for (int tk = 0; tk < T; ++tk) {
            const __m512i y0 = _mm512_maskz_loadu_epi16(m0, ys[tk] + j), y1 = _mm512_maskz_loadu_epi16(m1, ys[tk] + j + 32);
            c[tk][0] = widen_lo(y0), c[tk][1] = widen_hi(y0), c[tk][2] = widen_lo(y1), c[tk][3] = widen_hi(y1);
        }
        const bf16 *row = b + j;
        int64_t k = 0;
        for (; k + 1 < rank; k += 2, row += 2 * ld)
            expand_pair(c, T, ts, k, 0, _mm512_maskz_loadu_epi16(m0, row), _mm512_maskz_loadu_epi16(m1, row + 32),
                        _mm512_maskz_loadu_epi16(m0, row + ld), _mm512_maskz_loadu_epi16(m1, row + ld + 32));
        if (k < rank)
            expand_pair(c, T, ts, k, 1, _mm512_maskz_loadu_epi16(m0, row), _mm512_maskz_loadu_epi16(m1, row + 32),
                        _mm512_setzero_si512(), _mm512_setzero_si512());
        for (int tk = 0; tk < T; ++tk) {
            _mm512_mask_storeu_epi16(ys[tk] + j, m0, narrow_lohi(c[tk][0], c[tk][1]));
            _mm512_mask_storeu_epi16(ys[tk] + j + 32, m1, narrow_lohi(c[tk][2], c[tk][3]));
        }
    }
#elif defined(LORA_AVX512)
    for (; j < width; j += 64) {
        const __mmask32 m0 = mask32_first(width - j), m1 = mask32_first(width - j - 32);
        __m512 c[TOKEN_BLOCK][4];
        for (int tk = 0; tk < T; ++tk) {
            const __m512i y0 = _mm512_maskz_loadu_epi16(m0, ys[tk] + j), y1 = _mm512_maskz_loadu_epi16(m1, ys[tk] + j + 32);
            c[tk][0] = vbf16_even(y0), c[tk][1] = vbf16_odd(y0), c[tk][2] = vbf16_even(y1), c[tk][3] = vbf16_odd(y1);
        }
        for (int64_t k = 0; k < rank; ++k) {
            const __m512i b0 = _mm512_maskz_loadu_epi16(m0, b + k * ld + j);
            const __m512i b1 = _mm512_maskz_loadu_epi16(m1, b + k * ld + j + 32);
            const __m512 w[4] = {vbf16_even(b0), vbf16_odd(b0), vbf16_even(b1), vbf16_odd(b1)};
            for (int tk = 0; tk < T; ++tk) {
                const __m512 coef = _mm512_set1_ps(ts[tk][k]);
                for (int u = 0; u < 4; ++u) c[tk][u] = _mm512_fmadd_ps(coef, w[u], c[tk][u]);
            }
        }
        for (int tk = 0; tk < T; ++tk) {
            _mm512_mask_storeu_epi16(ys[tk] + j, m0, vbf16_narrow(c[tk][0], c[tk][1]));
            _mm512_mask_storeu_epi16(ys[tk] + j + 32, m1, vbf16_narrow(c[tk][2], c[tk][3]));
        }
    }
#elif defined(LORA_AVX2)
    for (; j + 32 <= width; j += 32) {
        __m256 c[TOKEN_BLOCK][4];
        for (int tk = 0; tk < T; ++tk) {
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)(ys[tk] + j));
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(ys[tk] + j + 16));
            c[tk][0] = vbf16_even(y0), c[tk][1] = vbf16_odd(y0), c[tk][2] = vbf16_even(y1), c[tk][3] = vbf16_odd(y1);
        }
        for (int64_t k = 0; k < rank; ++k) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(b + k * ld + j));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + k * ld + j + 16));
            const __m256 w[4] = {vbf16_even(b0), vbf16_odd(b0), vbf16_even(b1), vbf16_odd(b1)};
            for (int tk = 0; tk < T; ++tk) {
                const __m256 coef = _mm256_broadcast_ss(ts[tk] + k);
                for (int u = 0; u < 4; ++u) c[tk][u] = _mm256_fmadd_ps(coef, w[u], c[tk][u]);
            }
        }
        for (int tk = 0; tk < T; ++tk) {
            _mm256_storeu_si256((__m256i *)(ys[tk] + j), vbf16_narrow(c[tk][0], c[tk][1]));
            _mm256_storeu_si256((__m256i *)(ys[tk] + j + 16), vbf16_narrow(c[tk][2], c[tk][3]));
        }
    }
#endif
    for (int tk = 0; tk < T; ++tk)
        for (int64_t i = j; i < width; ++i) {
            float acc = bf16_to_f32(ys[tk][i]);
            for (int64_t k = 0; k < rank; ++k) acc += tbf16_to_f32(ts[tk][k]) * bf16_to_f32(b[k * ld + i]);
            ys[tk][i] = f32_to_bf16(acc);
        }
}

ALWAYS_INLINE void expand_block_f32(float *const *ys, const float *const *ts, int T, const float *b, int64_t ld,
                                    int64_t rank, int64_t width) {
    if (T > TOKEN_BLOCK) __builtin_unreachable();
    int64_t j = 0;
#if defined(LORA_AVX512)
    for (; j < width; j += 64) {
        __mmask16 m[4];
        __m512 c[TOKEN_BLOCK][4];
        for (int u = 0; u < 4; ++u) m[u] = mask16_first(width - j - 16 * u);
        for (int tk = 0; tk < T; ++tk)
            for (int u = 0; u < 4; ++u) c[tk][u] = _mm512_maskz_loadu_ps(m[u], ys[tk] + j + 16 * u);
        for (int64_t k = 0; k < rank; ++k) {
            __m512 w[4];
            for (int u = 0; u < 4; ++u) w[u] = _mm512_maskz_loadu_ps(m[u], b + k * ld + j + 16 * u);
            for (int tk = 0; tk < T; ++tk) {
                const __m512 coef = _mm512_set1_ps(ts[tk][k]);
                for (int u = 0; u < 4; ++u) c[tk][u] = _mm512_fmadd_ps(coef, w[u], c[tk][u]);
            }
        }
        for (int tk = 0; tk < T; ++tk)
            for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(ys[tk] + j + 16 * u, m[u], c[tk][u]);
    }
#elif defined(LORA_AVX2)
    for (; j + 32 <= width; j += 32) {
        __m256 c[TOKEN_BLOCK][4];
        for (int tk = 0; tk < T; ++tk)
            for (int u = 0; u < 4; ++u) c[tk][u] = _mm256_loadu_ps(ys[tk] + j + 8 * u);
        for (int64_t k = 0; k < rank; ++k) {
            __m256 w[4];
            for (int u = 0; u < 4; ++u) w[u] = _mm256_loadu_ps(b + k * ld + j + 8 * u);
            for (int tk = 0; tk < T; ++tk) {
                const __m256 coef = _mm256_broadcast_ss(ts[tk] + k);
                for (int u = 0; u < 4; ++u) c[tk][u] = _mm256_fmadd_ps(coef, w[u], c[tk][u]);
            }
        }
        for (int tk = 0; tk < T; ++tk)
            for (int u = 0; u < 4; ++u) _mm256_storeu_ps(ys[tk] + j + 8 * u, c[tk][u]);
    }
#endif
    for (int tk = 0; tk < T; ++tk)
        for (int64_t i = j; i < width; ++i) {
            float acc = ys[tk][i];
            for (int64_t k = 0; k < rank; ++k) acc += ts[tk][k] * b[k * ld + i];
            ys[tk][i] = acc;
        }
}
/* A slot's rank for one slice, clamped to [0, max_rank] so no value can index past the buffers. */
static inline int64_t slice_rank(const int32_t *ranks, int64_t index, int64_t max_rank) {
    const int64_t rank = ranks[index];
    return rank < 0 ? 0 : (rank > max_rank ? max_rank : rank);
}

/* A segment's tokens are cut into groups of TOKEN_GROUP; every work item serves one group, so the
 * threads share a long segment (one adapter) mostly by its tokens: apart from the items at the edge of
 * a thread's range, each writes its own rows of t and y (splitting by rows of A had both threads
 * writing every cache line of t). A shrink item is a block of ROW_BLOCK rows of one slice; an expand
 * item a chunk of columns of one slice. */
#define TOKEN_GROUP 8
#define SEG_MAJOR_MIN 2 /* segments per thread, at least, for the segment-major order (run_segments) */
#define PREFETCH_AHEAD 4 /* items: the blocks of A and Bt a thread needs next are fetched while it computes */

typedef struct {
    int64_t q, col, width;
} SliceChunk;

/* Cut each slice into chunks of `chunk` columns (the last one narrower); returns the count. */
static int64_t slice_chunks(const int64_t *offsets, int64_t num_slices, int64_t chunk, SliceChunk *out) {
    int64_t count = 0;
    for (int64_t q = 0; q < num_slices; ++q) {
        const int64_t width = offsets[q + 1] - offsets[q];
        for (int64_t col = 0; col < width; col += chunk) {
            if (out) out[count] = (SliceChunk){q, offsets[q] + col, width - col < chunk ? width - col : chunk};
            ++count;
        }
    }
    return count;
}

static inline void prefetch_rows(const char *p, int64_t row_bytes, int64_t ld_bytes, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + r * ld_bytes + off, 0, 0);
}

static inline void thread_range(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
    const int64_t tid = 0, nth = 1;
#endif
    *lo = n * tid / nth;
    *hi = n * (tid + 1) / nth;
}

#define SHRINK_CALL(fn, type, R_, T_) fn((const type *)a_rows, in, R_, (const type *const *)xs, T_, sc, out, ld)
#define SHRINK_BY_SIZE(fn, type)                                                                  \
    do {                                                                                          \
        if (R == ROW_BLOCK && T == TOKEN_BLOCK) SHRINK_CALL(fn, type, ROW_BLOCK, TOKEN_BLOCK);   \
        else if (R == ROW_BLOCK && T == 1) SHRINK_CALL(fn, type, ROW_BLOCK, 1);                   \
        else if (R == ROW_BLOCK && T == 2) SHRINK_CALL(fn, type, ROW_BLOCK, 2);                   \
        else SHRINK_CALL(fn, type, R, T);                                                         \
    } while (0)

/* t[p * ld + row] for the R rows of A at a_rows and the tokens p of one segment (t of float, or of
 * tbf16 for bf16 layers), each token's row times scales[p] (scales NULL: unscaled). */
static void shrink_item(int elem, const char *a_rows, int64_t in, int R, const void *x, int64_t x_stride,
                        const int64_t *token_ids, const float *scales, int64_t start, int64_t len, void *t,
                        int64_t ld) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4;
    for (int64_t m = 0; m < len; m += TOKEN_BLOCK) {
        const int T = len - m < TOKEN_BLOCK ? (int)(len - m) : TOKEN_BLOCK;
        const void *xs[TOKEN_BLOCK];
        for (int tk = 0; tk < T; ++tk) xs[tk] = (const char *)x + size * token_ids[start + m + tk] * x_stride;
        void *out = (char *)t + t_elem_size(elem) * (start + m) * ld;
        const float *sc = scales ? scales + start + m : NULL;
        if (elem == LORA_BF16) SHRINK_BY_SIZE(shrink_block_bf16, bf16);
        else SHRINK_BY_SIZE(shrink_block_f32, float);
    }
}

#define EXPAND_CALL(fn, type, ttype, T_) \
    fn((type *const *)ys, (const ttype *const *)ts, T_, (const type *)b, ld, rank, width)
#define EXPAND_BY_SIZE(fn, type, ttype)                                 \
    do {                                                                \
        if (T == TOKEN_BLOCK) EXPAND_CALL(fn, type, ttype, TOKEN_BLOCK); \
        else if (T == 1) EXPAND_CALL(fn, type, ttype, 1);               \
        else if (T == 2) EXPAND_CALL(fn, type, ttype, 2);               \
        else EXPAND_CALL(fn, type, ttype, T);                           \
    } while (0)

/* y[token p, col : col + width] += t[p * t_ld : + rank] @ b (rank rows of ld elements) for the tokens
 * p in [first, last) of token_ids. */
static void expand_item(int elem, void *y, int64_t y_stride, const char *b, int64_t ld, int64_t rank,
                        int64_t col, int64_t width, const void *t, int64_t t_ld, const int64_t *token_ids,
                        int64_t first, int64_t last) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4, t_size = t_elem_size(elem);
    for (int64_t p = first; p < last; p += TOKEN_BLOCK) {
        const int T = last - p < TOKEN_BLOCK ? (int)(last - p) : TOKEN_BLOCK;
        void *ys[TOKEN_BLOCK];
        const void *ts[TOKEN_BLOCK];
        for (int tk = 0; tk < T; ++tk) {
            ys[tk] = (char *)y + size * (token_ids[p + tk] * y_stride + col);
            ts[tk] = (const char *)t + t_size * (p + tk) * t_ld;
        }
        if (elem == LORA_BF16) EXPAND_BY_SIZE(expand_block_bf16, bf16, tbf16);
        else EXPAND_BY_SIZE(expand_block_f32, float, float);
    }
}

/* The layer's buffers and the step's segments, as lora_fused receives them. */
typedef struct {
    int elem;
    int64_t size, t_size, in, out, max_rank, num_slices, stacked_rank, row_blocks, num_chunks; /* bytes per element */
    int64_t num_segs;
    const char *a, *bt;
    const int32_t *ranks;
    const int64_t *token_ids, *seg_slots, *seg_starts, *seg_lens, *shrink_first, *expand_first;
    const SliceChunk *chunks;
    const float *scales; /* per active token, in token_ids order; NULL: every scale is 1 */
} Step;

/* A thread's walk over its items: item `item` is sub-item `sub` (of per_group) of the token group
 * [first, last) of segment `seg`; with `inner` sub-items per slice, sub = q * inner + r. Stepping it
 * item by item (cursor_next) replaces a search and two 64-bit divisions per item (and as many again
 * for the item prefetched ahead): ~100 cycles of a 64-column expand item's ~300 in a decode step. */
typedef struct {
    int64_t item, seg, first, last, sub, q, r;
} Cursor;

/* The cursor at `item` (< the item count), each token group of a segment having per_group items. */
static Cursor cursor_at(const Step *s, const int64_t *seg_first, int64_t per_group, int64_t inner, int64_t item) {
    Cursor c = {item, 0, 0, 0, 0, 0, 0};
    while (item >= seg_first[c.seg + 1]) ++c.seg;
    const int64_t local = item - seg_first[c.seg], end = s->seg_starts[c.seg] + s->seg_lens[c.seg];
    c.first = s->seg_starts[c.seg] + local / per_group * TOKEN_GROUP;
    c.last = c.first + TOKEN_GROUP < end ? c.first + TOKEN_GROUP : end;
    c.sub = local % per_group, c.q = c.sub / inner, c.r = c.sub % inner;
    return c;
}

/* The next item: the next sub-item of the group, else the group's next token group, else the first
 * group of the next segment that has tokens (after the last item, c->seg is num_segs). */
static inline void cursor_next(const Step *s, int64_t per_group, int64_t inner, Cursor *c) {
    ++c->item;
    if (++c->sub < per_group) {
        if (++c->r == inner) c->r = 0, ++c->q;
        return;
    }
    c->sub = c->q = c->r = 0;
    int64_t end = s->seg_starts[c->seg] + s->seg_lens[c->seg];
    if (c->last < end) c->first = c->last;
    else {
        do ++c->seg;
        while (c->seg < s->num_segs && s->seg_lens[c->seg] <= 0);
        if (c->seg == s->num_segs) return;
        c->first = s->seg_starts[c->seg], end = c->first + s->seg_lens[c->seg];
    }
    c->last = c->first + TOKEN_GROUP < end ? c->first + TOKEN_GROUP : end;
}

/* Whether a thread whose items start at `lo` has read the cursor's block of weights (A or Bt) for the
 * token group before its own in the same segment: that item is c->item - per_group. A prefetch of it
 * then only costs instructions (a long segment's later groups find the block in cache), so it is
 * skipped. */
static inline int read_before(const Step *s, const Cursor *c, int64_t per_group, int64_t lo) {
    return c->first > s->seg_starts[c->seg] && c->item - per_group >= lo;
}

/* The cursor's shrink item: ROW_BLOCK rows of one slice (c->q, block c->r) against one token group;
 * with t NULL, only prefetch its rows of A (unless read_before, `lo` the thread's first item). */
ALWAYS_INLINE void shrink_at(const Step *s, const Cursor *c, int64_t lo, const void *x, int64_t x_stride, void *t) {
    const int64_t row0 = c->r * ROW_BLOCK, slot = s->seg_slots[c->seg];
    const int64_t rank = slice_rank(s->ranks, slot * s->num_slices + c->q, s->max_rank);
    if (row0 >= rank) return;
    const int R = rank - row0 < ROW_BLOCK ? (int)(rank - row0) : ROW_BLOCK;
    const int64_t row = c->q * s->max_rank + row0;
    const char *a_rows = s->a + s->size * (slot * s->stacked_rank + row) * s->in;
    if (t == NULL) {
        if (!read_before(s, c, s->num_slices * s->row_blocks, lo)) prefetch_rows(a_rows, s->size * s->in * R, 0, 1);
    } else shrink_item(s->elem, a_rows, s->in, R, x, x_stride, s->token_ids, s->scales, c->first, c->last - c->first,
                       (char *)t + s->t_size * row, s->stacked_rank);
}

/* The cursor's expand item: one column chunk (c->sub) of one slice for one token group; with y NULL,
 * only prefetch its block of Bt (unless read_before, `lo` the thread's first item). */
ALWAYS_INLINE void expand_at(const Step *s, const Cursor *c, int64_t lo, void *y, int64_t y_stride, const void *t) {
    const SliceChunk ch = s->chunks[c->sub];
    const int64_t slot = s->seg_slots[c->seg], rank = slice_rank(s->ranks, slot * s->num_slices + ch.q, s->max_rank);
    if (rank == 0) return;
    const char *b = s->bt + s->size * ((slot * s->stacked_rank + ch.q * s->max_rank) * s->out + ch.col);
    if (y == NULL) {
        if (!read_before(s, c, s->num_chunks, lo)) prefetch_rows(b, s->size * ch.width, s->size * s->out, rank);
    } else expand_item(s->elem, y, y_stride, b, s->out, rank, ch.col, ch.width,
                       (const char *)t + s->t_size * ch.q * s->max_rank, s->stacked_rank, s->token_ids, c->first,
                       c->last);
}

/* seg_first[g] = the first item of segment g, each token group of a segment having per_group items;
 * seg_first[num_segs] is the item count, seg_first[num_segs + 1] a sentinel for cursor_at's walk. */
static void first_items(const int64_t *seg_lens, int64_t num_segs, int64_t per_group, int64_t *seg_first) {
    seg_first[0] = 0;
    for (int64_t g = 0; g < num_segs; ++g)
        seg_first[g + 1] = seg_first[g] + (seg_lens[g] + TOKEN_GROUP - 1) / TOKEN_GROUP * per_group;
    seg_first[num_segs + 1] = INT64_MAX;
}

/* The calling thread's scratch for calls that need at most SCRATCH_CACHED bytes (t, the chunks and the
 * segments' first items of a decode step need a few KiB): kept between calls (grow-only), where a
 * malloc and a free of each buffer per call was a visible share of a decode call. Larger calls allocate their
 * own. Thread-local, so concurrent callers (the decoder stack, python threads) never share one. */
#define SCRATCH_CACHED (64 * 1024)
static __thread void *cached_scratch;
static __thread size_t cached_bytes;

static void *scratch_get(size_t bytes) {
    if (bytes > SCRATCH_CACHED) return aligned_alloc(64, bytes);
    if (bytes > cached_bytes) {
        free(cached_scratch);
        cached_bytes = bytes < 4096 ? 4096 : SCRATCH_CACHED;
        cached_scratch = aligned_alloc(64, cached_bytes);
        if (cached_scratch == NULL) cached_bytes = 0;
    }
    return cached_scratch;
}

static void scratch_put(void *p) {
    if (p != cached_scratch) free(p);
}

/* Items [lo, hi) of one pass (shrink or expand), each computed after prefetching the item
 * PREFETCH_AHEAD further on: a thread's share of the pass. */
#define RUN_RANGE(at, seg_first, per_group, inner, lo, hi, out, out_stride, in)                        \
    do {                                                                                               \
        if ((lo) < (hi)) {                                                                             \
            Cursor cur = cursor_at(&s, seg_first, per_group, inner, lo), ahead = cur;                  \
            if ((lo) + PREFETCH_AHEAD < (hi)) ahead = cursor_at(&s, seg_first, per_group, inner, (lo) + PREFETCH_AHEAD); \
            for (; cur.item < (hi); cursor_next(&s, per_group, inner, &cur)) {                         \
                if (ahead.item > cur.item && ahead.item < (hi)) {                                      \
                    at(&s, &ahead, lo, NULL, 0, NULL);                                                 \
                    cursor_next(&s, per_group, inner, &ahead);                                         \
                }                                                                                      \
                at(&s, &cur, lo, out, out_stride, in);                                                 \
            }                                                                                          \
        }                                                                                              \
    } while (0)

/* Segment-major order, for steps of many short segments (each one token group or less) on several
 * threads: a thread takes a contiguous range of segments and, for each, runs its shrink items and then
 * its expand items, each pass's items in their usual order. Its segments' rows of t are its own, so
 * no barrier is needed between the passes, and t stays in L1 between them. Each item's arithmetic is
 * that of the two-pass order: results do not change. The walk is (segment g, pass, sub-item as in
 * Cursor). */
typedef struct {
    int64_t g, pass, sub, q, r;
} SegWalk;

static inline void skip_empty(const Step *s, SegWalk *w, int64_t g1) {
    while (w->g < g1 && s->seg_lens[w->g] <= 0) ++w->g;
}

/* The next item of the walk (past segment g1 - 1, w->g is g1). */
static inline void walk_next(const Step *s, SegWalk *w, int64_t g1) {
    if (w->pass == 0) {
        if (++w->sub < s->num_slices * s->row_blocks) {
            if (++w->r == s->row_blocks) w->r = 0, ++w->q;
            return;
        }
        w->pass = 1, w->sub = 0;
        return;
    }
    if (++w->sub < s->num_chunks) return;
    w->pass = w->sub = w->q = w->r = 0;
    ++w->g;
    skip_empty(s, w, g1);
}

/* Segments [g0, g1) in segment-major order, each item after prefetching the item PREFETCH_AHEAD on
 * (a cursor of a single-group segment never has read_before, so its item number is not needed). */
static void run_segments(const Step *s, int64_t g0, int64_t g1, const void *x, int64_t x_stride, void *y,
                         int64_t y_stride, void *t) {
    SegWalk w = {g0, 0, 0, 0, 0};
    skip_empty(s, &w, g1);
    SegWalk ahead = w;
    for (int i = 0; i < PREFETCH_AHEAD && ahead.g < g1; ++i) walk_next(s, &ahead, g1);
    for (; w.g < g1; walk_next(s, &w, g1)) {
        if (ahead.g < g1) {
            const Cursor c = {0, ahead.g, s->seg_starts[ahead.g], s->seg_starts[ahead.g] + s->seg_lens[ahead.g],
                              ahead.sub, ahead.q, ahead.r};
            if (ahead.pass == 0) shrink_at(s, &c, 0, NULL, 0, NULL);
            else expand_at(s, &c, 0, NULL, 0, NULL);
            walk_next(s, &ahead, g1);
        }
        const Cursor c = {0, w.g, s->seg_starts[w.g], s->seg_starts[w.g] + s->seg_lens[w.g], w.sub, w.q, w.r};
        if (w.pass == 0) shrink_at(s, &c, 0, x, x_stride, t);
        else expand_at(s, &c, 0, y, y_stride, t);
    }
}

/* Whether lora_fused runs a step segment-major (see run_segments): many short segments, several threads. */
static inline int segment_major(int64_t max_len, int has_rank, int64_t num_threads, int64_t num_segs) {
    return max_len <= TOKEN_GROUP && has_rank && num_threads > 1 && num_segs >= SEG_MAJOR_MIN * num_threads;
}

/* The weights lora_fused(layer, step) reads, for the base product to fetch ahead of it
 * (gemm_linear_prefetch): out = {num_runs, runs per segment when the call splits segments among
 * num_threads threads (segment-major), else 0; then runs of (address, bytes per row, rows, row stride
 * in bytes)}: per segment and slice, A's rows and Bt's block of that slot (its rank's rows, its
 * slice's columns). Returns their bytes, or -1 (out[0] = 0) when they need more than max_runs runs. */
int64_t lora_weight_ranges(const int64_t *layer, const int64_t *step, int64_t *out, int64_t max_runs,
                           int num_threads) {
    const int64_t size = layer[0] == LORA_BF16 ? 2 : 4, in = layer[1], o = layer[2], max_rank = layer[5];
    const int64_t num_slices = layer[6], stacked = max_rank * num_slices;
    const int64_t *offsets = (const int64_t *)(intptr_t)layer[7];
    const int32_t *ranks = (const int32_t *)(intptr_t)layer[8];
    const int64_t *seg_slots = (const int64_t *)(intptr_t)step[1], *seg_lens = (const int64_t *)(intptr_t)step[3];
    int64_t n = 0, total = 0, max_len = 0, *run = out + 2;
    out[0] = out[1] = 0;
    for (int64_t g = 0; g < step[4]; ++g) {
        max_len = seg_lens[g] > max_len ? seg_lens[g] : max_len;
        if (seg_lens[g] <= 0) continue;
        if (n + 2 * num_slices > max_runs) return out[0] = 0, -1;
        const int64_t slot = seg_slots[g];
        for (int64_t q = 0; q < num_slices; ++q, n += 2, run += 8) {
            const int64_t rank = slice_rank(ranks, slot * num_slices + q, max_rank), row = slot * stacked + q * max_rank;
            const int64_t width = offsets[q + 1] - offsets[q];
            run[0] = layer[3] + size * row * in, run[1] = size * rank * in, run[2] = 1, run[3] = 0;
            run[4] = layer[4] + size * (row * o + offsets[q]), run[5] = size * width, run[6] = rank, run[7] = size * o;
            total += size * rank * (in + width);
        }
    }
    out[0] = n;
    out[1] = n == 2 * num_slices * step[4] && segment_major(max_len, max_rank > 0, num_threads, step[4])
                 ? 2 * num_slices : 0;
    return total;
}

/* Returns 0 on success, 1 when the scratch buffers cannot be allocated (nothing written then).
 * layer: {elem, in_features, out_features, a, bt, max_rank, num_slices, slice_offsets, ranks}, with
 * elem LORA_F32 or LORA_BF16 (the type of x, y, a and bt) and the last two pointers to int64 [n + 1]
 * and int32 [L, n]; step: {token_ids, seg_slots, seg_starts, seg_lens, num_segs, num_active, scales},
 * the first four pointers to int64 arrays, scales to float32 [num_active] (per active token in
 * token_ids order: t = scale * A x) or 0 when every scale is 1. Two arrays built once (per layer, per step) instead of 20
 * arguments per call: ctypes converts every argument of every call. The caller guarantees:
 * token_ids < rows of x and y, seg_slots < L, slice offsets increasing from 0 to out_features
 * (lora_cpu.py checks all three). */
int lora_fused(const int64_t *layer, const int64_t *step, const void *x, int64_t x_stride, void *y,
               int64_t y_stride, int num_threads) {
    const int elem = (int)layer[0];
    const int64_t in_features = layer[1], out_features = layer[2], max_rank = layer[5], num_slices = layer[6];
    const void *a = (const void *)(intptr_t)layer[3], *bt = (const void *)(intptr_t)layer[4];
    const int64_t *slice_offsets = (const int64_t *)(intptr_t)layer[7];
    const int32_t *ranks = (const int32_t *)(intptr_t)layer[8];
    const int64_t *token_ids = (const int64_t *)(intptr_t)step[0], *seg_slots = (const int64_t *)(intptr_t)step[1];
    const int64_t *seg_starts = (const int64_t *)(intptr_t)step[2], *seg_lens = (const int64_t *)(intptr_t)step[3];
    const int64_t num_segs = step[4], num_active = step[5];
    int64_t max_len = 0;
    for (int64_t g = 0; g < num_segs; ++g) max_len = seg_lens[g] > max_len ? seg_lens[g] : max_len;
    int64_t chunk = CHUNK; /* expand columns per item (see CHUNK) */
    if (elem == LORA_BF16 && max_len > TOKEN_GROUP && max_rank > 0) {
        chunk = LONG_BLOCK_BYTES / (2 * max_rank) / CHUNK * CHUNK;
        chunk = chunk < CHUNK ? CHUNK : (chunk > 4 * CHUNK ? 4 * CHUNK : chunk);
    }
    const int64_t num_chunks = slice_chunks(slice_offsets, num_slices, chunk, NULL);
    const int64_t stacked_rank = num_slices * max_rank, row_blocks = (max_rank + ROW_BLOCK - 1) / ROW_BLOCK;
    /* One line-aligned scratch: t first (sized for float elements, the larger kind; a thread's token
     * groups start on their own lines whenever a group's rows of t are a multiple of 64 bytes, as 8
     * tokens at rank 16 are in float32 or bf16), then the chunks, then both passes' seg_first. */
    const size_t t_bytes = (sizeof(float) * (size_t)(num_active > 0 ? num_active : 1) * (size_t)stacked_rank + 63) / 64 * 64;
    const size_t chunk_bytes = (sizeof(SliceChunk) * (size_t)num_chunks + 63) / 64 * 64;
    const size_t first_bytes = sizeof(int64_t) * (size_t)(2 * (num_segs + 2));
    char *scratch = (char *)scratch_get((t_bytes + chunk_bytes + first_bytes + 63) / 64 * 64);
    if (scratch == NULL) return 1;
    void *t = scratch;
    SliceChunk *chunks = (SliceChunk *)(scratch + t_bytes);
    int64_t *shrink_first = (int64_t *)(scratch + t_bytes + chunk_bytes), *expand_first = shrink_first + num_segs + 2;
    slice_chunks(slice_offsets, num_slices, chunk, chunks);
    first_items(seg_lens, num_segs, num_slices * row_blocks, shrink_first);
    first_items(seg_lens, num_segs, num_chunks, expand_first);
    const Step s = {elem, elem == LORA_BF16 ? 2 : 4, t_elem_size(elem), in_features, out_features, max_rank,
                    num_slices, stacked_rank, row_blocks, num_chunks, num_segs, (const char *)a, (const char *)bt,
                    ranks, token_ids, seg_slots, seg_starts, seg_lens, shrink_first, expand_first, chunks,
                    (const float *)(intptr_t)step[6]};

    /* Each thread takes a contiguous range of items, so it can prefetch the ones it does next. */
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t nth = omp_get_num_threads();
#else
        const int64_t nth = 1;
#endif
        /* Many short segments on several threads: segment-major, which was faster there; one thread
         * streams DRAM better in the two-pass order, so it keeps that (benchmarks/README.md). */
        if (segment_major(max_len, row_blocks > 0, nth, num_segs)) {
            int64_t g0, g1;
            thread_range(num_segs, &g0, &g1);
            run_segments(&s, g0, g1, x, x_stride, y, y_stride, t);
        } else {
            int64_t lo, hi;
            thread_range(shrink_first[num_segs], &lo, &hi);
            RUN_RANGE(shrink_at, shrink_first, num_slices * row_blocks, row_blocks, lo, hi, x, x_stride, t);
#pragma omp barrier
            thread_range(expand_first[num_segs], &lo, &hi);
            RUN_RANGE(expand_at, expand_first, num_chunks, num_chunks, lo, hi, y, y_stride, t);
        }
    }
    scratch_put(scratch);
    return 0;
}

/* dst[j] = scale * src[j * src_cs] (src NULL: 0) for j0 <= j < j1, in float32 then rounded for bf16. */
static void write_row(int elem, void *dst, const void *src, int64_t src_cs, int64_t j0, int64_t j1, float scale) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4;
    if (src == NULL) {
        memset((char *)dst + size * j0, 0, (size_t)(size * (j1 - j0)));
    } else if (elem == LORA_BF16) {
        bf16 *d = (bf16 *)dst;
        const bf16 *s = (const bf16 *)src;
        for (int64_t j = j0; j < j1; ++j) d[j] = f32_to_bf16(scale * bf16_to_f32(s[j * src_cs]));
    } else if (src_cs == 1) {
        float *d = (float *)dst;
        const float *s = (const float *)src;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j];
    } else {
        float *d = (float *)dst;
        const float *s = (const float *)src;
        for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j * src_cs];
    }
}

/* Slot writes of one adapter activation, in one call: for each record r of 8 int64 values
 *     (dst, dst_ld, src, src_row_stride, src_col_stride, rows, cols, elem)
 * set dst[i * dst_ld + j] = scales[r] * src[i * src_row_stride + j * src_col_stride] for i < rows,
 * j < cols, or 0 when src is NULL; dst and src are both of type `elem` (LORA_F32 or LORA_BF16),
 * strides in elements. A transposed source (B^T into the slot's [rank, out] rows) is read in column
 * blocks so each block of it stays in L1. Replaces ~3 torch ops per module. */
void lora_write_blocks(int64_t num_records, const int64_t *records, const float *scales, int num_threads) {
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t r = 0; r < num_records; ++r) {
        const int64_t *rec = records + 8 * r;
        const int elem = (int)rec[7];
        const int64_t size = elem == LORA_BF16 ? 2 : 4;
        char *dst = (char *)(intptr_t)rec[0];
        const char *src = (const char *)(intptr_t)rec[2];
        const int64_t dst_ld = rec[1], src_rs = rec[3], src_cs = rec[4], rows = rec[5], cols = rec[6];
        for (int64_t j0 = 0; j0 < cols; j0 += 64) {
            const int64_t j1 = j0 + 64 < cols ? j0 + 64 : cols;
            for (int64_t i = 0; i < rows; ++i)
                write_row(elem, dst + size * i * dst_ld, src == NULL ? NULL : src + size * i * src_rs, src_cs,
                          j0, j1, scales[r]);
        }
    }
}

/* The vector code paths compiled into this build (its -march=native decides): bit 0 AVX2 + FMA,
 * bit 1 AVX-512 F + BW + VL (bf16), bit 2 AVX512-BF16 dot products; 0 is the portable C alone. */
int lora_code_paths(void) {
    int paths = 0;
#ifdef LORA_AVX2
    paths |= 1;
#endif
#ifdef LORA_AVX512
    paths |= 2;
#ifdef __AVX512BF16__
    paths |= 4;
#endif
#endif
    return paths;
}
