/* The decode loop of Q8_0 / Q4_0 / Q4_1 in their row layout (types 6-8, quant_kernel_blocks.h), for
 * quant_kernel.c. Included after qx_t and dotq.
 *
 * Semantics: out[m] = sum over the row's 32-blocks b of dx_b * (d_b * (q_b . xq_b) + add_b * sum(xq_b)),
 * x quantized per 32 (two levels: q . (256 xq + xq2) in dx's unit), float32 sums. add_b is Q4_1's min,
 * Q4_0's -8 d_b (its nibbles are read unsigned, the 8 taken off through the block's sum), 0 for Q8_0.
 * Why this shape: a pair of blocks fills one 256-bit register (Q4_x: both blocks' nibble bytes; Q8_0:
 * their first halves, then their second halves) against x permuted the same way (quantize_x), so a
 * product's int32 partial sums hold block b in lanes 0-3 and b + 1 in lanes 4-7; four pairs' sums
 * fold by two vphaddd into one sum per block, and 8 blocks take one float16 conversion of their scales,
 * one multiply by their activation scales and one FMA, where reading the file's interleaved blocks
 * took a scalar scale conversion, a broadcast and an FMA per block (about 20 instructions per 32
 * weights; here about 7). */
#ifndef LORASERVE_QUANT_KERNEL_ROWS_H
#define LORASERVE_QUANT_KERNEL_ROWS_H

/* Where weight i of block b sits in a row of x permuted for the row layouts (quantize_x). */
static inline int64_t permuted_at(int64_t nb, int64_t b, int i) {
    if (nb % 2 && b == nb - 1) return b * 32 + i;
    return (b & ~(int64_t)1) * 32 + (b & 1) * 16 + (i < 16 ? i : 32 + (i - 16));
}

#if QK_PATH > 0
/* The int32 partial sums of the pair (b, b + 1) against row `at` (in 32-blocks of x): lanes 0-3 block b,
 * 4-7 block b + 1. */
static inline __attribute__((always_inline)) __m256i pair_dot(int type, const uint8_t *q, const qx_t *qx, int64_t at,
                                                              int two) {
    if (type == 6) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)q), b = _mm256_loadu_si256((const __m256i *)(q + 32));
        return _mm256_add_epi32(dotq(a, qx->xq, qx->xq2, at, 1, two), dotq(b, qx->xq, qx->xq2, at + 1, 1, two));
    }
    const __m256i low4 = _mm256_set1_epi8(15), v = _mm256_loadu_si256((const __m256i *)q);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (!two) { /* one level: the nibbles' byte products summed before widening (one widening, not two) */
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx->xq + at * 32));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx->xq + (at + 1) * 32));
#if QK_PATH == 2
        return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0), hi, x1);
#else
        /* |each int16 lane| <= 2 * 2 * 15 * 128 = 7680: the sum of two byte-pair products cannot saturate */
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                                 _mm256_set1_epi16(1));
#endif
    }
    return _mm256_add_epi32(dotq(lo, qx->xq, qx->xq2, at, 0, two), dotq(hi, qx->xq, qx->xq2, at + 1, 0, two));
}

/* The sum of lanes lo .. lo + 3 of v. */
static inline __attribute__((always_inline)) int32_t hsum4_epi32(__m256i v, int high) {
    __m128i s = high ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* One block's float contribution to row m from its integer dot product (the tails' path). */
static inline __attribute__((always_inline)) float block_term(int type, const uint8_t *row, int64_t nb, int64_t b,
                                                              const qx_t *qx, int64_t at, int32_t idot) {
    const float d = f16_to_f32(row + 2 * b);
    const float add = type == 8 ? f16_to_f32(row + 2 * nb + 2 * b) : (type == 7 ? -8.0f * d : 0.0f);
    return qx->dx[at] * d * (float)idot + add * qx->dxs[at];
}

