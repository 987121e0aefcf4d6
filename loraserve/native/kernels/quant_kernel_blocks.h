/* The formats' decoding for quant_kernel.c (included after its BLOCK_SIZE / TYPE_SIZE tables): float16
 * fields, the K-quants' six-bit scales and mins, and each 32-weight block's scales (block_info) and 32
 * quants in weight order, portable (unpack_scalar) or in one AVX2 register (unpack_vec). Types: the
 * K-quants in GGUF's block layout (3 Q4_K, 4 Q5_K, 5 Q6_K) and Q8_0 / Q4_0 / Q4_1 in their row layout
 * (6 Q8_0R, 7 Q4_0R, 8 Q4_1R: a row's float16 scales, then Q4_1's mins, then its quants, pairs of blocks
 * interleaved; formats.repack_rows describes it). A block is addressed by its row, the row's number of
 * 32-blocks nb and its index b. */
#ifndef LORASERVE_QUANT_KERNEL_BLOCKS_H
#define LORASERVE_QUANT_KERNEL_BLOCKS_H

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t u;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) u = sign | 0x7f800000u | (mant << 13);
    else u = sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Whether a type's quants are signed bytes in its blocks (the others are unsigned, with a min). */
static inline int is_signed_type(int type) { return type == 5 || type == 6 || type == 7; }

/* The row layout's float16 fields per block (2: a scale; Q4_1R 4: a scale and a min) */
static inline int row_fields(int type) { return type == 8 ? 4 : 2; }

/* Q4_K/Q5_K: the six-bit scale and min of sub-block j (0-7) from the 12 scale bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

typedef struct {
    float s0, s1, add; /* scale of weights 0-15, of 16-31, and the additive term */
} blockinfo;

/* The scales of 32-weight block `b` of a row of nb blocks. */
static inline __attribute__((always_inline)) void block_info(int type, const uint8_t *row, int64_t nb, int64_t b,
                                                             blockinfo *bi) {
    if (type >= 6) {
        bi->s0 = bi->s1 = f16_to_f32(row + 2 * b);
        bi->add = type == 8 ? f16_to_f32(row + 2 * nb + 2 * b) : 0.0f;
        return;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    const int j = (int)(b % 8);
    if (type == 5) {
        const float d = f16_to_f32(p + 208);
        bi->s0 = d * (float)(int8_t)p[192 + 2 * j], bi->s1 = d * (float)(int8_t)p[193 + 2 * j];
        bi->add = 0.0f;
        return;
    }
    int sc, mn;
    k_scale_min(p + 4, j, &sc, &mn);
    bi->s0 = bi->s1 = f16_to_f32(p) * (float)sc;
    bi->add = -f16_to_f32(p + 2) * (float)mn;
}

/* Where a row-layout block's quants start, and (Q8_0R) where its second 16 bytes are: a block b of a
 * pair (b even, b + 1 < nb) has bytes 0-15 at pair + 0, 16-31 at pair + 32; its partner b + 1 at 16
 * and 48; an odd row's last block is 32 bytes in order. */
static inline const uint8_t *row_quants(int type, const uint8_t *row, int64_t nb, int64_t b, int64_t *second) {
    const uint8_t *q = row + row_fields(type) * nb;
    if (type != 6) {
        *second = 0;
        return q + 16 * b;
    }
    if (nb % 2 && b == nb - 1) {
        *second = 16;
        return q + 32 * b;
    }
    *second = 32;
    return q + 32 * (b & ~(int64_t)1) + 16 * (b & 1);
}

/* Block b's 32 quants in weight order as bytes (signed for the signed types), portable. */
static inline void unpack_scalar(int type, const uint8_t *row, int64_t nb, int64_t b, int8_t *q) {
    const int j = (int)(b % 8);
    if (type >= 6) {
        int64_t second;
        const uint8_t *p = row_quants(type, row, nb, b, &second);
        if (type == 6) {
            memcpy(q, p, 16), memcpy(q + 16, p + second, 16);
            return;
        }
        const int off = type == 7 ? 8 : 0;
        for (int i = 0; i < 16; i++) q[i] = (int8_t)((p[i] & 15) - off), q[i + 16] = (int8_t)((p[i] >> 4) - off);
        return;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    if (type == 3 || type == 4) {
        const uint8_t *qs = p + (type == 3 ? 16 : 48) + (j / 2) * 32, *qh = p + 16;
        const int shift = (j & 1) * 4;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)(((qs[i] >> shift) & 15) | (type == 4 ? ((qh[i] >> j) & 1) << 4 : 0));
        return;
    }
    /* Q6_K: half h, 32-block r of it */
    const int h = j / 4, r = j % 4;
    const uint8_t *ql = p + h * 64 + (r % 2) * 32, *qh = p + 128 + h * 32;
    for (int i = 0; i < 32; i++)
        q[i] = (int8_t)((((ql[i] >> (4 * (r / 2))) & 15) | (((qh[i] >> (2 * r)) & 3) << 4)) - 32);
}

#if QK_PATH > 0
/* Block b's 32 quants in weight order in one register (what unpack_scalar computes). */
static inline __attribute__((always_inline)) __m256i unpack_vec(int type, const uint8_t *row, int64_t nb, int64_t b) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const int j = (int)(b % 8);
    if (type >= 6) {
        int64_t second;
        const uint8_t *p = row_quants(type, row, nb, b, &second);
        if (type == 6)
            return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + second)), _mm_loadu_si128((const __m128i *)p));
        const __m128i v = _mm_loadu_si128((const __m128i *)p);
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        return type == 7 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    if (type <= 4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (type == 3 ? 16 : 48) + (j / 2) * 32));
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128((j & 1) * 4)), low4);
        if (type == 4) {
            const __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)), _mm_cvtsi32_si128(j));
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
        return q;
    }
    const int h = j / 4, r = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (r % 2) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r / 2))), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}
#endif

#endif
