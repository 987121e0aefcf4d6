/* The activations' side of quant_kernel.c's decode path: x's rows quantized to int8 once per product,
 * in the two granularities the formats read them in, and the scratch that holds them.
 *
 * Per 32 values (Q8_0, Q4_0, Q4_1, whose weight scales are per 32 too): q = round(v / d), d = amax /
 * 127, as llama.cpp's q8_0; dxs = d * sum(q) carries Q4_1's min term; the bytes permuted pair by pair
 * as the row layouts read them (quant_kernel_rows.h).
 * Per 256 values (the K-quants, llama.cpp's q8_K): one d per super-block, so a super-block's integer
 * dot products, each sub-block's times its small integer weight scale, add up in int32 to its end and
 * take one float multiply there; `bs` holds the sums of q per 16 values, which the K-quants' min and
 * offset terms need.
 * With `two` (float32 x, LORASERVE_CPU_QUANT_ACT_LEVELS=2) a second level quantizes what the first
 * leaves, v - d q, in units of d / 256 (at most 128: clamped to 127), so v = d / 256 * (256 q + q2) to
 * within amax / 32512 instead of amax / 254.
 * Included by quant_kernel.c after simd.h. */
#ifndef LORASERVE_QUANT_KERNEL_ACT_H
#define LORASERVE_QUANT_KERNEL_ACT_H

typedef struct {
    int64_t nb; /* 32-blocks per row of x */
    /* per 32 values, when a part reads them (else NULL) */
    const int8_t *xq, *xq2; /* [m][k] */
    const float *dx;        /* [m][k / 32]: d (d / 256, xq2's unit, with two levels) */
    const float *dxs;       /* [m][k / 32]: dx * the block's sum of its quants (256 q + q2 with two) */
    /* per 256 values, when a part reads them (else NULL) */
    const int8_t *kq, *kq2;   /* [m][k] */
    const float *dk;          /* [m][k / 256]: d of the first level (the second's unit is d / 256) */
    const int16_t *bs, *bs2;  /* [m][k / 16]: sums of kq (kq2) per 16 values */
} qx_t;

#if QK_PATH > 0
/* 8 values of x (float32 or bf16) from x[at] as float32. */
static inline __attribute__((always_inline)) __m256 load8_x(const void *x, int64_t at, int x_bf16) {
    if (!x_bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* quantize_group at one level, 16 values a step: the same q, d and sums (v * inv rounds to nearest even
 * in vcvtps2dq as nearbyintf does in the default rounding mode; a NaN is skipped by the amax as there). */
static inline int32_t quantize_group_vec(const void *x, int64_t at, int x_bf16, int64_t len, int8_t *q, float *d_out,
                                         int16_t *sum16) {
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8)
        amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8_x(x, at + i, x_bf16)), amax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = a / 127.0f, inv = d > 0.0f ? 127.0f / a : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    int32_t total = 0;
    for (int64_t s = 0; s < len; s += 16) {
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, at + s, x_bf16), vinv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, at + s + 8, x_bf16), vinv));
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8); /* 16 int16 in order */
        _mm_storeu_si128((__m128i *)(q + s), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(i0, i1)),
                                  _mm256_extracti128_si256(_mm256_add_epi32(i0, i1), 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
        if (sum16 != NULL) sum16[s / 16] = (int16_t)sum;
        total += sum;
    }
    *d_out = d;
    return total;
}
#endif

/* One 32- or 256-value group of x (float32 or bf16) as int8: q (and q2 with `two`), its d, the sums of
 * q over its 16-value pieces (sum16, NULL: not kept) and the group's whole sum of 256 q + q2 (or q). */
static inline int32_t quantize_group(const void *x, int64_t at, int x_bf16, int64_t len, int8_t *q, int8_t *q2,
                                     float *d_out, int16_t *sum16, int16_t *sum16_2) {
#if QK_PATH > 0
    if (q2 == NULL) return quantize_group_vec(x, at, x_bf16, len, q, d_out, sum16);
#endif
    float v[256], amax = 0.0f;
    for (int64_t i = 0; i < len; i++) {
        v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + i]) : ((const float *)x)[at + i];
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, inv = d > 0.0f ? 127.0f / amax : 0.0f;
    int32_t total = 0;
    for (int64_t s = 0; s < len; s += 16) {
        int32_t sum = 0, sum2 = 0;
        for (int64_t i = s; i < s + 16; i++) {
            const int32_t qi = (int32_t)nearbyintf(v[i] * inv);
            q[i] = (int8_t)qi, sum += qi;
            if (q2 != NULL) {
                float r = nearbyintf((v[i] - d * (float)qi) * (inv * 256.0f));
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                q2[i] = (int8_t)r, sum2 += (int32_t)r;
            }
        }
        if (sum16 != NULL) sum16[s / 16] = (int16_t)sum;
        if (sum16_2 != NULL) sum16_2[s / 16] = (int16_t)sum2;
        total += q2 != NULL ? 256 * sum + sum2 : sum;
    }
    *d_out = d;
    return total;
}

