/* lora_kernel.c's vector blocks: the shrink (rows of A against a token group, summed by transpose
 * trees) and the expand (rank rows of Bt into a token group's y) for each ISA level (AVX-512 with or
 * without AVX512-BF16, AVX2 + FMA, scalar), float32 and bf16. Included once, by lora_kernel.c. */

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
