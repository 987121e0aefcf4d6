/* The value sums through pair dot products: the probabilities paired by key (rounded to bf16, or to
 * int16 at a power-of-two scale per row for an int8 cache) and pv_rows_dot, which sums two keys' V rows
 * per instruction (bf16 rows as they lie, fp8 rows read as bf16 through a table, int8 rows widened).
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the
 * earlier ones define. */
#ifndef PAGED_ATTENTION_PAIRS_H
#define PAGED_ATTENTION_PAIRS_H

#ifdef NATIVE_BF16_DOT
/* The bf16 route of pv_rows: the probabilities rounded to bf16 (as the twin's probs.to(v.dtype) are),
 * paired by key (pb dword j / 2 = keys j, j + 1; rows KEY_BLOCK / 2 apart), the V rows of two keys
 * interleaved by 16-bit unpacks, and one pair dot product per 16 lanes: no widening, half the
 * multiply-adds. Keys from j0 rounded down to even to j1 (a key past nk reads key j's row, with
 * probability 0). The unpacks leave each 32-column chunk as columns 8k..8k+3 then 8k+4..8k+7 per
 * 128-bit lane; two permutes per chunk and row put them back. V rows of an fp8 cache (tab: its
 * fp8_bf16_table vectors, else NULL) are decoded to bf16 as they load. With i16 (a constant) the V rows
 * are int8, widened to int16 as they load, pb holds int16 probabilities (pair_probabilities_i16) and
 * the int16 pair products sum exactly in int32; row r's sums are then times ps[r], its scale. */
__attribute__((always_inline)) static inline void pv_rows_dot(float *acc, int64_t d, const uint32_t *pb, int nr,
                                                              const void *v_cache, const int64_t *offsets,
                                                              int64_t nk, int64_t j0, int64_t j1, int i16,
                                                              const float *ps, const __m512i *tab) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int64_t esize = i16 || tab != NULL ? 1 : 2;
    for (int64_t i = 0; i < d; i += 64) {
        const int64_t n = d - i;
        vf sum[4][4];
#pragma GCC unroll 16
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) sum[r][c] = vzero();
        for (int64_t j = j0 & ~(int64_t)1; j < j1; j += 2) {
            const char *va = (const char *)v_cache + (offsets[j] + i) * esize;
            const char *vb = (const char *)v_cache + (offsets[j + 1 < nk ? j + 1 : j] + i) * esize;
            __m512i x[4];
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                const int64_t left = n - 32 * c;
                const __mmask32 m = mask32_first(left);
                __m512i ka, kb;
                if (i16) {
                    ka = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, va + 32 * c));
                    kb = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, vb + 32 * c));
                } else if (tab != NULL) {
                    ka = sign_magnitude_words((const uint8_t *)va + 32 * c, m, tab);
                    kb = sign_magnitude_words((const uint8_t *)vb + 32 * c, m, tab);
                } else {
                    ka = _mm512_maskz_loadu_epi16(m, va + 64 * c), kb = _mm512_maskz_loadu_epi16(m, vb + 64 * c);
                }
                x[2 * c] = _mm512_unpacklo_epi16(ka, kb), x[2 * c + 1] = _mm512_unpackhi_epi16(ka, kb);
            }
#pragma GCC unroll 4
            for (int r = 0; r < nr; ++r) {
                const __m512i pr = _mm512_set1_epi32((int)pb[r * (KEY_BLOCK / 2) + j / 2]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {
#ifdef NATIVE_I16_DOT
                    if (i16) {
                        sum[r][c] = _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(sum[r][c]), x[c], pr));
                        continue;
                    }
#endif
                    sum[r][c] = _mm512_dpbf16_ps(sum[r][c], (__m512bh)x[c], (__m512bh)pr);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r)
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                float *row = acc + r * d + i + 32 * c;
                const int64_t left = n - 32 * c;
                vf lo = _mm512_permutex2var_ps(sum[r][2 * c], first, sum[r][2 * c + 1]);
                vf hi = _mm512_permutex2var_ps(sum[r][2 * c], second, sum[r][2 * c + 1]);
                if (i16) {
                    const vf scale = vset1(ps[r]);
                    lo = vmul(_mm512_cvtepi32_ps(_mm512_castps_si512(lo)), scale);
                    hi = vmul(_mm512_cvtepi32_ps(_mm512_castps_si512(hi)), scale);
                }
                vstore(row, vadd(vload(row, left), lo), left);
                vstore(row + W, vadd(vload(row + W, left - W), hi), left - W);
            }
    }
}

/* pb row r = row r of p (n lanes, a multiple of W) rounded to bf16, in key pairs. */
static void pair_probabilities(const float *p, int64_t rows, int64_t n, uint32_t *pb) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; j += 2 * W) {
            const float *pr = p + r * KEY_BLOCK + j;
            uint32_t *dst = pb + r * (KEY_BLOCK / 2) + j / 2;
            if (n - j >= 2 * W) _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(vload(pr + W, W), vload(pr, W)));
            else _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(vload(pr, W)));
        }
}
#endif

#ifdef NATIVE_I16_DOT
/* pb row r = row r of p (n lanes, a multiple of W; probabilities, >= 0) rounded to int16 at a
 * power-of-two scale, its largest value times 2^s below 2^15, in key pairs; ps[r] = 2^-s. A row's
 * error is at most its largest probability in the block times 2^-16, and a V row's sum of 128 keys'
 * products (each below 2^22) stays in int32. */
static void pair_probabilities_i16(const float *p, int64_t rows, int64_t n, uint32_t *pb, float *ps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *pr = p + r * KEY_BLOCK;
        vf mx = vzero();
        for (int64_t j = 0; j < n; j += W) mx = vmax(mx, vload(pr + j, W));
        int e = 0;
        (void)frexpf(vhmax(mx), &e);
        const vf up = vset1(ldexpf(1.0f, 15 - e));
        int16_t *dst = (int16_t *)(pb + r * (KEY_BLOCK / 2));
        for (int64_t j = 0; j < n; j += W) {
            const __m512i x = _mm512_min_epi32(_mm512_cvtps_epi32(vmul(vload(pr + j, W), up)), _mm512_set1_epi32(32767));
            _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtepi32_epi16(x));
        }
        ps[r] = isfinite(vhmax(mx)) ? ldexpf(1.0f, e - 15) : NAN; /* NaN probabilities stay NaN */
    }
}
#endif

/* The probabilities of `rows` rows (n lanes) paired for the value sums' pair dot products, if they take
 * them: rounded to bf16 (a bf16 or fp8 cache) or to int16 (an int8 cache). */
static inline void pair_for_dots(const Args *a, const float *p, int64_t rows, int64_t n, uint32_t *pb, float *ps) {
#ifdef NATIVE_BF16_DOT
    if (a->bf16_dot || a->fp8_tab != NULL) pair_probabilities(p, rows, n, pb);
#endif
#ifdef NATIVE_I16_DOT
    if (a->i16_dot) pair_probabilities_i16(p, rows, n, pb, ps);
#endif
    (void)a, (void)p, (void)rows, (void)n, (void)pb, (void)ps;
}

#endif /* PAGED_ATTENTION_PAIRS_H */
