/* Vector helpers of the attention kernel on top of simd.h and its dot products on raw rows: transposing
 * sum trees, the bf16 pair order, tanh, q.k for a tile of W keys (float32, bf16, four keys transposed
 * per 128-bit lane, tiles transposed once) and the kernel's block constants.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_DOTS_H
#define PAGED_ATTENTION_DOTS_H

/* The attention-only vector helpers on top of simd.h: transposing sum trees and the bf16 pair order. */
#if W == 16
/* 128-bit lane g = the sum of c[g]'s four 128-bit lanes. */
static inline vf vsum_quarters(const vf *c) {
    vf d[2];
    for (int i = 0; i < 2; ++i)
        d[i] = vadd(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                    _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return vadd(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
/* Lane j = the sum of a[j]'s lanes: a transposing tree, ~3 instructions per key instead of ~8. */
static inline vf vsum_keys(const vf *a) {
    vf b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        c[i] = vadd(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return vsum_quarters(c);
}
#if defined(__AVX512BF16__)
#define NATIVE_BF16_DOT 1
#if defined(__AVX512VNNI__)
#define NATIVE_I16_DOT 1 /* int16 pair dot products (vpdpwssd): an int8 cache's scores and value sums */
#endif
#endif
/* (even elements, odd elements) of vload_pair_bf16 back to (first W, next W). */
static inline void vinterleave(vf *a, vf *b) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const vf x = _mm512_permutex2var_ps(*a, lo, *b), y = _mm512_permutex2var_ps(*a, hi, *b);
    *a = x, *b = y;
}
#elif W == 8
static inline vf vsum_keys(const vf *a) {
    vf b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = vadd(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        c[i] = vadd(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return vadd(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
static inline void vinterleave(vf *a, vf *b) {
    const vf lo = _mm256_unpacklo_ps(*a, *b), hi = _mm256_unpackhi_ps(*a, *b);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20), *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}
#else /* portable C: one key per tile */
static inline vf vsum_keys(const vf *a) { return a[0]; }
static inline void vinterleave(vf *a, vf *b) { (void)a, (void)b; }
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#define MAX_ROWS 32   /* query rows (queries x heads of a group) per work item: their accumulators stay in L1 */
#define MIN_PART 256  /* shortest key partition worth a merge */
#define TRANSPOSE_ROWS 8 /* rows from which a tile's keys are transposed once rather than summed per row */
#define SCORE_PREFETCH ((W + 1) / 2) /* next block's keys requested per tile scored (the rest while the values are summed) */
#ifndef PV_COLS /* columns of a row's accumulator held in registers while the values are summed */
#define PV_COLS (W == 16 ? 4 * W : 2 * W)
#endif
#define KEY_BLOCK 128 /* keys scored before their softmax and values: one max, one rescale per row and block */

/* tanh x (Cephes): an odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign;
 * ~1 ulp, so a softcap multiplies no cancellation error into the scores. */
static inline vf vtanh(vf x) {
    const vf a = vabs(x), z = vmul(x, x);
    vf p = vset1(-5.70498872745e-3f);
    p = vfma(p, z, vset1(2.06390887954e-2f));
    p = vfma(p, z, vset1(-5.37397155531e-2f));
    p = vfma(p, z, vset1(1.33314422036e-1f));
    p = vfma(p, z, vset1(-3.33332819422e-1f));
    const vf small = vfma(vmul(p, z), x, x);
    const vf large = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(vexp(vadd(a, a)), vset1(1.0f))));
    const vf signed_large = vselect(vless(x, vzero()), vsub(vzero(), large), large);
    return vselect(vless(a, vset1(0.625f)), small, signed_large);
}

/* Lane j = q . k[j] over d float32 values, for the W keys of a tile. */
static inline vf qk_f32(const float *q, const float *const *k, int64_t d) {
    vf acc[W];
    for (int j = 0; j < W; ++j) acc[j] = vzero();
    for (int64_t i = 0; i < d; i += W) {
        const vf qv = vload(q + i, d - i);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) acc[j] = vfma(qv, vload(k[j] + i, d - i), acc[j]);
    }
    return vsum_keys(acc);
}

#ifdef NATIVE_BF16_DOT
/* The same for bf16 q and keys: 32 products per instruction, exact, summed in float32. */
static inline vf qk_bf16(const uint16_t *q, const uint16_t *const *k, int64_t d) {
    vf acc[W];
    for (int j = 0; j < W; ++j) acc[j] = vzero();
    for (int64_t i = 0; i < d; i += 32) {
        const __mmask32 m = mask32_first(d - i);
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + i);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + i));
    }
    return vsum_keys(acc);
}

