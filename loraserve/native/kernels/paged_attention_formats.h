/* The KV cache's element formats (batch/kv_cache.py says what each stored value means): their codes,
 * vector loads of stored values as float32 for the scores and value sums, and the encoders the write
 * uses (round to nearest even, as torch's conversions round).
 *
 * Reading: fp8 e5m2 is the top byte of a float16, widened by F16C (vcvtph2ps); e4m3 is rebuilt as
 * float16 bits with integer vector ops (magnitude << 7, sign << 8: a float16 of the value / 2^8, whose
 * float16 subnormals F16C widens exactly, so no float32 subnormal is ever made) and widened the same
 * way; int8 is sign-extended and converted. The 2^8 of e4m3 (KV_DECODE_FACTOR) and every scale are
 * folded into the per-key scales the kernel multiplies scores and probabilities by, never into the
 * elements. Builds without F16C (portable C) decode bit by bit, to the same values.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the
 * earlier ones define. */
#ifndef PAGED_ATTENTION_FORMATS_H
#define PAGED_ATTENTION_FORMATS_H

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3, KV_INT8 = 4 };

/* Bytes per stored element. */
static inline int64_t kv_esize(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

/* What a decoded element is multiplied by to be the stored value (times the scale): 2^8 for e4m3. */
static inline float kv_decode_factor(int kv) { return kv == KV_E4M3 ? 256.0f : 1.0f; }

/* One stored 8-bit element as float32, over its decode factor (scalar: the portable path, the tails). */
static inline float kv8_to_f32(uint8_t b, int kv) {
    if (kv == KV_INT8) return (float)(int8_t)b;
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, mag = b & 0x7f;
    float x;
    if (kv == KV_E5M2) { /* s eeeee mm, bias 15 */
        uint32_t bits;
        if (mag >= 0x7c) bits = 0x7f800000u | (mag & 3) << 21; /* inf, NaN */
        else if (mag >= 4) bits = (mag << 21) + (112u << 23);
        else bits = 0;
        memcpy(&x, &bits, sizeof x);
        if (mag < 4) x = (float)mag * 0x1p-16f; /* subnormal: m * 2^-16 */
    } else { /* e4m3fn: s eeee mmm, bias 7, no inf, 0x7f NaN; value / 2^8 */
        if (mag == 0x7f) return NAN;
        if (mag >= 8) {
            const uint32_t bits = (mag << 20) + (112u << 23);
            memcpy(&x, &bits, sizeof x);
        } else {
            x = (float)mag * 0x1p-17f;
        }
    }
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u |= sign;
    memcpy(&x, &u, sizeof x);
    return x;
}

#if W == 16
/* 16 float16s (as the bits of 16 words) widened. */
static inline vf vhalf_to_f32(__m256i h) { return _mm512_cvtph_ps(h); }
static inline __m128i kv8_bytes(const uint8_t *p, int64_t n) {
    return n >= 16 ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(mask16_first(n), p);
}
/* e4m3 bytes (16-bit lanes) as float16 bits of value / 2^8; 0x7f (NaN) as a float16 NaN. */
static inline __m256i e4m3_half_bits(__m256i w) {
    const __m256i mag = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3f80));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000));
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x7e00));
    return _mm256_or_si256(_mm256_or_si256(mag, sign), nan);
}
/* The first n (<= W) stored 8-bit elements at p as float32, over their decode factor; 0 past n. */
static inline vf vload_kv8(const uint8_t *p, int64_t n, int kv) {
    const __m128i x = kv8_bytes(p, n);
    if (kv == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    const __m256i w = _mm256_cvtepu8_epi16(x);
    return vhalf_to_f32(kv == KV_E5M2 ? _mm256_slli_epi16(w, 8) : e4m3_half_bits(w));
}
#elif W == 8
static inline __m128i kv8_bytes(const uint8_t *p, int64_t n) {
    if (n >= 8) return _mm_loadl_epi64((const __m128i *)p);
    uint8_t tail[8] = {0};
    if (n > 0) memcpy(tail, p, (size_t)n);
    return _mm_loadl_epi64((const __m128i *)tail);
}
#ifdef __F16C__
static inline __m128i e4m3_half_bits(__m128i w) {
    const __m128i mag = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3f80));
    const __m128i sign = _mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16((short)0x8000));
    const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x3f80)), _mm_set1_epi16(0x7e00));
    return _mm_or_si128(_mm_or_si128(mag, sign), nan);
}
#endif
static inline vf vload_kv8(const uint8_t *p, int64_t n, int kv) {
    const __m128i x = kv8_bytes(p, n);
    if (kv == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
#ifdef __F16C__
    if (kv == KV_E5M2) return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x));
    return _mm256_cvtph_ps(e4m3_half_bits(_mm_cvtepu8_epi16(x)));