/* out[m] = row . x[r0 + m] for a row-layout row (type 6-8) of k weights. */
static inline __attribute__((always_inline)) void rows_row_dot(int type, const uint8_t *row, int64_t k,
                                                               const qx_t *qx, int64_t r0, int mr, int two,
                                                               const uint8_t *ahead, float *out) {
    const int64_t nb = k / 32, qbytes = type == 6 ? 32 : 16;
    const uint8_t *quants = row + row_fields(type) * nb;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* vphaddd's block order undone */
    __m256 acc[MR], add[MR];
    float tail[MR];
    for (int m = 0; m < MR; m++) acc[m] = add[m] = _mm256_setzero_ps(), tail[m] = 0.0f;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        if (ahead != NULL)
            for (int64_t at = 0; at < 8 * qbytes; at += 64) __builtin_prefetch(ahead + (quants - row) + b * qbytes + at, 0, 0);
        __m256i p[4][MR];
        for (int pi = 0; pi < 4; pi++)
            for (int m = 0; m < MR; m++) {
                if (m >= mr) break;
                p[pi][m] = pair_dot(type, quants + (b + 2 * pi) * qbytes, qx, (r0 + m) * nb + b + 2 * pi, two);
            }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * b)));
        const __m256 mins = type == 8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * nb + 2 * b)))
                                      : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        for (int m = 0; m < MR; m++) {
            if (m >= mr) break;
            const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0][m], p[1][m]), _mm256_hadd_epi32(p[2][m], p[3][m]));
            const int64_t at = (r0 + m) * nb + b;
            const __m256 dx = _mm256_loadu_ps(qx->dx + at);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(s, order)), _mm256_mul_ps(d, dx), acc[m]);
            if (type != 6) add[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(qx->dxs + at), add[m]);
        }
    }
    for (; b + 2 <= nb; b += 2)
        for (int m = 0; m < mr; m++) {
            const int64_t at = (r0 + m) * nb + b;
            const __m256i s = pair_dot(type, quants + b * qbytes, qx, at, two);
            tail[m] += block_term(type, row, nb, b, qx, at, hsum4_epi32(s, 0)) +
                       block_term(type, row, nb, b + 1, qx, at + 1, hsum4_epi32(s, 1));
        }
    if (b < nb) { /* an odd row's last block, in weight order against x in weight order */
        const __m256i v = unpack_vec(type, row, nb, b);
        const __m256i q = type == 7 ? _mm256_add_epi8(v, _mm256_set1_epi8(8)) : v; /* Q4_0 read unsigned */
        for (int m = 0; m < mr; m++) {
            const int64_t at = (r0 + m) * nb + b;
            const __m256i s = dotq(q, qx->xq, qx->xq2, at, type == 6, two);
            tail[m] += block_term(type, row, nb, b, qx, at, hsum4_epi32(s, 0) + hsum4_epi32(s, 1));
        }
    }
    for (int m = 0; m < mr; m++) out[m] = hsum8(_mm256_add_ps(acc[m], add[m])) + tail[m];
}
#endif

/* The same sums in scalar code (the portable build), block by block. */
static inline void rows_row_dot_scalar(int type, const uint8_t *row, int64_t k, const qx_t *qx, int64_t r0, int mr,
                                       int two, float *out) {
    const int64_t nb = k / 32;
    for (int m = 0; m < mr; m++) {
        const int64_t r = r0 + m;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int8_t q[32];
            unpack_scalar(type, row, nb, b, q);
            int32_t idot = 0;
            for (int i = 0; i < 32; i++) {
                const int64_t at = r * k + permuted_at(nb, b, i);
                const int32_t w = type == 7 ? q[i] + 8 : (type == 8 ? (uint8_t)q[i] : q[i]); /* Q4_0 unsigned */
                idot += w * (two ? 256 * qx->xq[at] + qx->xq2[at] : qx->xq[at]);
            }
            const int64_t at = r * nb + b;
            const float d = f16_to_f32(row + 2 * b);
            const float add = type == 8 ? f16_to_f32(row + 2 * nb + 2 * b) : (type == 7 ? -8.0f * d : 0.0f);
            acc += qx->dx[at] * d * (float)idot + add * qx->dxs[at];
        }
        out[m] = acc;
    }
}

#endif
