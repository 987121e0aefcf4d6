/* The K-quants' (Q4_K, Q5_K, Q6_K) decode loop, a 256-weight super-block at a time against activations
 * quantized per 256 (quant_kernel_act.h: kq, dk, bs), for quant_kernel.c. Included after qx_t.
 *
 * Semantics: out[m] = sum over super-blocks of W's row . x[r0 + m] with x read as dk * kq (two levels:
 * dk * kq + dk / 256 * kq2), in float32 from exact int32 super-block sums. Per super-block:
 *   Q4_K / Q5_K: d dk sum_j sc_j (q_j . kq_j) - dmin dk sum_j mn_j sum(kq_j)   (j: the 8 sub-blocks of 32)
 *   Q6_K:        d dk sum_g sc_g (u_g . kq_g) - 32 d dk sum_g sc_g sum(kq_g)     (g: the 16 groups of 16,
 *                u = q + 32, the unsigned six-bit quant)
 * Why this shape (llama.cpp's q4_K x q8_K scheme, read in ggml-cpu's x86 quants.c): the weights' sub-block
 * scales are small integers, so each sub-block's byte products (vpmaddubsw: unsigned weight x signed
 * activation, int16 pair sums) are multiplied by its scale in the same vpmaddwd that widens them, and
 * summed in int32 to the super-block's end: one conversion and one FMA per 256 weights and row, where
 * a float scale per 32 activations needed a conversion, a permute and an FMA per 32. Bounds: a pair sum
 * is at most 2 x 63 x 127 = 16002, a super-block's int32 sum at most 256 x 63 x 127 x 127 < 2^31.
 * The portable build computes the same quantities in scalar code (kq_row_dot_scalar). */
#ifndef LORASERVE_QUANT_KERNEL_KSUPER_H
#define LORASERVE_QUANT_KERNEL_KSUPER_H

/* Q4_K/Q5_K: the 8 six-bit scales and the 8 mins of a super-block's 12 scale bytes, as bytes 0-7 of
 * `sc` and `mn` (sub-blocks 0-3 keep their low six bits in bytes 0-3 and 4-7, sub-blocks 4-7 their low
 * four in bytes 8-11 and their top two in the top bits of bytes 0-7). */
static inline __attribute__((always_inline)) void k_scales_mins(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4), memcpy(&u1, s + 4, 4), memcpy(&u2, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc_hi = (u2 & four) | (((u0 >> 6) & two) << 4), mn_hi = ((u2 >> 4) & four) | (((u1 >> 6) & two) << 4);
    *sc = (uint64_t)(u0 & six) | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)(u1 & six) | ((uint64_t)mn_hi << 32);
}

#if QK_PATH > 0
/* Byte shuffles over a vector whose two halves hold the same 8 int16 scales: SPREAD_K[j] puts scale j in
 * every lane (Q4_K / Q5_K sub-block j), SPREAD_6[j] scale 2j % 8 in the low half and (2j + 1) % 8 in the
 * high one (Q6_K sub-block j's two 16-weight groups). Tables, not _mm256_setr_epi16: built per call,
 * GCC emitted 16 inserts for each. */
#define SPREAD_PAIR(i) (2 * (i)), (2 * (i) + 1)
#define SPREAD_HALF(i) SPREAD_PAIR(i), SPREAD_PAIR(i), SPREAD_PAIR(i), SPREAD_PAIR(i), SPREAD_PAIR(i), \
    SPREAD_PAIR(i), SPREAD_PAIR(i), SPREAD_PAIR(i)
static const uint8_t SPREAD_K[8][32] __attribute__((aligned(32))) = {
    {SPREAD_HALF(0), SPREAD_HALF(0)}, {SPREAD_HALF(1), SPREAD_HALF(1)}, {SPREAD_HALF(2), SPREAD_HALF(2)},
    {SPREAD_HALF(3), SPREAD_HALF(3)}, {SPREAD_HALF(4), SPREAD_HALF(4)}, {SPREAD_HALF(5), SPREAD_HALF(5)},
    {SPREAD_HALF(6), SPREAD_HALF(6)}, {SPREAD_HALF(7), SPREAD_HALF(7)}};