/* The bytes of a pair of quantized blocks [b 0-31, b+1 0-31] in the row layouts' order: b 0-15,
 * b+1 0-15, b 16-31, b+1 16-31 (quant_kernel_rows.h reads a pair's weights so). */
static inline void pair_order(const int8_t *t, int8_t *out) {
    memcpy(out, t, 16), memcpy(out + 16, t + 32, 16), memcpy(out + 32, t + 16, 16), memcpy(out + 48, t + 48, 16);
}

/* Row r of x (k values) per 32: xq (xq2) permuted pair by pair as the row layouts read it (an odd row's
 * last block in order), dx and dxs of that row in block order. */
static void quantize_row32(const void *x, int64_t ldx, int x_bf16, int64_t r, int64_t k, int8_t *xq, int8_t *xq2,
                           float *dx, float *dxs) {
    const int64_t nb = k / 32;
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t count = b + 1 < nb ? 2 : 1;
        int8_t t[64], t2[64];
        for (int64_t h = 0; h < count; h++) {
            float d;
            const int32_t sum = quantize_group(x, r * ldx + (b + h) * 32, x_bf16, 32, t + 32 * h,
                                               xq2 == NULL ? NULL : t2 + 32 * h, &d, NULL, NULL);
            dx[b + h] = xq2 != NULL ? d / 256.0f : d, dxs[b + h] = dx[b + h] * (float)sum;
        }
        if (count == 1) {
            memcpy(xq + b * 32, t, 32);
            if (xq2 != NULL) memcpy(xq2 + b * 32, t2, 32);
        } else {
            pair_order(t, xq + b * 32);
            if (xq2 != NULL) pair_order(t2, xq2 + b * 32);
        }
    }
}

/* Row r of x (k values, a multiple of 256) per 256: kq (kq2), dk, bs (bs2) of that row. */
static void quantize_row256(const void *x, int64_t ldx, int x_bf16, int64_t r, int64_t k, int8_t *kq, int8_t *kq2,
                            float *dk, int16_t *bs, int16_t *bs2) {
    for (int64_t sb = 0; sb < k / 256; sb++)
        (void)quantize_group(x, r * ldx + sb * 256, x_bf16, 256, kq + sb * 256, kq2 == NULL ? NULL : kq2 + sb * 256,
                             dk + sb, bs + sb * 16, bs2 == NULL ? NULL : bs2 + sb * 16);
}

/* The calling thread's scratch number `slot` (0: quantized activations for the row streaming, 1: the
 * panels of a chunk, 2: activations in weight order for the panels), kept
 * between calls (a decode step makes a few hundred products: a malloc and free each, and fresh pages for
 * larger ones, cost more than quantizing). */
static void *thread_scratch(int slot, size_t bytes) {
    static __thread void *buf[4] = {NULL, NULL, NULL, NULL};
    static __thread size_t size[4] = {0, 0, 0, 0};
    if (bytes > size[slot]) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        size[slot] = buf[slot] == NULL ? 0 : bytes;
    }
    return buf[slot];
}

/* Quantize x [m, k] for the granularities asked for into the thread's scratch; 0, or 2 without memory. */
static int quantize_x(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k, int two, int need32,
                      int need256, qx_t *qx) {
    const int64_t nb = k / 32, levels = two ? 2 : 1;
    /* rounded up to 64 bytes: the per-256 part's floats start aligned */
    const size_t bytes32 = need32 ? (size_t)((levels * m * k + 2 * m * nb * (int64_t)sizeof(float) + 63) / 64 * 64) : 0;
    const size_t bytes256 =
        need256 ? (size_t)(levels * m * k + m * (k / 256) * (int64_t)sizeof(float) + levels * m * (k / 16) * 2) : 0;
    char *buf = thread_scratch(0, bytes32 + bytes256 + 64);
    if (buf == NULL) return 2;
    memset(qx, 0, sizeof(*qx));
    qx->nb = nb;
    if (need32) {
        float *dx = (float *)buf, *dxs = dx + m * nb;
        int8_t *xq = (int8_t *)(dxs + m * nb), *xq2 = two ? xq + m * k : NULL;
        for (int64_t r = 0; r < m; r++)
            quantize_row32(x, ldx, x_bf16, r, k, xq + r * k, two ? xq2 + r * k : NULL, dx + r * nb, dxs + r * nb);
        qx->xq = xq, qx->xq2 = xq2, qx->dx = dx, qx->dxs = dxs;
        buf += bytes32;
    }
    if (need256) {
        float *dk = (float *)buf;
        int16_t *bs = (int16_t *)(dk + m * (k / 256)), *bs2 = two ? bs + m * (k / 16) : NULL;
        int8_t *kq = (int8_t *)(bs + levels * m * (k / 16)), *kq2 = two ? kq + m * k : NULL;
        for (int64_t r = 0; r < m; r++)
            quantize_row256(x, ldx, x_bf16, r, k, kq + r * k, two ? kq2 + r * k : NULL, dk + r * (k / 256),
                            bs + r * (k / 16), two ? bs2 + r * (k / 16) : NULL);
        qx->kq = kq, qx->kq2 = kq2, qx->dk = dk, qx->bs = bs, qx->bs2 = bs2;
    }
    return 0;
}

