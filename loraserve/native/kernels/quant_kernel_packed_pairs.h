/* Q8_0 / Q4_0 / Q4_1 panels (quant_kernel_packed.h's layout) two at a time in 512-bit registers, on
 * AVX-512 VNNI builds: lanes 0-7 are panel p's rows, lanes 8-15 panel p + 1's (the chunk's two panels).
 *
 * Semantics and shape: packed_dot's for both panels at once (out[i * ld + j], j < 16: panel row j % 8 of
 * panel j / 8 . x row r0 + i). Every lane sums the same exact int32 dot and runs the same float operations
 * in the same order as packed_dot's lane, so its results are packed_dot's bit for bit, for any row count.
 * Why: one broadcast of 4 x bytes, one scale conversion and one float step of the epilogue each serve 16
 * weight rows instead of 8. A Zen 4 core runs a 512-bit vpdpbusd as two 256-bit halves, so the integer
 * products cost the same; what halves is every other instruction (the x broadcasts, the nibble unpacking,
 * the per-block float epilogue). In L2 on one Zen 4 thread (512 x 2048, G multiply-adds a second, 4 / 8 /
 * 16 rows): Q4_1 110 / 113 / 113 -> 131 / 137 / 139, Q8_0 102 / 110 / 120 -> 117 / 128 / 139 (the int8
 * peak: ~230). run_packed_chunk takes them for the passes over a chunk in cache only (see there). */
#ifndef LORASERVE_QUANT_KERNEL_PACKED_PAIRS_H
#define LORASERVE_QUANT_KERNEL_PACKED_PAIRS_H

#if QK_PATH == 2 && defined(__AVX512F__) && defined(__AVX512BW__) && !defined(PACKED_NO_PAIRS)
#define PACKED_PAIRS 1
#ifndef PAIRS_STREAM
#define PAIRS_STREAM 0 /* 1: the streaming pass in pairs too (run_packed_chunk) */
#endif

/* 32 bytes at p (panel p) and 32 at p + other (panel p + 1) as one register. */
static inline __m512i pair_load(const uint8_t *p, int64_t other) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + other)), 1);
}

/* 8 float16 at p and 8 at p + other, as 16 floats. */
static inline __m512 pair_halves(const uint8_t *p, int64_t other) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + other)), 1));
}

/* The int32 block dots of both panels' block at pq (the second `other` bytes on) against mr rows of x
 * (xb), in `split` chains per row as packed_steps (a vpdpbusd waits for its accumulator). */
static inline __attribute__((always_inline)) void pair_steps(int type, const uint8_t *pq, int64_t other,
                                                             const int8_t *const *xb, int mr, __m512i *s32) {
    const int split = PACKED_SPLIT;
    __m512i part[PACKED_MR][4];
    for (int i = 0; i < mr; i++) {
        part[i][0] = s32[i];
        for (int h = 1; h < split; h++) part[i][h] = _mm512_setzero_si512();
    }
    if (type == 9) { /* w + 128 unsigned, s32 entering as -128 sum(x) (packed_dot's) */
        for (int t = 0; t < 8; t++) {
            const __m512i wu = _mm512_xor_si512(pair_load(pq + 32 * t, other), _mm512_set1_epi8(-128));
            for (int i = 0; i < mr; i++) {
                int32_t word;
                memcpy(&word, xb[i] + 4 * t, 4);
                part[i][t % split] = _mm512_dpbusd_epi32(part[i][t % split], wu, _mm512_set1_epi32(word));
            }
        }
    } else {
        const __m512i low4 = _mm512_set1_epi8(15);
        for (int t = 0; t < 4; t++) {
            const __m512i v = pair_load(pq + 32 * t, other);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int i = 0; i < mr; i++) {
                int32_t wl, wh;
                memcpy(&wl, xb[i] + 4 * t, 4), memcpy(&wh, xb[i] + 16 + 4 * t, 4);
                const int a = (2 * t) % split, b = (2 * t + 1) % split;
                part[i][a] = _mm512_dpbusd_epi32(part[i][a], lo, _mm512_set1_epi32(wl));
                part[i][b] = _mm512_dpbusd_epi32(part[i][b], hi, _mm512_set1_epi32(wh));
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        for (int h = 1; h < split; h++) part[i][0] = _mm512_add_epi32(part[i][0], part[i][h]);
        s32[i] = part[i][0];
    }
}

/* packed_dot over the panels at panel and panel + other together: 16 outputs per x row. */
static inline __attribute__((always_inline)) void packed_pair_dot(int type, const uint8_t *panel, int64_t other,
                                                                  const px_t *px, int64_t r0, int mr, int stream,
                                                                  float *out, int64_t ld) {
    const int64_t nb = px->nb, bb = packed_block_bytes(type);
    const int qb = packed_qbytes(type);
    __m512 acc[PACKED_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pq = panel + b * bb;
        if (stream && PACKED_AHEAD > 0) prefetch_ahead(pq, bb, PACKED_AHEAD), prefetch_ahead(pq + other, bb, PACKED_AHEAD);
        const int8_t *xb[PACKED_MR];
        __m512i s32[PACKED_MR];
        for (int i = 0; i < mr; i++) {
            xb[i] = px->xq + (r0 + i) * px->k + b * 32;
            s32[i] = type == 9 ? _mm512_set1_epi32(-128 * px->xi[(r0 + i) * nb + b]) : _mm512_setzero_si512();
        }
        pair_steps(type, pq, other, xb, mr, s32);
        const __m512 s = pair_halves(pq + qb, other);
        const __m512 a = type == 11 ? pair_halves(pq + qb + 16, other) : _mm512_mul_ps(_mm512_set1_ps(-8.0f), s);
        for (int i = 0; i < mr; i++) {
            const int64_t at = (r0 + i) * nb + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i]), _mm512_mul_ps(s, _mm512_set1_ps(px->dx[at])), acc[i]);
            if (type != 9) acc[i] = _mm512_fmadd_ps(a, _mm512_set1_ps(px->xs[at]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out + i * ld, acc[i]);
}
#endif

#endif