static const uint8_t SPREAD_6[8][32] __attribute__((aligned(32))) = {
    {SPREAD_HALF(0), SPREAD_HALF(1)}, {SPREAD_HALF(2), SPREAD_HALF(3)}, {SPREAD_HALF(4), SPREAD_HALF(5)},
    {SPREAD_HALF(6), SPREAD_HALF(7)}, {SPREAD_HALF(0), SPREAD_HALF(1)}, {SPREAD_HALF(2), SPREAD_HALF(3)},
    {SPREAD_HALF(4), SPREAD_HALF(5)}, {SPREAD_HALF(6), SPREAD_HALF(7)}};
#undef SPREAD_HALF
#undef SPREAD_PAIR

/* Sub-block j's 32 unsigned quants: Q4_K's nibbles, Q5_K's with their fifth bit, Q6_K's six bits. */
static inline __attribute__((always_inline)) __m256i ksub_quants(int type, const uint8_t *p, int j, __m256i qh) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (type == 5) {
        const int h = j / 4, r = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (r % 2) * 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
        const __m256i lo = _mm256_and_si256(r / 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * r), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (type == 3 ? 16 : 48) + (j / 2) * 32));
    __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
    if (type == 4) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
}

/* Super-block sb of a row against rows r0 .. r0 + mr - 1: fs[m] += its scaled sums, fm[m] += the terms
 * to subtract (mins, Q6_K's offset). `type`, `mr` and `two` are constants after inlining. */
static inline __attribute__((always_inline)) void ksuper_block(int type, const uint8_t *p, int64_t sb, const qx_t *qx,
                                                               int64_t k, int64_t r0, int mr, int two, __m256 *fs,
                                                               __m256 *fm) {
    __m256i sc_lo, sc_hi = _mm256_setzero_si256(), sc16 = _mm256_setzero_si256(), qh = _mm256_setzero_si256();
    __m128i mn16 = _mm_setzero_si128();
    float d, dmin = 0.0f;
    if (type == 5) { /* 16 int8 scales, one per 16 weights */
        d = f16_to_f32(p + 208);
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
        sc_lo = _mm256_permute2x128_si256(sc16, sc16, 0x00), sc_hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    } else {
        uint64_t sc, mn;
        k_scales_mins(p + 4, &sc, &mn);
        d = f16_to_f32(p), dmin = f16_to_f32(p + 2);
        sc_lo = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        if (type == 4) qh = _mm256_loadu_si256((const __m256i *)(p + 16));
    }
    __m256i acc[MR], acc2[MR];
    for (int m = 0; m < MR; m++) acc[m] = acc2[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i q = ksub_quants(type, p, j, qh);
        /* sub-block j's scale in every lane (Q4_K/Q5_K), or Q6_K's two: 2j for weights 0-15, 2j+1 after */
        const __m256i s = type == 5 ? _mm256_shuffle_epi8(j < 4 ? sc_lo : sc_hi, _mm256_load_si256((const __m256i *)SPREAD_6[j]))
                                    : _mm256_shuffle_epi8(sc_lo, _mm256_load_si256((const __m256i *)SPREAD_K[j]));
        for (int m = 0; m < MR; m++) {
            if (m >= mr) break;
            const int64_t at = (r0 + m) * k + sb * 256 + j * 32;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx->kq + at));
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), s));
            if (two) {
                const __m256i x2 = _mm256_loadu_si256((const __m256i *)(qx->kq2 + at));
                acc2[m] = _mm256_add_epi32(acc2[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x2), s));
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        if (m >= mr) break;
        const int64_t row = r0 + m, ks = row * (k / 256) + sb;
        const float dk = qx->dk[ks];
        fs[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(d * dk), fs[m]);
        if (two) fs[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc2[m]), _mm256_set1_ps(d * dk * (1.0f / 256.0f)), fs[m]);
        for (int level = 0; level < 1 + two; level++) {
            const int16_t *bs = (level ? qx->bs2 : qx->bs) + ks * 16;
            const float unit = level ? dk * (1.0f / 256.0f) : dk;
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)bs); /* sums per 16 */
            __m256i sub;
            if (type == 5) { /* 32 sum_g sc_g sum_g */
                sub = _mm256_madd_epi16(sc16, b16);
                fm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub), _mm256_set1_ps(32.0f * d * unit), fm[m]);
            } else { /* sum_j mn_j sum_j, the sums per 32 being pairs of those per 16 */
                const __m128i b32 = _mm_hadd_epi16(_mm256_castsi256_si128(b16), _mm256_extracti128_si256(b16, 1));
                sub = _mm256_castsi128_si256(_mm_madd_epi16(mn16, b32));
                sub = _mm256_inserti128_si256(sub, _mm_setzero_si128(), 1);
                fm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub), _mm256_set1_ps(dmin * unit), fm[m]);
            }
        }
    }
}

