/* The many-rows path of quant_kernel.c (from PANEL_MIN_ROWS rows of x: prefill, big decode batches):
 * a chunk of weight rows is unpacked once into panels of 8 rows interleaved 4 bytes at a time, then
 * every row of x runs an 8-rows-wide integer product over them. Included after quant_kernel_rows.h.
 *
 * Semantics: out[m][j] = sum over 32-blocks b (halves h for Q6_K, whose scales are per 16) of
 *   dx[m][b] * (s[j][b][h] * (u[j][b][h] . xq[m][b][h]) + a[j][b][h] * sum(xq[m][b][h]))
 * with u = q + off unsigned (off 8 for Q4_0, else 0; Q8_0 and Q6_K stay signed, |q| <= 32 for Q6_K, and
 * multiply as |q| times x with q's sign), a = add - off s (0 for Q8_0, Q6_K: their term is skipped),
 * and x quantized as the rows path quantizes it (per 32 for Q8_0 / Q4_0 / Q4_1, per 256 for the
 * K-quants: the same xq and d, in weight order), so the two paths differ only in float32 summation order.
 * Shape: a panel is, per 32-block, 256 bytes (step t of 8: weights 4t .. 4t + 3 of each of the 8 rows,
 * row-major) then floats s[8], a[8] (Q6_K: also the second half's s[8], a[8]).
 * Why this shape (llama.cpp's repack.cpp gemm, done per call): the rows path reloads x's bytes for every
 * weight row and folds each row's partial sums across lanes; here one broadcast of 4 x bytes feeds 8
 * weight rows, the lanes are the rows (no folding), and the byte products add up in int16 as far as they
 * cannot saturate (2 * max|q| * 127 per step: 8 steps for 4-bit quants, 4 for 5-bit and Q6_K's signed
 * ones, 1 for Q8_0) before one vpmaddwd widens them. Unpacking once per chunk costs about one x row's
 * products, so few rows keep the rows path. Also here: run_panel_chunk and panel_layout, quant_kernel.c's
 * entry points into this path (included after its store_chunk). */
#ifndef LORASERVE_QUANT_KERNEL_PANEL_H
#define LORASERVE_QUANT_KERNEL_PANEL_H

#if QK_PATH > 0
#define PANEL 8           /* weight rows per panel: one int32 lane each */
#ifndef PANEL_MR
#define PANEL_MR 4 /* x rows per pass over a panel (their accumulators stay in registers; at most 6) */
#endif

static inline int panel_split(int type) { return type == 5; }
static inline int64_t panel_block_bytes(int type) { return 256 + (panel_split(type) ? 128 : 64); }
static inline int panel_offset(int type) { return type == 7 ? 8 : 0; }
/* Whether the panel keeps the quants signed (Q8_0, Q6_K: products as |w| times x with w's sign). */
static inline int panel_signed(int type) { return type == 6 || type == 5; }
/* Steps whose int16 byte-pair sums may add before widening: 2 * max|w| * 127 * steps <= 32767. */
static inline int panel_steps16(int type) { return type == 6 ? 1 : (type == 5 || type == 4 ? 4 : 8); }

/* v[r] (8 int32 lanes each) transposed: v[t] lane r becomes v[r] lane t. */
static inline __attribute__((always_inline)) void transpose8_epi32(__m256i *v) {
    __m256i t[8], s[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x20), v[i + 4] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x31);
}

/* The scales of blocks b .. b + 7 (b a multiple of 8) of a row, lane i block b + i: s0 / s1 of its two
 * halves and its additive term, the values block_info gives (the same float operations). */
static inline __attribute__((always_inline)) void scales8(int type, const uint8_t *row, int64_t nb, int64_t b,
                                                          __m256 *s0, __m256 *s1, __m256 *add) {
    if (type >= 6) {
        *s0 = *s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * b)));
        *add = type == 8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * nb + 2 * b))) : _mm256_setzero_ps();
        return;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    if (type == 5) { /* 16 int8 scales, one per 16 weights: even ones the first halves */
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 192)),
                                            _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(f16_to_f32(p + 208));
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        *add = _mm256_setzero_ps();
        return;
    }
    uint64_t sc, mn;
    k_scales_mins(p + 4, &sc, &mn);
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc)));
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn)));
    *s0 = *s1 = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(p)), scf);
    *add = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(p + 2)), mnf));
}

/* The float fields of blocks b .. b + 7 of rows [n0, n0 + 8) (rows from n on: zeros) into their places
 * in the panel at out: s0, a0 (and s1, a1 for the split formats), a = add - off * s. */