/* Query pairs for qk_quads: qt[c * 4 + t] lane 4L + i = pair 16c + 4L + t of q (d bf16 values),
 * the same for every i: each 128-bit lane broadcasts its own t-th pair. */
static void quad_queries(const uint16_t *q, int64_t d, __m512i *qt) {
    for (int64_t c = 0; 32 * c < d; ++c) {
        const int64_t n = d - 32 * c;
        const __mmask32 m = mask32_first(n);
        const __m512i x = _mm512_maskz_loadu_epi16(m, q + 32 * c);
        qt[4 * c] = _mm512_shuffle_epi32(x, 0x00), qt[4 * c + 1] = _mm512_shuffle_epi32(x, 0x55);
        qt[4 * c + 2] = _mm512_shuffle_epi32(x, 0xAA), qt[4 * c + 3] = _mm512_shuffle_epi32(x, 0xFF);
    }
}

/* 32 sign-magnitude bytes at p (those of mask m; 0 past them) as words: the magnitude (7 bits) through
 * a 128-word table held in four vectors (tab: two 64-entry word permutes, bit 6 picks one), the sign on
 * top as bit 15. Seven instructions: fp8 bytes as bf16 through fp8_bf16_table, where widening to float32
 * through float16 and rounding to bf16 took about sixteen. */
static inline __m512i sign_magnitude_words(const uint8_t *p, __mmask32 m, const __m512i *tab) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p));
    const __m512i low = _mm512_permutex2var_epi16(tab[0], x, tab[1]), high = _mm512_permutex2var_epi16(tab[2], x, tab[3]);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), low, high);
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* a | (b & c) */
}

/* t[e] lane 4L + i = dword 4L + e of chunk c (32 elements, those of mask m real) of key j + i, for
 * the four keys k[j..j + 4): bf16, or 8-bit rows k8, widened to int16 (int8, i16) or read through the
 * table tab (fp8 as bf16: sign_magnitude_words). */
__attribute__((always_inline)) static inline void quad_keys(const uint16_t *const *k, const uint8_t *const *k8,
                                                            int j, int64_t c, __mmask32 m, int i16,
                                                            const __m512i *tab, __m512i *t) {
    __m512i x[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
        x[i] = i16 ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, k8[j + i] + 32 * c))
               : tab != NULL ? sign_magnitude_words(k8[j + i] + 32 * c, m, tab)
                             : _mm512_maskz_loadu_epi16(m, k[j + i] + 32 * c);
    const __m512i a0 = _mm512_unpacklo_epi32(x[0], x[1]), a1 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(x[2], x[3]), a3 = _mm512_unpackhi_epi32(x[2], x[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2), t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3), t[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* acc + the pair products of x and y: bf16 pairs summed in float32, or (i16) int16 pairs in int32. */
__attribute__((always_inline)) static inline vf pair_dot(vf acc, __m512i x, __m512i y, int i16) {
#ifdef NATIVE_I16_DOT
    if (i16) return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), x, y));
#endif
    (void)i16;
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}

#ifndef QK_GROUPS
#define QK_GROUPS 2 /* groups of four keys transposed per pass: each query vector loaded once per pass */
#endif

/* out[r] lane j = q_r . k[j] for nr (<= 4, a constant at each call site) rows of quad_queries (qt_stride
 * vectors apart). Four keys at a time are transposed within each 128-bit lane (8 shuffles per 32 pairs,
 * shared by the rows), so a row's dot products leave only the four 128-bit lanes to sum: ~45 shuffles
 * and adds per row and tile become 9, for 16 shuffles per four keys. With i16 (a constant) the keys
 * are int8 rows k8, widened to int16 as they load, and the rows are int16 (quad_queries_i16): the
 * int16 pair products sum exactly in int32, and out[r] is that sum as float32 (times nothing: the
 * caller applies the row's scale). With tab, the keys are fp8 rows k8 read as bf16 through it. */
__attribute__((always_inline)) static inline void qk_quads(const __m512i *qt, int64_t qt_stride, int nr,
                                                           const uint16_t *const *k, const uint8_t *const *k8,
                                                           int64_t d, int i16, const __m512i *tab, vf *out) {
    vf acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) acc[r][g] = vzero();
#pragma GCC unroll 4
    for (int g0 = 0; g0 < 4; g0 += QK_GROUPS)
        for (int64_t c = 0; 32 * c < d; ++c) {
            const __mmask32 m = mask32_first(d - 32 * c);
            __m512i t[QK_GROUPS][4];
#pragma GCC unroll 4
            for (int g = 0; g < QK_GROUPS; ++g)
                quad_keys(k, k8, 4 * (g0 + g), c, m, i16, tab, t[g]);
#pragma GCC unroll 4
            for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
                for (int e = 0; e < 4; ++e) {
                    const __m512i q = qt[r * qt_stride + 4 * c + e];
#pragma GCC unroll 4
                    for (int g = 0; g < QK_GROUPS; ++g) acc[r][g0 + g] = pair_dot(acc[r][g0 + g], t[g][e], q, i16);
                }
        }
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r) {
        if (i16) /* each lane's int32 sum as float32 (exact below 2^24; beyond, one rounding of 2^-24) */
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_cvtepi32_ps(_mm512_castps_si512(acc[r][g]));
        out[r] = vsum_quarters(acc[r]);
    }
}

