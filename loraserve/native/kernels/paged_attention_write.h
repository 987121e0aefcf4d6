/* The step's new K/V rows into their cache slots, in the cache's format (batch/kv_cache.py defines each;
 * layers/kv_cache_formats.py is the torch twin and writes the same bytes): a copy when the cache holds the
 * activations' dtype, bf16 rounding, fp8 encoding (x / scale, saturated), or int8 with its block scales.
 *
 * int8 works on runs: consecutive tokens whose slots follow one another in one cache block (a
 * sequence's new rows in that block). Per KV head, a run that starts the block (slot 0) sets the
 * block's scale to its amax / 127; a later run whose amax exceeds scale * 127 (or is not finite: the
 * scale becomes NaN or inf, and the block reads as NaN) first requantizes the block's earlier rows to
 * the new scale. Stored values are round(x / scale) (nearest even, in float32, as torch divides),
 * clamped to +-127, 0 where that is NaN.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the
 * earlier ones define. */
#ifndef PAGED_ATTENTION_WRITE_H
#define PAGED_ATTENTION_WRITE_H

/* New row t (n values, the activations' dtype, rows `stride` elements apart) as float32 in x. */
static void load_new_row(const Args *a, const void *rows, int64_t stride, int64_t t, int64_t n, float *x) {
    if (a->is_bf16) {
        const uint16_t *src = (const uint16_t *)rows + t * stride;
        for (int64_t i = 0; i < n; i += W) vstore(x + i, vload_bf16(src + i, n - i), n - i);
    } else {
        memcpy(x, (const float *)rows + t * stride, (size_t)n * sizeof(float));
    }
}

/* round(x / s) as an int8 level: nearest even, clamped to +-127, 0 for NaN. */
static inline int8_t int8_level(float x, float s) {
    const float r = nearbyintf(x / s);
    if (!(r == r)) return 0;
    return (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

/* One cache's (K's or V's) run of `count` new rows x (n = KVH * D floats apart) at slots first_slot ..,
 * int8 with the block's scales (see the top of this file). */
static void write_int8_run(const Args *a, int8_t *cache, float *scales, const float *x, int64_t count,
                           int64_t first_slot) {
    const int64_t d = a->head_dim, kvh = a->num_kv_heads, n = kvh * d, bs = a->block_size;
    const int64_t block = first_slot / bs, first = first_slot % bs;
    int8_t *rows = cache + block * bs * n; /* the block's row 0 */
    for (int64_t h = 0; h < kvh; ++h) {
        float amax = 0.0f;
        int nan = 0;
        for (int64_t r = 0; r < count; ++r)
            for (int64_t i = 0; i < d; ++i) {
                const float v = fabsf(x[r * n + h * d + i]);
                nan |= v != v;
                amax = v > amax ? v : amax;
            }
        if (nan) amax = NAN;
        float *scale = scales + block * kvh + h;
        const float old = *scale;
        if (first == 0 || !(amax <= old * 127.0f)) {
            const float next = amax / 127.0f;
            for (int64_t r = 0; r < first; ++r) /* the block's earlier rows, to the new scale */
                for (int64_t i = 0; i < d; ++i) {
                    int8_t *q = rows + r * n + h * d + i;
                    *q = int8_level((float)*q * old, next);
                }
            *scale = next;
        }
        const float s = *scale;
        for (int64_t r = 0; r < count; ++r)
            for (int64_t i = 0; i < d; ++i) rows[(first + r) * n + h * d + i] = int8_level(x[r * n + h * d + i], s);
    }
}

/* One cache's new rows (num_tokens of them, `stride` elements apart) into slot_mapping's slots. */
static int write_cache(const Args *a, char *cache, float *scales, float fp8_scale, int64_t num_tokens,
                       const void *rows, int64_t stride, const int64_t *slot_mapping) {
    const int64_t n = a->num_kv_heads * a->head_dim, bs = a->block_size;
    if (a->kv == (a->is_bf16 ? KV_BF16 : KV_F32)) { /* the activations' dtype: a copy */
        const int64_t esize = kv_esize(a->kv);
        for (int64_t t = 0; t < num_tokens; ++t)
            memcpy(cache + slot_mapping[t] * n * esize, (const char *)rows + t * stride * esize, (size_t)(n * esize));
        return 0;
    }
    const int64_t run_cap = a->kv == KV_INT8 ? bs : 1;
    float *x = (float *)malloc(sizeof(float) * (size_t)(run_cap * n + W));
    if (x == NULL) return 1;
    for (int64_t t = 0; t < num_tokens;) {
        if (a->kv == KV_INT8) { /* a run: slots that follow one another in one block */
            int64_t count = 1;
            while (t + count < num_tokens && slot_mapping[t + count] == slot_mapping[t] + count &&
                   slot_mapping[t + count] % bs != 0)
                ++count;
            for (int64_t r = 0; r < count; ++r) load_new_row(a, rows, stride, t + r, n, x + r * n);
            write_int8_run(a, (int8_t *)cache, scales, x, count, slot_mapping[t]);
            t += count;
            continue;
        }
        load_new_row(a, rows, stride, t, n, x);
        char *dst = cache + slot_mapping[t] * n * kv_esize(a->kv);
        if (a->kv == KV_BF16) {
            for (int64_t i = 0; i < n; i += W) vstore_bf16((uint16_t *)dst + i, vload(x + i, n - i), n - i);
        } else if (a->kv == KV_F32) {
            memcpy(dst, x, (size_t)n * sizeof(float));
        } else {
            for (int64_t i = 0; i < n; ++i) ((uint8_t *)dst)[i] = f32_to_fp8(x[i] / fp8_scale, a->kv);
        }
        ++t;
    }
    free(x);
    return 0;
}

/* Cache row slot_mapping[t] of each KV cache = new row t (all KV heads), in the cache's format; 1 when
 * scratch memory cannot be allocated. */
static int write_kv(const Args *a, int64_t num_tokens, const void *k_new, int64_t k_stride, const void *v_new,
                    int64_t v_stride, const int64_t *slot_mapping) {
    if (write_cache(a, (char *)a->k_cache, a->k_scales, a->k_scale, num_tokens, k_new, k_stride, slot_mapping))
        return 1;
    return write_cache(a, (char *)a->v_cache, a->v_scales, a->v_scale, num_tokens, v_new, v_stride, slot_mapping);
}

#endif /* PAGED_ATTENTION_WRITE_H */