static inline __attribute__((always_inline)) void pack_scales8(int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                                                               int64_t n0, int64_t nb, int64_t b, uint8_t *out) {
    const int64_t bb = panel_block_bytes(type);
    const __m256 off = _mm256_set1_ps((float)panel_offset(type));
    __m256i f[4][PANEL]; /* s0, a0, s1, a1 by row */
    for (int r = 0; r < PANEL; r++) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, add = s0;
        if (n0 + r < n) scales8(type, w + (n0 + r) * row_bytes, nb, b, &s0, &s1, &add);
        f[0][r] = _mm256_castps_si256(s0), f[2][r] = _mm256_castps_si256(s1);
        f[1][r] = _mm256_castps_si256(_mm256_sub_ps(add, _mm256_mul_ps(off, s0)));
        f[3][r] = _mm256_castps_si256(_mm256_sub_ps(add, _mm256_mul_ps(off, s1)));
    }
    for (int g = 0; g < (panel_split(type) ? 4 : 2); g++) {
        transpose8_epi32(f[g]);
        for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(out + (b + i) * bb + 256 + 32 * g), f[g][i]);
    }
}

/* Weight rows [n0, n0 + 8) of w (rows from n on: zeros) as a panel at `out`. */
static inline __attribute__((always_inline)) void pack_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                                                             int64_t n0, int64_t k, uint8_t *out) {
    const int64_t nb = k / 32, bb = panel_block_bytes(type);
    const float off = (float)panel_offset(type);
    const __m256i off8 = _mm256_set1_epi8((char)panel_offset(type));
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = out + b * bb;
        float *f = (float *)(o + 256);
        const int scalar_scales = b >= nb / 8 * 8; /* a tail of fewer than 8 blocks */
        if (b % 8 == 0 && !scalar_scales) pack_scales8(type, w, row_bytes, n, n0, nb, b, out);
        __m256i v[PANEL];
        for (int r = 0; r < PANEL; r++) {
            if (n0 + r >= n) {
                v[r] = _mm256_setzero_si256();
                for (int i = 0; i < (panel_split(type) ? 4 : 2) && scalar_scales; i++) f[8 * i + r] = 0.0f;
                continue;
            }
            const uint8_t *row = w + (n0 + r) * row_bytes;
            v[r] = _mm256_add_epi8(unpack_vec(type, row, nb, b), off8);
            if (!scalar_scales) continue;
            blockinfo bi;
            block_info(type, row, nb, b, &bi);
            f[r] = bi.s0, f[8 + r] = bi.add - off * bi.s0;
            if (panel_split(type)) f[16 + r] = bi.s1, f[24 + r] = bi.add - off * bi.s1;
        }
        transpose8_epi32(v);
        for (int t = 0; t < 8; t++) _mm256_storeu_si256((__m256i *)(o + 32 * t), v[t]);
    }
}

/* The int32 sums, lane j = panel row j, of steps [t0, t1) of a block against x rows' 4-byte broadcasts
 * (xb: the block's 32 bytes of each x row) added to s32. */
static inline __attribute__((always_inline)) void panel_steps(int type, const uint8_t *pq, const int8_t *const *xb,
                                                              int mr, int t0, int t1, __m256i *s32) {
    const int steps16 = panel_steps16(type);
    for (int t = t0; t < t1; t += steps16) {
        __m256i s16[PANEL_MR];
        for (int i = 0; i < PANEL_MR; i++) s16[i] = _mm256_setzero_si256();
        for (int u = t; u < t + steps16; u++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(pq + 32 * u));
            const __m256i wa = panel_signed(type) ? _mm256_abs_epi8(w) : w;
            for (int i = 0; i < PANEL_MR; i++) {
                if (i >= mr) break;
                int32_t word;
                memcpy(&word, xb[i] + 4 * u, 4);
                __m256i x = _mm256_set1_epi32(word);
                if (panel_signed(type)) x = _mm256_sign_epi8(x, w);
#if QK_PATH == 2
                s32[i] = _mm256_dpbusd_epi32(s32[i], wa, x);
#else
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(wa, x));
                /* each row's sum in a register here: keeps GCC from hoisting every step's products
                 * ahead of their sums (32 live vectors, spilled) */
                __asm__("" : "+x"(s16[i]));
#endif
            }
        }
#if QK_PATH != 2
        for (int i = 0; i < PANEL_MR; i++) {
            if (i >= mr) break;
            s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
        }
#else
        (void)s16;
#endif
    }
}