#else
    uint8_t b[8];
    float f[8];
    _mm_storel_epi64((__m128i *)b, x);
    for (int i = 0; i < 8; ++i) f[i] = kv8_to_f32(b[i], kv);
    return _mm256_loadu_ps(f);
#endif
}
#else
static inline vf vload_kv8(const uint8_t *p, int64_t n, int kv) { return n > 0 ? kv8_to_f32(*p, kv) : 0.0f; }
#endif

/* 2W stored elements (n real) as float32 in order: the first W in *a, the next W in *b. */
static inline void vload_kv8_pair(const uint8_t *p, int64_t n, int kv, vf *a, vf *b) {
    *a = vload_kv8(p, n, kv);
    *b = vload_kv8(p + W, n - W, kv);
}

/* dst row j (d floats) = stored 8-bit row src[j] over its decode factor, for the W rows of a tile:
 * converted once per tile for all the rows that score it. */
__attribute__((always_inline)) static inline void rows8_kind(float *dst, const uint8_t *const *src, const float **rows,
                                                             int64_t d, int kv) {
    for (int j = 0; j < W; ++j) {
        for (int64_t i = 0; i < d; i += W) vstore(dst + j * d + i, vload_kv8(src[j] + i, d - i, kv), d - i);
        rows[j] = dst + j * d;
    }
}
static void rows8_to_f32(float *dst, const uint8_t *const *src, const float **rows, int64_t d, int kv) {
    if (kv == KV_INT8) rows8_kind(dst, src, rows, d, KV_INT8);
    else if (kv == KV_E5M2) rows8_kind(dst, src, rows, d, KV_E5M2);
    else rows8_kind(dst, src, rows, d, KV_E4M3);
}

#ifdef NATIVE_BF16_DOT
/* table[m] = the bf16 bits of fp8 magnitude m (0..127) over its decode factor, NaN and infinity
 * included: exact, since every e4m3 and e5m2 value over its factor is a bf16 (and a normal one, which
 * the bf16 pair products, flushing subnormal inputs, need); sign_magnitude_words reads bytes through it. */
static void fp8_bf16_table(int kv, uint16_t *table) {
    for (int m = 0; m < 128; ++m) table[m] = f32_to_bf16(kv8_to_f32((uint8_t)m, kv));
}

/* dst row j (d bf16) = stored int8 row src[j], for the W rows of a tile: exact, since every int8 (8
 * significant bits at most) is a bf16, so the bf16 pair dot products score int8 keys as they score a
 * bf16 cache. Only where the CPU has bf16 pair products but not int16 ones (i16_dot): fp8 keys are read
 * through their table (sign_magnitude_words), int8 ones with VNNI widened as they load. */
static void rows8_to_bf16(uint16_t *dst, const uint8_t *const *src, const uint16_t **rows, int64_t d) {
    for (int j = 0; j < W; ++j) {
        for (int64_t i = 0; i < d; i += 2 * W) { /* 2W values: one conversion instruction (exact: no rounding) */
            const vf lo = vload_kv8(src[j] + i, d - i, KV_INT8), hi = vload_kv8(src[j] + i + W, d - i - W, KV_INT8);
            _mm512_mask_storeu_epi16(dst + j * d + i, mask32_first(d - i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        rows[j] = dst + j * d;
    }
}
#endif

/* x rounded to the fp8 format (nearest even), saturated to its largest finite value; NaN stays NaN.
 * The rounding is torch's (c10 Float8_e4m3fn / Float8_e5m2), on x already clamped. */
static inline uint8_t f32_to_fp8(float x, int kv) {
    const int e4m3 = kv == KV_E4M3;
    const float max = e4m3 ? 448.0f : 57344.0f;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint8_t)(sign | 0x7f); /* NaN, as torch writes it in both formats */
    float a = fabsf(x);
    if (a > max) a = max;
    memcpy(&u, &a, sizeof u);
    const int mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const uint32_t min_normal = (uint32_t)(127 - bias + 1) << 23;
    uint32_t code;
    if (u < min_normal) { /* subnormal: a / 2^(1 - bias - mant), rounded to nearest even (8 is the least normal) */
        const float steps = a * (e4m3 ? 0x1p9f : 0x1p16f);
        code = (uint32_t)nearbyintf(steps);
    } else {
        const int shift = 23 - mant;
        u += ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1);
        code = u >> shift;
    }
    return (uint8_t)(sign | code);
}

#endif /* PAGED_ATTENTION_FORMATS_H */