/* out[m] = row . x[r0 + m] over the row's super-blocks (k / 256 of them). */
static inline __attribute__((always_inline)) void kq_row_dot(int type, const uint8_t *row, int64_t k, const qx_t *qx,
                                                             int64_t r0, int mr, int two, const uint8_t *ahead,
                                                             float *out) {
    __m256 fs[MR], fm[MR];
    for (int m = 0; m < MR; m++) fs[m] = fm[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; sb++) {
        /* the row `ahead` (NULL: none), a super-block at a time: spread over the loop, the prefetches
         * keep the memory system busy without a burst at each row's start */
        if (ahead != NULL)
            for (int at = 0; at < TYPE_SIZE[type]; at += 64) __builtin_prefetch(ahead + sb * TYPE_SIZE[type] + at, 0, 0);
        ksuper_block(type, row + sb * TYPE_SIZE[type], sb, qx, k, r0, mr, two, fs, fm);
    }
    for (int m = 0; m < mr; m++) out[m] = hsum8(_mm256_sub_ps(fs[m], fm[m]));
}
#endif

/* The same sums in scalar code (the portable build): per 32-block, its two 16-weight halves' integer
 * dot products with x's per-256 quants, scaled in float. */
static inline void kq_row_dot_scalar(int type, const uint8_t *row, int64_t k, const qx_t *qx, int64_t r0, int mr,
                                     int two, float *out) {
    for (int m = 0; m < mr; m++) {
        const int64_t r = r0 + m;
        float acc = 0.0f;
        for (int64_t b = 0; b < k / 32; b++) {
            blockinfo bi;
            int8_t q[32];
            block_info(type, row, k / 32, b, &bi);
            unpack_scalar(type, row, k / 32, b, q);
            const int64_t at = r * k + b * 32, ks = r * (k / 256) + b / 8;
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 16; i++) {
                const int32_t a = type == 5 ? q[i] : (uint8_t)q[i], c = type == 5 ? q[i + 16] : (uint8_t)q[i + 16];
                lo += a * (two ? 256 * qx->kq[at + i] + qx->kq2[at + i] : qx->kq[at + i]);
                hi += c * (two ? 256 * qx->kq[at + i + 16] + qx->kq2[at + i + 16] : qx->kq[at + i + 16]);
            }
            const float unit = two ? qx->dk[ks] / 256.0f : qx->dk[ks];
            const int16_t *bs = qx->bs + (r * (k / 16) + b * 2), *bs2 = two ? qx->bs2 + (r * (k / 16) + b * 2) : NULL;
            const int32_t sum = two ? 256 * (bs[0] + bs[1]) + bs2[0] + bs2[1] : bs[0] + bs[1];
            acc += unit * (bi.s0 * (float)lo + bi.s1 * (float)hi + bi.add * (float)sum);
        }
        out[m] = acc;
    }
}

#endif
