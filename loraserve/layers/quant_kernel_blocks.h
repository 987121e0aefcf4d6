/* The block formats' decoding for quant_kernel.c (included after its BLOCK_SIZE / TYPE_SIZE tables):
 * float16 fields, the K-quants' six-bit scales and mins, each 32-block's scales (block_info) and its 32
 * quants, portable (unpack_scalar) or in one AVX2 register (unpack_vec). Layouts: formats.py. */
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

/* The scales of 32-weight block `b` of a row (the part of the unpacking every path shares). */
static inline __attribute__((always_inline)) const uint8_t *block_info(int type, const uint8_t *row, int64_t b,
                                                                       blockinfo *bi) {
    if (type <= 2) {
        const uint8_t *p = row + b * TYPE_SIZE[type];
        bi->s0 = bi->s1 = f16_to_f32(p);
        bi->add = type == 2 ? f16_to_f32(p + 2) : 0.0f;
        return p;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    const int j = (int)(b % 8);
    if (type == 5) {
        const float d = f16_to_f32(p + 208);
        bi->s0 = d * (float)(int8_t)p[192 + 2 * j], bi->s1 = d * (float)(int8_t)p[193 + 2 * j];
        bi->add = 0.0f;
        return p;
    }
    int sc, mn;
    k_scale_min(p + 4, j, &sc, &mn);
    bi->s0 = bi->s1 = f16_to_f32(p) * (float)sc;
    bi->add = -f16_to_f32(p + 2) * (float)mn;
    return p;
}

/* Block b's 32 quants as bytes (signed for types 0, 1, 5), portable. */
static inline void unpack_scalar(int type, const uint8_t *p, int64_t b, int8_t *q) {
    const int j = (int)(b % 8);
    switch (type) {
    case 0: memcpy(q, p + 2, 32); break;
    case 1:
    case 2: {
        const uint8_t *qs = p + (type == 1 ? 2 : 4);
        const int off = type == 1 ? 8 : 0;
        for (int i = 0; i < 16; i++) q[i] = (int8_t)((qs[i] & 15) - off), q[i + 16] = (int8_t)((qs[i] >> 4) - off);
        break;
    }
    case 3:
    case 4: {
        const uint8_t *qs = p + (type == 3 ? 16 : 48) + (j / 2) * 32, *qh = p + 16;
        const int shift = (j & 1) * 4;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)(((qs[i] >> shift) & 15) | (type == 4 ? ((qh[i] >> j) & 1) << 4 : 0));
        break;
    }
    default: { /* Q6_K: half h, 32-block r of it */
        const int h = j / 4, r = j % 4;
        const uint8_t *ql = p + h * 64 + (r % 2) * 32, *qh = p + 128 + h * 32;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)((((ql[i] >> (4 * (r / 2))) & 15) | (((qh[i] >> (2 * r)) & 3) << 4)) - 32);
    }
    }
}

#if QK_PATH > 0
/* Block b's 32 quants in one register (what unpack_scalar computes). */
static inline __attribute__((always_inline)) __m256i unpack_vec(int type, const uint8_t *p, int64_t b) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const int j = (int)(b % 8);
    if (type == 0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    if (type <= 2) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(p + (type == 1 ? 2 : 4)));
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        return type == 1 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
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