#ifdef NATIVE_I16_DOT
/* quad_queries of bf16 row q (d values) rounded to int16 at a power-of-two scale: the largest |q|
 * times 2^s below 2^15, so every product with an int8 key is exact and a row's error is at most its
 * largest value times 2^-16. qt[quad_stride(d) - 1] lane 0 holds 2^-s (the scale the sums take). */
static void quad_queries_i16(const uint16_t *q, int64_t d, __m512i *qt, int64_t qt_stride) {
    vf amax = vzero();
    for (int64_t i = 0; i < d; i += W) amax = vmax(amax, vabs(vload_bf16(q + i, d - i)));
    int e = 0;
    (void)frexpf(vhmax(amax), &e); /* largest |q| < 2^e */
    const vf up = vset1(ldexpf(1.0f, 15 - e));
    uint16_t row[128]; /* d <= 128 on the quad paths (paged_attention allocates qt for them only) */
    for (int64_t i = 0; i < d; i += W) {
        const __m512i x = _mm512_min_epi32(_mm512_cvtps_epi32(vmul(vload_bf16(q + i, d - i), up)), _mm512_set1_epi32(32767));
        _mm256_mask_storeu_epi16(row + i, (__mmask16)mask16_first(d - i), _mm512_cvtepi32_epi16(x));
    }
    quad_queries(row, d, qt);
    /* a q with inf or NaN scores NaN, as the float paths do, not the integers its conversion gave */
    qt[qt_stride - 1] = _mm512_castps_si512(vset1(isfinite(vhmax(amax)) ? ldexpf(1.0f, e - 15) : NAN));
}
#endif

/* r[p] = column p of the 16 x 16 dword matrix with rows r[0..16): unpacks build 4 x 4 blocks within
 * each 128-bit lane, two rounds of 128-bit lane shuffles move the blocks. */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i)
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
        r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[4 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD), r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* kt[p * W + j] = elements 2p and 2p + 1 of key j (0 past d), p < ceil(d / 2): the tile's keys
 * across the lanes, so that a row's scores need no horizontal sums. */
static void transpose_keys(const uint16_t *const *k, int64_t d, uint32_t *kt) {
    const int64_t pairs = (d + 1) / 2;
    for (int64_t c = 0; c < pairs; c += 16) {
        const int64_t n = d - 2 * c;
        const __mmask32 m = mask32_first(n);
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_epi16(m, k[j] + 2 * c);
        transpose16(r);
        for (int64_t p = 0; p < min64(16, pairs - c); ++p) _mm512_storeu_si512(kt + (c + p) * 16, r[p]);
    }
}

/* out[r * 2 + t] lane j = row r's q . key j of tile t for the nr rows of q (bf16, q_stride apart,
 * zero-padded to an even length) against the transposed tiles (tile t at kt + t * pairs * W); each
 * query pair is broadcast once for both tiles. nr and tiles are constants at each call site. */
__attribute__((always_inline)) static inline void qk_transposed(const uint32_t *kt, int64_t pairs, const uint16_t *q,
                                                                int64_t q_stride, int nr, int tiles, vf *out) {
    vf acc[8][2];
    for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 16);
        const __m512bh k1 = tiles > 1 ? (__m512bh)_mm512_loadu_si512(kt + (pairs + p) * 16) : k0;
        for (int r = 0; r < nr; ++r) {
            uint32_t qp;
            memcpy(&qp, q + r * q_stride + 2 * p, sizeof qp);
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qv);
            if (tiles > 1) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qv);
        }
    }
    for (int r = 0; r < nr; ++r) out[2 * r] = acc[r][0], out[2 * r + 1] = acc[r][1];
}
#endif

/* dst row j (d floats) = bf16 row src[j], for the W rows of a tile. */
static inline void rows_to_f32(float *dst, const uint16_t *const *src, const float **rows, int64_t d) {
    for (int j = 0; j < W; ++j) {
        for (int64_t i = 0; i < d; i += W) vstore(dst + j * d + i, vload_bf16(src[j] + i, d - i), d - i);
        rows[j] = dst + j * d;
    }
}

#endif /* PAGED_ATTENTION_DOTS_H */
