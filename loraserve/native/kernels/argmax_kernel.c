/* Row-wise argmax of a step's logits, for greedy sampling; loaded through ctypes by argmax.py.
 *
 * Semantics (the twin is torch.argmax(x.float(), dim=-1)): per row, the index of the first maximum;
 * a NaN counts as larger than every number, so a row holding one gives its first NaN; -0.0 equals
 * +0.0. Shape: x [rows, n] (n >= 1) of float32 (dtype 0) or bf16 (dtype 1) with row stride ld
 * elements; out [rows] int64.
 *
 * Why a kernel: the LM head writes bf16 logits, and torch has no fast argmax for them on CPU (its
 * bf16 `amax` is scalar); converting 32 x 49152 logits to float32 first writes 6 MB and reads them
 * back, a few percent of a small model's decode step. Here each row is read once for its maximum and
 * once more (from cache) for the first index holding it.
 */
#include "simd.h"

static inline float load_value(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#if W == 16 /* simd.h's AVX-512 level: F + BW + VL */
/* The first NaN at or after `from`, or -1. */
static int64_t first_nan(const void *row, int64_t from, int64_t n, int is_bf16) {
    for (int64_t i = from; i < n; i++) {
        float v = load_value(row, i, is_bf16);
        if (v != v) return i;
    }
    return -1;
}

/* The first index in [from, n) whose value equals m (m is not a NaN). */
static int64_t first_equal(const void *row, int64_t from, int64_t n, float m, int is_bf16) {
    for (int64_t i = from; i < n; i++)
        if (load_value(row, i, is_bf16) == m) return i;
    return n; /* not reached: m is one of the values */
}

static inline __m512 load16(const void *row, int64_t i, int64_t n, int is_bf16) {
    const __mmask16 k = mask16_first(n - i);
    if (!is_bf16) return _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), k, (const float *)row + i);
    const __m512 v = bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + i));
    return _mm512_mask_blend_ps(k, _mm512_set1_ps(-__builtin_inff()), v);
}

static int64_t row_argmax(const void *row, int64_t n, int is_bf16) {
    __m512 best[4];
    __mmask16 nan = 0;
    for (int j = 0; j < 4; j++) best[j] = _mm512_set1_ps(-__builtin_inff());
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) /* four independent maxima: one per cycle instead of one per latency */
        for (int j = 0; j < 4; j++) {
            const __m512 v = load16(row, i + 16 * j, n, is_bf16);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best[j] = _mm512_max_ps(best[j], v);
        }
    for (; i < n; i += 16) {
        const __m512 v = load16(row, i, n, is_bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best[0] = _mm512_max_ps(best[0], v);
    }
    if (nan) return first_nan(row, 0, n, is_bf16);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3])));
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t at = 0; at < n; at += 16) {
        const __mmask16 valid = mask16_first(n - at);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(valid, load16(row, at, n, is_bf16), mv, _CMP_EQ_OQ);
        if (hit) return at + __builtin_ctz(hit);
    }
    return first_equal(row, 0, n, m, is_bf16); /* not reached */
}
#else
static int64_t row_argmax(const void *row, int64_t n, int is_bf16) {
    float m = load_value(row, 0, is_bf16);
    if (m != m) return 0;
    int64_t at = 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = load_value(row, i, is_bf16);
        if (v != v) return i;
        if (v > m) m = v, at = i;
    }
    return at;
}
#endif

/* Returns 0, or 1 for an unknown dtype or n < 1 (nothing written). */
int argmax_rows(const void *x, int64_t ld, int64_t rows, int64_t n, int dtype, int64_t *out, int num_threads) {
    if ((dtype != 0 && dtype != 1) || n < 1) return 1;
    const int64_t elem = dtype == 1 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax((const char *)x + r * ld * elem, n, dtype);
    return 0;
}