/* out[i * ld + j] = panel row j . x row r0 + i for i < mr (<= PANEL_MR), as the header's semantics. */
static inline __attribute__((always_inline)) void panel_dot(int type, const uint8_t *panel, const px_t *px, int64_t r0,
                                                            int mr, float *out, int64_t ld) {
    const int64_t nb = px->nb, bb = panel_block_bytes(type);
    const int halves = panel_split(type) ? 2 : 1;
    __m256 acc[PANEL_MR];
    for (int i = 0; i < PANEL_MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pq = panel + b * bb;
        const int8_t *xb[PANEL_MR];
        for (int i = 0; i < PANEL_MR; i++) xb[i] = px->xq + (r0 + (i < mr ? i : 0)) * px->k + b * 32;
        for (int h = 0; h < halves; h++) {
            __m256i s32[PANEL_MR];
            for (int i = 0; i < PANEL_MR; i++) s32[i] = _mm256_setzero_si256();
            panel_steps(type, pq, xb, mr, 8 / halves * h, 8 / halves * (h + 1), s32);
            const float *f = (const float *)(pq + 256) + 16 * h;
            const __m256 s = _mm256_loadu_ps(f), a = _mm256_loadu_ps(f + 8);
            for (int i = 0; i < PANEL_MR; i++) {
                if (i >= mr) break;
                const int64_t at = (r0 + i) * nb + b;
                const float xsum = halves == 2 ? px->xs16[2 * at + h] : px->xs[at];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(s, _mm256_set1_ps(px->dx[at])), acc[i]);
                if (!panel_signed(type)) acc[i] = _mm256_fmadd_ps(a, _mm256_set1_ps(xsum), acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * ld, acc[i]);
}

/* Rows [r_lo, r_hi) of x against the chunk's panels (`count` of them, `bytes` apart) into acc
 * ([r_hi - r_lo][N_CHUNK]); mr is a constant after inlining (the switch in panel_chunk). */
static inline __attribute__((always_inline)) void panel_pass(int type, const uint8_t *panels, int64_t bytes, int count,
                                                             const px_t *px, int64_t r0, int mr, float *acc) {
    for (int p = 0; p < count; p++) panel_dot(type, panels + p * bytes, px, r0, mr, acc + p * PANEL, N_CHUNK);
}

/* Weight rows [n0, n1) (at most N_CHUNK) packed into `panels`, then x rows [r_lo, r_hi) against them. */
static inline __attribute__((always_inline)) void panel_chunk(int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                                                              int64_t n0, int64_t n1, const px_t *px, int64_t r_lo,
                                                              int64_t r_hi, uint8_t *panels, float *acc) {
    const int64_t bytes = px->nb * panel_block_bytes(type);
    const int count = (int)((n1 - n0 + PANEL - 1) / PANEL);
    for (int p = 0; p < count; p++) pack_panel(type, w, row_bytes, n, n0 + p * PANEL, px->k, panels + p * bytes);
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += PANEL_MR) {
        float *a = acc + (r0 - r_lo) * N_CHUNK;
        const int mr = r_hi - r0 < PANEL_MR ? (int)(r_hi - r0) : PANEL_MR;
        if (mr == PANEL_MR) panel_pass(type, panels, bytes, count, px, r0, PANEL_MR, a);
        else if (mr == 1) panel_pass(type, panels, bytes, count, px, r0, 1, a);
        else if (mr == 2) panel_pass(type, panels, bytes, count, px, r0, 2, a);
        else if (mr == 3) panel_pass(type, panels, bytes, count, px, r0, 3, a);
        else if (mr == 4) panel_pass(type, panels, bytes, count, px, r0, 4, a);
#if PANEL_MR > 5
        else panel_pass(type, panels, bytes, count, px, r0, 5, a); /* PANEL_MR <= 6 */
#endif
    }
}

/* run_chunk's panel path: the chunk's rows packed into `panels` (the thread's scratch), x from px32 (the
 * 32-block formats) or px256 (the K-quants). */
static void run_panel_chunk(const int64_t *w, int64_t c, const px_t *px32, const px_t *px256, int x_bf16,
                            const void *bias, void *y, int64_t ldy, int64_t r_lo, int64_t r_hi, uint8_t *panels,
                            float *acc) {
    const chunk_t ch = chunk_of(w, c);
    const uint8_t *wp = ch.wp;
    const int64_t n = ch.n, row_bytes = ch.row_bytes, n0 = ch.n0, n1 = ch.n1;
    const int type = ch.type;
    switch (type) {
    case 3: panel_chunk(3, wp, row_bytes, n, n0, n1, px256, r_lo, r_hi, panels, acc); break;
    case 4: panel_chunk(4, wp, row_bytes, n, n0, n1, px256, r_lo, r_hi, panels, acc); break;
    case 5: panel_chunk(5, wp, row_bytes, n, n0, n1, px256, r_lo, r_hi, panels, acc); break;
    case 6: panel_chunk(6, wp, row_bytes, n, n0, n1, px32, r_lo, r_hi, panels, acc); break;
    case 7: panel_chunk(7, wp, row_bytes, n, n0, n1, px32, r_lo, r_hi, panels, acc); break;
    default: panel_chunk(8, wp, row_bytes, n, n0, n1, px32, r_lo, r_hi, panels, acc); break;
    }
    store_chunk(acc, x_bf16, bias, y, ldy, n0, n1, r_lo, r_hi);
}

/* The bytes a thread's panels take for these parts (the widest part's). */
static int64_t panel_bytes_of(const int64_t *w, int64_t parts) {
    int64_t most = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t bytes = N_CHUNK / PANEL * (w[2] / 32) * panel_block_bytes((int)w[4 * p + 3]);
        most = bytes > most ? bytes : most;
    }
    return most;
}

#endif

#endif
