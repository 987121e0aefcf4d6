/* Fused elementwise ops of a decoder layer on CPU, loaded through ctypes by fused_cpu.py.
 *
 * Each op replaces 4-12 torch ops (and their temporaries) with one pass over the rows. The torch
 * twins in fused_cpu.py define the semantics; for bfloat16 this file rounds to bf16 at the same
 * points the twins do (each torch op's result is a bf16 tensor), so results match them up to float
 * summation order and the exp approximation (< 2 ulp of float32).
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16). Rows are [num_rows, width] with a row
 * stride in elements; the column stride is 1.
 */
#include "simd.h"

#define MIN_PARALLEL_ELEMS 65536 /* below this an OpenMP fork costs more than the work */
/* silu (an exp and a divide per element) and rope (two table rows): worth a fork sooner */
#define MIN_PARALLEL_HEAVY 16384

static inline float round_as(float f, int dtype) { return dtype ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* exp(x) for x in float32, vectorizable: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2]; the scalar
 * tails' twin of simd.h's vexp_pr (the same polynomial and clamp). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = nearbyintf(x * 1.44269504f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23}; /* 2^n, n in [-126, 127] */
    return p * scale.f;
}

#if W > 1 /* the portable build runs the scalar loops alone */
/* 2 * W bf16 values as float32 lanes with no cross-lane widening: even elements in *a, odd in *b;
 * vstore_bf16x2 puts them back. Elementwise ops do not care about the order. */
static inline void vload_bf16x2(const uint16_t *p, vf *a, vf *b) {
    const vi x = vi_loadu(p);
    *a = vbf16_even(x), *b = vbf16_odd(x);
}
/* bf16 rounding without the NaN fix: every NaN here was read from bf16 or made by arithmetic on
 * such values (see simd.h), so it keeps its high half. */
static inline vf vround_bf16_arith(vf v) {
    return vi_as_vf(vi_and(vbf16_round_hi_finite(v), vi_set1((int)0xffff0000u)));
}
static inline void vstore_bf16x2(uint16_t *p, vf a, vf b) {
    vi_storeu(p, vbf16_pack(vbf16_round_hi_finite(a), vbf16_round_hi_finite(b)));
}

static inline vf vsilu(vf g) { return vdiv(g, vadd(vset1(1.0f), vexp_pr(vmul(g, vset1(-1.0f))))); }

/* 2 * W elements from p + i as two vectors: consecutive halves for float32, even and odd
 * elements for bf16 (ops that pair them with other rows of the same dtype see the same order). */
static inline void vload2(const void *p, int64_t i, int dtype, vf *a, vf *b) {
    if (dtype) {
        vload_bf16x2((const uint16_t *)p + i, a, b);
    } else {
        *a = vload((const float *)p + i, W), *b = vload((const float *)p + i + W, W);
    }
}
static inline void vstore2(void *p, int64_t i, int dtype, vf a, vf b) {
    if (dtype) {
        vstore_bf16x2((uint16_t *)p + i, a, b);
    } else {
        vstore((float *)p + i, a, W), vstore((float *)p + i + W, b, W);
    }
}
static inline vf vround_as(vf v, int dtype) { return dtype ? vround_bf16_arith(v) : v; }
/* The lanes summed in order (not vhsum's tree): the row sums of rms_norm depend on this order. */
static inline float vsum(vf v) {
    float lanes[W], total = 0.0f;
    vstore(lanes, v, W);
    for (int i = 0; i < W; ++i) total += lanes[i];
    return total;
}
#endif

/* Semantics: out[t, j] = silu(x[t, j]) * x[t, width + j] for j < width (x holds gate then up).
 * Shape: x [rows, 2*width] (row stride x_ld), out [rows, width] (row stride out_ld). */
