/* The integer decode path of the K-quants (Q4_K, Q5_K, Q6_K) a 256-weight super-block at a time, for
 * quant_kernel.c's vector builds (AVX2, AVX512-VNNI). Included by quant_kernel.c after dotq and qx_t.
 *
 * Semantics: exactly int8_block's per-32 sums, sum_blocks dx * (s * idot + add * sum(xq)), in another
 * order. Why a second loop: read per 32-block, a K-quant block re-decodes the super-block's float16
 * scales and its six-bit scale/min pair each time (about 20 scalar instructions for 32 weights, most
 * of the step on a Q4_K_M file). Here the scales of a super-block are decoded once, as 8 float lanes,
 * and multiplied by the 8 activation scales of each row in one vector product; each 32-block then costs
 * its unpacking (shared by the rows), one integer dot product per row and one FMA against its lane of
 * that product. The min terms of Q4_K/Q5_K are one FMA per super-block and row: mins . (dx * sum xq).
 */
#ifndef LORASERVE_QUANT_KERNEL_KSUPER_H
#define LORASERVE_QUANT_KERNEL_KSUPER_H

/* 8 unsigned bytes as float32 lanes. */
static inline __attribute__((always_inline)) __m256 u8x8_to_ps(uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes)));
}

/* Q4_K/Q5_K: the 8 six-bit scales and the 8 mins of a super-block's 12 scale bytes, as bytes 0-7 of
 * `sc` and `mn` (the layout k_scale_min reads one at a time: sub-blocks 0-3 keep their low six bits in
 * bytes 0-3 and 4-7, sub-blocks 4-7 their low four in bytes 8-11 and their top two in the top bits of
 * bytes 0-7). */
static inline __attribute__((always_inline)) void k_scales_mins(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4), memcpy(&u1, s + 4, 4), memcpy(&u2, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc_hi = (u2 & four) | (((u0 >> 6) & two) << 4), mn_hi = ((u2 >> 4) & four) | (((u1 >> 6) & two) << 4);
    *sc = (uint64_t)(u0 & six) | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)(u1 & six) | ((uint64_t)mn_hi << 32);
}

/* Sub-block j's 32 quants (what unpack_vec returns for block 8 * sb + j), with the nibble shift an
 * immediate once j is unrolled and Q5_K's high bits loaded once per super-block: calling unpack_vec
 * here (a shift by a register count, qh reloaded per sub-block) ran Q4_K about 1.35x slower (AVX2
 * EPYC, 1 thread, 3072x2048 bf16: 416 vs 305 us). */
static inline __attribute__((always_inline)) __m256i ksub_quants(int type, const uint8_t *p, int j, __m256i qh) {
    if (type == 5) return unpack_vec(5, p, j);
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (type == 3 ? 16 : 48) + (j / 2) * 32));
    __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
    if (type == 4) {
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
}

/* Super-block sb of a row against rows r0 .. r0 + mr - 1 of qx: acc[2m + (j & 1)] += the scaled dot
 * products of its sub-blocks j, madd[m] += its min terms (Q4_K/Q5_K; to be subtracted). */
static inline __attribute__((always_inline)) void ksuper_block(int type, const uint8_t *p, int64_t sb, const qx_t *qx,
                                                               int64_t r0, int mr, int two, __m256 *acc, __m256 *madd) {
    const int is_signed = type == 5;
    __m256 scale_lo, scale_hi = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    if (type == 5) { /* 16 int8 scales, one per 16 weights, times d */
        const __m256 d = _mm256_set1_ps(f16_to_f32(p + 208));
        const __m128i s16 = _mm_loadu_si128((const __m128i *)(p + 192));
        scale_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s16)));
        scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8))));
    } else {
        uint64_t sc, mn;
        k_scales_mins(p + 4, &sc, &mn);
        scale_lo = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(p)), u8x8_to_ps(sc));
        mins = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(p + 2)), u8x8_to_ps(mn));
    }
    const __m256i qh = type == 4 ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
    __m256 fac[MR]; /* Q4_K/Q5_K: lane j = scale_j * dx_j of row m */
    for (int m = 0; m < MR; m++) {
        if (m >= mr) break;
        const int64_t at = (r0 + m) * qx->nb + sb * 8;
        const __m256 dx = _mm256_loadu_ps(qx->dx + at);
        fac[m] = _mm256_mul_ps(scale_lo, dx);
        if (type != 5) madd[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(qx->dxs + at), madd[m]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i q = ksub_quants(type, p, j, qh);
        /* Q6_K's sub-block j takes scales 2j (weights 0-15, lanes 0-3) and 2j + 1 (lanes 4-7) */
        const __m256i pair = _mm256_setr_epi32(2 * j % 8, 2 * j % 8, 2 * j % 8, 2 * j % 8, (2 * j + 1) % 8,
                                               (2 * j + 1) % 8, (2 * j + 1) % 8, (2 * j + 1) % 8);
        const __m256 s6 = type == 5 ? _mm256_permutevar8x32_ps(j < 4 ? scale_lo : scale_hi, pair) : scale_lo;
        for (int m = 0; m < MR; m++) {
            if (m >= mr) break;
            const int64_t at = (r0 + m) * qx->nb + sb * 8 + j;
            const __m256 d = _mm256_cvtepi32_ps(dotq(q, qx->xq, qx->xq2, at, is_signed, two));
            const __m256 f = type == 5 ? _mm256_mul_ps(s6, _mm256_set1_ps(qx->dx[at]))
                                       : _mm256_permutevar8x32_ps(fac[m], _mm256_set1_epi32(j));
            acc[2 * m + (j & 1)] = _mm256_fmadd_ps(d, f, acc[2 * m + (j & 1)]);
        }
    }
}

/* out[m] = row . x[r0 + m] over the row's super-blocks (k / 256 of them), as row_dot. */
static inline __attribute__((always_inline)) void ksuper_row_dot(int type, const uint8_t *row, int64_t k,
                                                                 const qx_t *qx, int64_t r0, int mr, int two,
                                                                 float *out) {
    __m256 acc[2 * MR], madd[MR];
    for (int m = 0; m < MR; m++) acc[2 * m] = acc[2 * m + 1] = madd[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; sb++) ksuper_block(type, row + sb * TYPE_SIZE[type], sb, qx, r0, mr, two, acc, madd);
    for (int m = 0; m < mr; m++) out[m] = hsum8(_mm256_add_ps(acc[2 * m], acc[2 * m + 1])) - hsum8(madd[m]);
}

#endif
