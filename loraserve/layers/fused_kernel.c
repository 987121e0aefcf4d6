/* Fused elementwise ops of a decoder layer on CPU, loaded through ctypes by fused_ops.py.
 *
 * Each op replaces 4-12 torch ops (and their temporaries) with one pass over the rows. The torch
 * twins in fused_ops.py define the semantics; for bfloat16 this file rounds to bf16 at the same
 * points the twins do (each torch op's result is a bf16 tensor), so results match them up to float
 * summation order and the exp approximation (< 2 ulp of float32).
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16). Rows are [num_rows, width] with a row
 * stride in elements; the column stride is 1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MIN_PARALLEL_ELEMS 65536 /* below this an OpenMP fork costs more than the work */

static inline float bf16_load(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_as(float f, int dtype) { return dtype ? bf16_load(bf16_round(f)) : f; }

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

/* exp(x) for x in float32, vectorizable: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2]. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Semantics: out[t, j] = silu(x[t, j]) * x[t, width + j] for j < width (x holds gate then up).
 * Shape: x [rows, 2*width] (row stride x_ld), out [rows, width] (row stride out_ld). */
void silu_and_mul(const void *x, int64_t x_ld, void *out, int64_t out_ld, int64_t rows, int64_t width,
                  int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * width >= MIN_PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; ++t) {
        if (dtype == 0) {
            const float *g = (const float *)x + t * x_ld, *u = g + width;
            float *o = (float *)out + t * out_ld;
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) o[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
        } else {
            const uint16_t *g = (const uint16_t *)x + t * x_ld, *u = g + width;
            uint16_t *o = (uint16_t *)out + t * out_ld;
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) {
                const float gv = bf16_load(g[j]);
                const float s = bf16_load(bf16_round(gv / (1.0f + exp_approx(-gv))));
                o[j] = bf16_round(s * bf16_load(u[j]));
            }
        }
    }
}

/* Semantics: when residual is not NULL, residual[t] = x[t] + residual[t] first (rounded to dtype)
 * and the norm reads it; then out[t] = weight * (h * rsqrt(mean(h^2) + eps)) with h the row in
 * float32, the normalized row rounded to dtype before the weight product (as transformers does).
 * Shape: x, residual, out [rows, width] (row strides x_ld, res_ld, out_ld); weight [width].
 * out may alias x. */
void rms_norm(const void *x, int64_t x_ld, void *residual, int64_t res_ld, void *out, int64_t out_ld,
              const void *weight, int64_t rows, int64_t width, float eps, int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * width >= MIN_PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; ++t) {
        const void *src = x;
        int64_t src_off = t * x_ld;
        if (residual != NULL) {
            for (int64_t j = 0; j < width; ++j)
                store(residual, t * res_ld + j, load(x, t * x_ld + j, dtype) + load(residual, t * res_ld + j, dtype),
                      dtype);
            src = residual;
            src_off = t * res_ld;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < width; ++j) {
            const float v = load(src, src_off + j, dtype);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t j = 0; j < width; ++j) {
            const float h = round_as(load(src, src_off + j, dtype) * inv, dtype);
            store(out, t * out_ld + j, load(weight, j, dtype) * h, dtype);
        }
    }
}

/* Semantics: rope with the half-split layout on the first num_heads heads of every row, in place:
 * for i < D/2, with c = cos[pos][i], s = sin[pos][i] (the tables are float32 and are rounded to
 * dtype first, as the twin's `.to(q.dtype)` does):
 *     x[i]       = x[i] * c - x[i + D/2] * s
 *     x[i + D/2] = x[i + D/2] * c + x[i] * s          (old values on the right, each product rounded)
 * Shape: x [rows, >= num_heads * head_dim] (row stride x_ld); positions [rows] int64;
 * cos/sin [max_positions, head_dim] float32 (the second half repeats the first). */
void rotary_inplace(void *x, int64_t x_ld, const int64_t *positions, const float *cos_table,
                    const float *sin_table, int64_t rows, int64_t num_heads, int64_t head_dim, int dtype,
                    int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * num_heads * head_dim >= MIN_PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t base = t * x_ld + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float ci = round_as(c[i], dtype), si = round_as(s[i], dtype);
                const float a = load(x, base + i, dtype), b = load(x, base + half + i, dtype);
                const float new_a = round_as(a * ci, dtype) + round_as(-b * si, dtype);
                const float new_b = round_as(b * ci, dtype) + round_as(a * si, dtype);
                store(x, base + i, new_a, dtype);
                store(x, base + half + i, new_b, dtype);
            }
        }
    }
}