void silu_and_mul(const void *x, int64_t x_ld, void *out, int64_t out_ld, int64_t rows, int64_t width,
                  int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1 && rows * width >= MIN_PARALLEL_HEAVY)
    for (int64_t t = 0; t < rows; ++t) {
        int64_t j = 0;
        if (dtype == 0) {
            const float *g = (const float *)x + t * x_ld, *u = g + width;
            float *o = (float *)out + t * out_ld;
#if W > 1
            for (; j + W <= width; j += W) vstore(o + j, vmul(vsilu(vload(g + j, W)), vload(u + j, W)), W);
#endif
            for (; j < width; ++j) o[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
        } else {
            const uint16_t *g = (const uint16_t *)x + t * x_ld, *u = g + width;
            uint16_t *o = (uint16_t *)out + t * out_ld;
#if W > 1
            for (; j + 2 * W <= width; j += 2 * W) {
                vf g0, g1, u0, u1;
                vload_bf16x2(g + j, &g0, &g1);
                vload_bf16x2(u + j, &u0, &u1);
                vstore_bf16x2(o + j, vmul(vround_bf16_arith(vsilu(g0)), u0), vmul(vround_bf16_arith(vsilu(g1)), u1));
            }
#endif
            for (; j < width; ++j) {
                const float gv = bf16_to_f32(g[j]);
                const float s = bf16_to_f32(f32_to_bf16(gv / (1.0f + exp_approx(-gv))));
                o[j] = f32_to_bf16(s * bf16_to_f32(u[j]));
            }
        }
    }
}

/* One row of rms_norm (see below); dtype is a constant at each call site, so each dtype gets its own
 * vector loops. The vector loops take 2 * W columns at a time, the scalar ones the rest. */
__attribute__((always_inline)) static inline void rms_norm_row(const void *x, void *residual, void *out,
                                                               const void *weight, int64_t width, float eps,
                                                               int dtype) {
    const void *src = residual != NULL ? residual : x;
    float sum = 0.0f;
    int64_t j = 0;
#if W > 1
    vf acc0 = vset1(0.0f), acc1 = vset1(0.0f);
    for (; j + 2 * W <= width; j += 2 * W) {
        vf a, b;
        vload2(x, j, dtype, &a, &b);
        if (residual != NULL) {
            vf ra, rb;
            vload2(residual, j, dtype, &ra, &rb);
            a = vround_as(vadd(a, ra), dtype), b = vround_as(vadd(b, rb), dtype);
            vstore2(residual, j, dtype, a, b);
        }
        acc0 = vfma(a, a, acc0), acc1 = vfma(b, b, acc1);
    }
    sum = vsum(vadd(acc0, acc1));
#endif
    for (; j < width; ++j) {
        float v = load(x, j, dtype);
        if (residual != NULL) {
            v = round_as(v + load(residual, j, dtype), dtype);
            store(residual, j, v, dtype);
        }
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)width + eps);
    j = 0;
#if W > 1
    for (; j + 2 * W <= width; j += 2 * W) {
        vf a, b, wa, wb;
        vload2(src, j, dtype, &a, &b);
        vload2(weight, j, dtype, &wa, &wb);
        vstore2(out, j, dtype, vmul(wa, vround_as(vmul(a, vset1(inv)), dtype)), vmul(wb, vround_as(vmul(b, vset1(inv)), dtype)));
    }
#endif
    for (; j < width; ++j) store(out, j, load(weight, j, dtype) * round_as(load(src, j, dtype) * inv, dtype), dtype);
}

static inline const void *row_at(const void *p, int64_t row, int64_t ld, int dtype) {
    return (const char *)p + row * ld * (dtype ? 2 : 4);
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
        const void *xt = row_at(x, t, x_ld, dtype);
        void *rt = residual != NULL ? (void *)row_at(residual, t, res_ld, dtype) : NULL;
        void *ot = (void *)row_at(out, t, out_ld, dtype);
        if (dtype) rms_norm_row(xt, rt, ot, weight, width, eps, 1);
        else rms_norm_row(xt, rt, ot, weight, width, eps, 0);
    }
}

/* One head of rotary_inplace (see below) with the row's tables rounded to dtype and, for bf16, each
 * full 2 * W chunk of them in vload2's even/odd order. */