/* x rows quantized in weight order for the panels: per 32-block its d, d * sum(q), d * the sums of its
 * two 16-value halves. */
typedef struct {
    int64_t nb, k;
    const int8_t *xq; /* [m][k] */
    const float *dx, *xs, *xs16; /* [m][nb], [m][nb], [m][nb][2] */
    const int16_t *xi;           /* [m][nb]: sum(q) per 32-block (the K-quant panels' min term) */
    const int16_t *xi16;         /* [m][nb][2]: sum(q) per 16 values (Q6_K's panels' offset term) */
    const uint8_t *xu;           /* [m][k] or NULL (XU_ROWS): q + 128 per 256, for Q6_K's signed bytes */
} px_t;

/* From this many x rows px keeps x's 256-value quants + 128 too (xu: the unsigned side of Q6_K's
 * unpacked bytes, quant_kernel_kbytes.h, which unpacks chunks from as many rows); fewer rows, one
 * decode row among them, neither lay them out nor write them. */
#define XU_ROWS 9

/* Bytes of px's arrays for m rows of k values. */
static inline size_t panel_x_bytes(int64_t m, int64_t k) {
    const int64_t quants = (m >= XU_ROWS ? 2 : 1) * m * k;
    return (size_t)(quants + 4 * m * (k / 32) * (int64_t)sizeof(float) + 6 * m * (k / 32) + 64);
}

/* px's arrays for m rows of k values laid out in buf (quantize_panel_row fills them). */
static void panel_x_layout(int64_t m, int64_t k, char *buf, px_t *px) {
    const int64_t nb = k / 32;
    float *dx = (float *)buf, *xs = dx + m * nb, *xs16 = xs + m * nb;
    px->nb = nb, px->k = k, px->dx = dx, px->xs = xs, px->xs16 = xs16, px->xq = (const int8_t *)(xs16 + 2 * m * nb);
    px->xi = (const int16_t *)(px->xq + m * k), px->xi16 = px->xi + m * nb;
    px->xu = m >= XU_ROWS ? (const uint8_t *)(px->xi16 + 2 * m * nb) : NULL;
}

/* Row r of x quantized into px per `group` values (32, or 256 for the K-quants): the rows path's values. */
static void quantize_panel_row(const void *x, int64_t ldx, int x_bf16, int64_t r, int group, const px_t *px) {
    const int64_t nb = px->nb, k = px->k;
    float *dx = (float *)px->dx, *xs = (float *)px->xs, *xs16 = (float *)px->xs16;
    for (int64_t g = 0; g < k / group; g++) {
        int16_t sum16[16];
        float d;
        int8_t *q = (int8_t *)px->xq + r * k + g * group;
        (void)quantize_group(x, r * ldx + g * group, x_bf16, group, q, NULL, &d, sum16, NULL);
        if (group == 256 && px->xu != NULL)
            for (int v = 0; v < 256; v++) ((uint8_t *)px->xu)[r * k + g * 256 + v] = (uint8_t)(q[v] + 128);
        for (int64_t b = 0; b < group / 32; b++) {
            const int64_t i = r * nb + g * (group / 32) + b;
            ((int16_t *)px->xi)[i] = (int16_t)(sum16[2 * b] + sum16[2 * b + 1]);
            ((int16_t *)px->xi16)[2 * i] = sum16[2 * b], ((int16_t *)px->xi16)[2 * i + 1] = sum16[2 * b + 1];
            dx[i] = d, xs[i] = d * (float)(sum16[2 * b] + sum16[2 * b + 1]);
            xs16[2 * i] = d * (float)sum16[2 * b], xs16[2 * i + 1] = d * (float)sum16[2 * b + 1];
        }
    }
}

/* Rows [r0, r1) of x into px32 and / or px256 (those laid out: xq not NULL). */
static void quantize_panel_rows(const void *x, int64_t ldx, int x_bf16, int64_t r0, int64_t r1, const px_t *px32,
                                const px_t *px256) {
    for (int64_t r = r0; r < r1; r++) {
        if (px32->xq != NULL) quantize_panel_row(x, ldx, x_bf16, r, 32, px32);
        if (px256->xq != NULL) quantize_panel_row(x, ldx, x_bf16, r, 256, px256);
    }
}

/* px32 and / or px256 (as asked; the other zeroed) for m rows of k values laid out in the calling thread's
 * scratch, to be quantized in the parallel region (quantize_panel_row); 0, or 2 without memory. */
static int px_layout(int64_t m, int64_t k, int need32, int need256, px_t *px32, px_t *px256) {
    char *buf = thread_scratch(2, 2 * panel_x_bytes(m, k));
    if (buf == NULL) return 2;
    memset(px32, 0, sizeof(*px32)), memset(px256, 0, sizeof(*px256));
    if (need32) panel_x_layout(m, k, buf, px32);
    if (need256) panel_x_layout(m, k, buf + panel_x_bytes(m, k), px256);
    return 0;
}

#endif