__attribute__((always_inline)) static inline void rotary_head(void *x, const float *c, const float *s, int64_t half,
                                                              int dtype) {
    int64_t i = 0;
#if W > 1
    for (; i + 2 * W <= half; i += 2 * W) {
        vf a0, a1, b0, b1;
        vload2(x, i, dtype, &a0, &a1);
        vload2(x, half + i, dtype, &b0, &b1);
        const vf c0 = vload(c + i, W), c1 = vload(c + i + W, W), s0 = vload(s + i, W), s1 = vload(s + i + W, W);
        vstore2(x, i, dtype, vsub(vround_as(vmul(a0, c0), dtype), vround_as(vmul(b0, s0), dtype)),
                vsub(vround_as(vmul(a1, c1), dtype), vround_as(vmul(b1, s1), dtype)));
        vstore2(x, half + i, dtype, vadd(vround_as(vmul(b0, c0), dtype), vround_as(vmul(a0, s0), dtype)),
                vadd(vround_as(vmul(b1, c1), dtype), vround_as(vmul(a1, s1), dtype)));
    }
#endif
    for (; i < half; ++i) {
        const float a = load(x, i, dtype), b = load(x, half + i, dtype);
        store(x, i, round_as(a * c[i], dtype) + round_as(-b * s[i], dtype), dtype);
        store(x, half + i, round_as(b * c[i], dtype) + round_as(a * s[i], dtype), dtype);
    }
}

/* dst[i] = src[i] rounded to dtype for i < n; for bf16 each full 2 * W chunk goes in vload2's
 * order (its even elements, then its odd ones). */
static inline void row_table(float *dst, const float *src, int64_t n, int dtype) {
    int64_t i = 0;
#if W > 1
    if (dtype)
        for (; i + 2 * W <= n; i += 2 * W)
            for (int64_t m = 0; m < W; ++m) {
                dst[i + m] = round_as(src[i + 2 * m], 1);
                dst[i + W + m] = round_as(src[i + 2 * m + 1], 1);
            }
#endif
    for (; i < n; ++i) dst[i] = round_as(src[i], dtype);
}

#define MAX_ROTARY_HALF 512 /* head_dim / 2 that the per-row table copy holds; wider heads round in place */

/* Semantics: rope with the half-split layout on the first num_heads heads of every row, in place:
 * for i < D/2, with c = cos[pos][i], s = sin[pos][i] (the tables are float32 and are rounded to
 * dtype first, as the twin's `.to(q.dtype)` does):
 *     x[i]       = x[i] * c - x[i + D/2] * s
 *     x[i + D/2] = x[i + D/2] * c + x[i] * s          (old values on the right, each product rounded)
 * Shape: x [rows, >= num_heads * head_dim] (row stride x_ld); positions [rows] int64;
 * cos/sin [num_positions, head_dim] float32 (the second half repeats the first).
 * Returns 0, or 1 (nothing written) when a position is outside the tables. */
int rotary_inplace(void *x, int64_t x_ld, const int64_t *positions, const float *cos_table,
                   const float *sin_table, int64_t num_positions, int64_t rows, int64_t num_heads,
                   int64_t head_dim, int dtype, int num_threads) {
    const int64_t half = head_dim / 2;
    if (half > MAX_ROTARY_HALF) return 2;
    for (int64_t t = 0; t < rows; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1 && rows * num_heads * head_dim >= MIN_PARALLEL_HEAVY)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        float c_row[MAX_ROTARY_HALF], s_row[MAX_ROTARY_HALF]; /* bf16: the row's tables rounded once for all its heads */
        if (dtype) {
            row_table(c_row, c, half, dtype), row_table(s_row, s, half, dtype);
            c = c_row, s = s_row;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            void *head = (char *)x + (t * x_ld + h * head_dim) * (dtype ? 2 : 4);
            if (dtype) rotary_head(head, c, s, half, 1);
            else rotary_head(head, c, s, half, 0);
        }
    }
    return 0;
}

/* Gemma's ops: the (1 + w) RMSNorm and GeGLU. Every row goes W columns at a time, the last chunk
 * masked (vload/vstore take a count), so one loop serves every width and build. */
#if W == 1
#define vexp_pr exp_approx /* the portable build's e^x: the same polynomial and clamp */
#endif

static inline vf load_w(const void *p, int64_t j, int64_t n, int dtype) {
    return dtype ? vload_bf16((const uint16_t *)p + j, n) : vload((const float *)p + j, n);
}
static inline void store_w(void *p, int64_t j, vf v, int64_t n, int dtype) {
    if (dtype) vstore_bf16((uint16_t *)p + j, v, n);
    else vstore((float *)p + j, v, n);
}
/* v rounded to dtype, as storing and loading it would. */
static inline vf round_w(vf v, int dtype) {
    if (!dtype) return v;
    uint16_t tmp[W];
    vstore_bf16(tmp, v, W);
    return vload_bf16(tmp, W);
}

/* Semantics: out = (h * rsqrt(mean(h^2) + eps) * scale).to(dtype) with h the row in float32, one
 * rounding at the end (Gemma's norm; scale = 1 + w in float32, which the caller keeps). mode 0: h is x;
 * mode 1: residual = x + residual first (rounded to dtype) and h is it; mode 2: h is x and residual
 * = residual + out (each rounded to dtype), out not written (the norm-then-add of Gemma-2's sandwich
 * norms). Shape: x, residual, out [rows, width] (row strides x_ld, res_ld, out_ld); scale [width]
 * float32. out may alias x. */
void offset_rms_norm(const void *x, int64_t x_ld, void *residual, int64_t res_ld, void *out, int64_t out_ld,
                     const float *scale, int64_t rows, int64_t width, float eps, int mode, int dtype,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * width >= MIN_PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; ++t) {
        const void *xt = row_at(x, t, x_ld, dtype);
        void *rt = residual != NULL ? (void *)row_at(residual, t, res_ld, dtype) : NULL;
        void *ot = (void *)row_at(out, t, out_ld, dtype);
        vf acc = vzero();
        for (int64_t j = 0; j < width; j += W) {
            const int64_t n = width - j;
            vf a = load_w(xt, j, n, dtype);
            if (mode == 1) {
                a = round_w(vadd(a, load_w(rt, j, n, dtype)), dtype);
                store_w(rt, j, a, n, dtype);
            }
            acc = vfma(a, a, acc);
        }
        const vf inv = vset1(1.0f / sqrtf(vhsum(acc) / (float)width + eps));
        const void *src = mode == 1 ? rt : xt;
        for (int64_t j = 0; j < width; j += W) {
            const int64_t n = width - j;
            const vf v = vmul(vmul(load_w(src, j, n, dtype), inv), vload(scale + j, n));
            if (mode == 2) store_w(rt, j, vadd(round_w(v, dtype), load_w(rt, j, n, dtype)), n, dtype);
            else store_w(ot, j, v, n, dtype);
        }
    }
}

/* Semantics: out[t, j] = gelu_tanh(x[t, j]) * x[t, width + j] (x holds gate then up), gelu_tanh(g) =
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) computed as g / (1 + exp(-2 sqrt(2 / pi) (g +
 * 0.044715 g^3))), the same value without tanh's cancellation near 0; the gelu rounded to dtype
 * before the product, as torch's two ops round. Shape: as silu_and_mul. */
void gelu_tanh_and_mul(const void *x, int64_t x_ld, void *out, int64_t out_ld, int64_t rows, int64_t width,
                       int dtype, int num_threads) {
    const int64_t elem = dtype ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1 && rows * width >= MIN_PARALLEL_HEAVY)
    for (int64_t t = 0; t < rows; ++t) {
        const char *g = (const char *)x + t * x_ld * elem, *u = g + width * elem;
        char *o = (char *)out + t * out_ld * elem;
        for (int64_t j = 0; j < width; j += W) {
            const int64_t n = width - j;
            const vf a = load_w(g, j, n, dtype);
            const vf z = vmul(vmul(a, vset1(-1.5957691216057308f)), vfma(vmul(a, a), vset1(0.044715f), vset1(1.0f)));
            const vf gelu = round_w(vdiv(a, vadd(vset1(1.0f), vexp_pr(z))), dtype);
            store_w(o, j, vmul(gelu, load_w(u, j, n, dtype)), n, dtype);
        }
    }
}
