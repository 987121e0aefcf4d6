/* Fused multi-LoRA shrink + expand on CPU, for float32 or bfloat16, loaded through ctypes by cpu_ops.py.
 *
 * Semantics (the pure-torch twin is torch_ops.add_lora): for every active token p of the step
 * (token_ids[p], grouped into segments of one slot each) and every slice q of the layer (packed
 * qkv / gate_up have several, a plain layer one), with s the segment's slot and r = ranks[s, q]:
 *     t = A[s, q*R : q*R + r, :] @ x[token]                                        (shrink)
 *     y[token, off[q] : off[q+1]] += t @ Bt[s, q*R : q*R + r, off[q] : off[q+1]]   (expand)
 * A is [L, n*R, in] and Bt is [L, n*R, out], both contiguous: the block-diagonal slot buffers of
 * LinearWithLoRA. Only their non-zero blocks are read (never the off-diagonal zeros of a packed
 * layer, never the rows past an adapter's rank), so a decode step streams each adapter's weights
 * from memory once. x, y, A and Bt share one element type. In bfloat16, products are summed in
 * float32, t stays float32, and each element of y is rounded back to bf16 once (to nearest even).
 *
 * Why a kernel: a decode step with many adapters is memory-bound (16 adapters x 2 tokens read
 * ~300 MB of adapter weights per step for a 135M model), and torch's bmm path reads the zero
 * blocks too and pays ~10 dispatches per layer. Work is split over OpenMP threads; the library is
 * loaded after torch, so it shares torch's libgomp and its thread pool.
 *
 * Built with -march=native (loraserve/native/build.py), so the feature macros pick the code:
 * float32 runs AVX2 + FMA or scalar code; bfloat16 runs AVX-512 (vdpbf16ps dot products where the
 * CPU has AVX512-BF16, else bf16 -> fp32 widening and fp32 FMAs), AVX2, or scalar code.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LORA_AVX512 1 /* bf16: 32 values per vector, tails through masked loads and stores */
#endif

#define CHUNK 256 /* expand columns per work item: a [rank, CHUNK] block of Bt stays in L1 */

enum { LORA_F32 = 0, LORA_BF16 = 1 }; /* element type of x, y, A and Bt (and of a write record) */
typedef uint16_t bf16;

/* *out0 = a . x0 and, when x1 is not NULL, *out1 = a . x1: the row of A is read once for both. */
static void dot2(const float *a, const float *x0, const float *x1, int64_t n, float *out0, float *out1) {
    int64_t j = 0;
    float r0 = 0.0f, r1 = 0.0f;
#ifdef LORA_AVX2
    __m256 s0[4], s1[4];
    for (int u = 0; u < 4; ++u) s0[u] = s1[u] = _mm256_setzero_ps();
    for (; j + 32 <= n; j += 32) {
        for (int u = 0; u < 4; ++u) {
            const __m256 av = _mm256_loadu_ps(a + j + 8 * u);
            s0[u] = _mm256_fmadd_ps(av, _mm256_loadu_ps(x0 + j + 8 * u), s0[u]);
            if (x1) s1[u] = _mm256_fmadd_ps(av, _mm256_loadu_ps(x1 + j + 8 * u), s1[u]);
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0[0], s0[1]), _mm256_add_ps(s0[2], s0[3])));
    for (int u = 0; u < 8; ++u) r0 += lanes[u];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s1[0], s1[1]), _mm256_add_ps(s1[2], s1[3])));
    for (int u = 0; u < 8; ++u) r1 += lanes[u];
#endif
    for (; j < n; ++j) {
        r0 += a[j] * x0[j];
        if (x1) r1 += a[j] * x1[j];
    }
    *out0 = r0;
    if (x1) *out1 = r1;
}

/* y[j] += sum_k t[k] * b[k * ld + j] for j < width: the block of b is read once per token. */
static void axpy_block(float *y, const float *t, const float *b, int64_t ld, int64_t rank, int64_t width) {
    int64_t j = 0;
#ifdef LORA_AVX2
    for (; j + 32 <= width; j += 32) {
        __m256 c[4];
        for (int u = 0; u < 4; ++u) c[u] = _mm256_loadu_ps(y + j + 8 * u);
        for (int64_t k = 0; k < rank; ++k) {
            const __m256 coef = _mm256_broadcast_ss(t + k);
            const float *row = b + k * ld + j;
            for (int u = 0; u < 4; ++u) c[u] = _mm256_fmadd_ps(coef, _mm256_loadu_ps(row + 8 * u), c[u]);
        }
        for (int u = 0; u < 4; ++u) _mm256_storeu_ps(y + j + 8 * u, c[u]);
    }
#endif
    for (; j < width; ++j) {
        float acc = y[j];
        for (int64_t k = 0; k < rank; ++k) acc += t[k] * b[k * ld + j];
        y[j] = acc;
    }
}

static inline float bf16_to_f32(bf16 v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; a NaN stays a (quiet) NaN instead of rounding into inf. */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16)((u | 0x400000u) >> 16);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Vector bf16 <-> fp32: a 32-bit lane holds values 2i (low half) and 2i+1 (high half); widening
 * each half in place is one shift or one mask, and sums and axpys do not care about the order. */
#ifdef LORA_AVX512
static inline __m512 widen_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 widen_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* f32_to_bf16 of each lane, the result in the lane's high half. */
static inline __m512i round_high(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
}
/* The inverse of widen_even / widen_odd: 32 bf16 values. */
static inline __m512i narrow(__m512 even, __m512 odd) {
    return _mm512_or_si512(_mm512_srli_epi32(round_high(even), 16),
                           _mm512_and_si512(round_high(odd), _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* acc += the pairwise products of 32 bf16 values, in float32. */
static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    return _mm512_fmadd_ps(widen_even(a), widen_even(b), _mm512_fmadd_ps(widen_odd(a), widen_odd(b), acc));
#endif
}
static inline __mmask32 tail_mask(int64_t n) { /* the first min(n, 32) lanes (none when n <= 0) */
    return n >= 32 ? 0xFFFFFFFFu : (n <= 0 ? 0u : (1u << n) - 1u);
}
#elif defined(LORA_AVX2)
static inline __m256 widen_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 widen_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256i round_high(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
}
static inline __m256i narrow(__m256 even, __m256 odd) {
    return _mm256_or_si256(_mm256_srli_epi32(round_high(even), 16),
                           _mm256_and_si256(round_high(odd), _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256 dot_pairs(__m256 acc, __m256i a, __m256i b) {
    return _mm256_fmadd_ps(widen_even(a), widen_even(b), _mm256_fmadd_ps(widen_odd(a), widen_odd(b), acc));
}
static inline float sum8(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

/* dot2 for bf16 rows: float32 sums. */
static void dot2_bf16(const bf16 *a, const bf16 *x0, const bf16 *x1, int64_t n, float *out0, float *out1) {
    int64_t j = 0;
    float r0 = 0.0f, r1 = 0.0f;
#if defined(LORA_AVX512)
    __m512 s0[4], s1[4]; /* 4 sums per token: the dot products' latency, not their count, bounds a row */
    for (int u = 0; u < 4; ++u) s0[u] = s1[u] = _mm512_setzero_ps();
    for (; j + 128 <= n; j += 128) {
        for (int u = 0; u < 4; ++u) {
            const __m512i av = _mm512_loadu_si512(a + j + 32 * u);
            s0[u] = dot_pairs(s0[u], av, _mm512_loadu_si512(x0 + j + 32 * u));
            if (x1) s1[u] = dot_pairs(s1[u], av, _mm512_loadu_si512(x1 + j + 32 * u));
        }
    }
    for (; j < n; j += 32) {
        const __mmask32 m = tail_mask(n - j);
        const __m512i av = _mm512_maskz_loadu_epi16(m, a + j);
        s0[0] = dot_pairs(s0[0], av, _mm512_maskz_loadu_epi16(m, x0 + j));
        if (x1) s1[0] = dot_pairs(s1[0], av, _mm512_maskz_loadu_epi16(m, x1 + j));
    }
    r0 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0[0], s0[1]), _mm512_add_ps(s0[2], s0[3])));
    r1 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s1[0], s1[1]), _mm512_add_ps(s1[2], s1[3])));
#elif defined(LORA_AVX2)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m256i av = _mm256_loadu_si256((const __m256i *)(a + j));
        s0 = dot_pairs(s0, av, _mm256_loadu_si256((const __m256i *)(x0 + j)));
        if (x1) s1 = dot_pairs(s1, av, _mm256_loadu_si256((const __m256i *)(x1 + j)));
    }
    r0 = sum8(s0);
    r1 = sum8(s1);
#endif
    for (; j < n; ++j) {
        const float av = bf16_to_f32(a[j]);
        r0 += av * bf16_to_f32(x0[j]);
        if (x1) r1 += av * bf16_to_f32(x1[j]);
    }
    *out0 = r0;
    if (x1) *out1 = r1;
}

/* axpy_block for bf16 y and b: y is widened once, summed over the rank in float32, rounded once. */
static void axpy_block_bf16(bf16 *y, const float *t, const bf16 *b, int64_t ld, int64_t rank, int64_t width) {
    int64_t j = 0;
#if defined(LORA_AVX512)
    for (; j < width; j += 128) { /* 8 sums of 16 lanes: enough independent FMAs to fill the pipes */
        __mmask32 m[4];
        __m512 c[8];
        for (int u = 0; u < 4; ++u) {
            m[u] = tail_mask(width - j - 32 * u);
            const __m512i yv = _mm512_maskz_loadu_epi16(m[u], y + j + 32 * u);
            c[2 * u] = widen_even(yv);
            c[2 * u + 1] = widen_odd(yv);
        }
        for (int64_t k = 0; k < rank; ++k) {
            const __m512 coef = _mm512_set1_ps(t[k]);
            for (int u = 0; u < 4; ++u) {
                const __m512i bv = _mm512_maskz_loadu_epi16(m[u], b + k * ld + j + 32 * u);
                c[2 * u] = _mm512_fmadd_ps(coef, widen_even(bv), c[2 * u]);
                c[2 * u + 1] = _mm512_fmadd_ps(coef, widen_odd(bv), c[2 * u + 1]);
            }
        }
        for (int u = 0; u < 4; ++u) _mm512_mask_storeu_epi16(y + j + 32 * u, m[u], narrow(c[2 * u], c[2 * u + 1]));
    }
#elif defined(LORA_AVX2)
    for (; j + 32 <= width; j += 32) {
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(y + j));
        const __m256i y1 = _mm256_loadu_si256((const __m256i *)(y + j + 16));
        __m256 c[4] = {widen_even(y0), widen_odd(y0), widen_even(y1), widen_odd(y1)};
        for (int64_t k = 0; k < rank; ++k) {
            const __m256 coef = _mm256_broadcast_ss(t + k);
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(b + k * ld + j));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + k * ld + j + 16));
            c[0] = _mm256_fmadd_ps(coef, widen_even(b0), c[0]);
            c[1] = _mm256_fmadd_ps(coef, widen_odd(b0), c[1]);
            c[2] = _mm256_fmadd_ps(coef, widen_even(b1), c[2]);
            c[3] = _mm256_fmadd_ps(coef, widen_odd(b1), c[3]);
        }
        _mm256_storeu_si256((__m256i *)(y + j), narrow(c[0], c[1]));
        _mm256_storeu_si256((__m256i *)(y + j + 16), narrow(c[2], c[3]));
    }
#endif
    for (; j < width; ++j) {
        float acc = bf16_to_f32(y[j]);
        for (int64_t k = 0; k < rank; ++k) acc += t[k] * bf16_to_f32(b[k * ld + j]);
        y[j] = f32_to_bf16(acc);
    }
}

/* A slot's rank for one slice, clamped to [0, max_rank] so no value can index past the buffers. */
static inline int64_t slice_rank(const int32_t *ranks, int64_t index, int64_t max_rank) {
    const int64_t rank = ranks[index];
    return rank < 0 ? 0 : (rank > max_rank ? max_rank : rank);
}

/* t[p * ld] = a_row . x[token p] for the tokens p of one segment, two per pass (a_row read once). */
static void shrink_row(int elem, const void *a_row, const void *x, int64_t x_stride, int64_t in_features,
                       const int64_t *token_ids, int64_t start, int64_t len, float *t, int64_t ld) {
    for (int64_t m = 0; m < len; m += 2) {
        const int64_t p = start + m, x0 = token_ids[p] * x_stride;
        const int64_t x1 = m + 1 < len ? token_ids[p + 1] * x_stride : -1;
        float *t0 = t + p * ld, *t1 = x1 >= 0 ? t0 + ld : NULL;
        if (elem == LORA_BF16) {
            const bf16 *xs = (const bf16 *)x;
            dot2_bf16((const bf16 *)a_row, xs + x0, x1 >= 0 ? xs + x1 : NULL, in_features, t0, t1);
        } else {
            const float *xs = (const float *)x;
            dot2((const float *)a_row, xs + x0, x1 >= 0 ? xs + x1 : NULL, in_features, t0, t1);
        }
    }
}

/* Returns 0 on success, 1 when the scratch buffer cannot be allocated (nothing written then).
 * `elem` is LORA_F32 or LORA_BF16, the type of x, y, a and bt. The caller guarantees: token_ids <
 * rows of x and y, seg_slots < L, slice offsets increasing from 0 to out_features (cpu_ops.py
 * checks all three). */
int lora_fused(int elem, const void *x, int64_t x_stride, void *y, int64_t y_stride, int64_t in_features,
               int64_t out_features, const void *a, const void *bt, int64_t max_rank, int64_t num_slices,
               const int64_t *slice_offsets, const int32_t *ranks, const int64_t *token_ids,
               const int64_t *seg_slots, const int64_t *seg_starts, const int64_t *seg_lens, int64_t num_segs,
               int64_t num_active, int num_threads) {
    const int64_t stacked_rank = num_slices * max_rank, size = elem == LORA_BF16 ? 2 : 4;
    float *t = (float *)malloc(sizeof(float) * (size_t)(num_active > 0 ? num_active : 1) * stacked_rank);
    if (t == NULL) return 1;
    int64_t chunks_per_seg = 0;
    for (int64_t q = 0; q < num_slices; ++q)
        chunks_per_seg += (slice_offsets[q + 1] - slice_offsets[q] + CHUNK - 1) / CHUNK;
    const int64_t shrink_items = num_segs * stacked_rank, expand_items = num_segs * chunks_per_seg;

#pragma omp parallel num_threads(num_threads)
    {
        /* Shrink: an item is one row of A (segment, slice, k) against the segment's tokens. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink_items; ++item) {
            const int64_t seg = item / stacked_rank, row = item % stacked_rank, slot = seg_slots[seg];
            if (row % max_rank >= slice_rank(ranks, slot * num_slices + row / max_rank, max_rank)) continue;
            const char *a_row = (const char *)a + size * (slot * stacked_rank + row) * in_features;
            shrink_row(elem, a_row, x, x_stride, in_features, token_ids, seg_starts[seg], seg_lens[seg],
                       t + row, stacked_rank);
        }
        /* Expand: an item is one column chunk of one slice, for one segment's tokens. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < expand_items; ++item) {
            const int64_t seg = item / chunks_per_seg, slot = seg_slots[seg];
            int64_t chunk = item % chunks_per_seg, q = 0;
            for (;; ++q) {
                const int64_t n = (slice_offsets[q + 1] - slice_offsets[q] + CHUNK - 1) / CHUNK;
                if (chunk < n) break;
                chunk -= n;
            }
            const int64_t rank = slice_rank(ranks, slot * num_slices + q, max_rank);
            if (rank == 0) continue;
            const int64_t col = slice_offsets[q] + chunk * CHUNK;
            const int64_t width = slice_offsets[q + 1] - col < CHUNK ? slice_offsets[q + 1] - col : CHUNK;
            const int64_t block = (slot * stacked_rank + q * max_rank) * out_features + col;
            for (int64_t p = seg_starts[seg]; p < seg_starts[seg] + seg_lens[seg]; ++p) {
                const int64_t y_at = token_ids[p] * y_stride + col;
                const float *tp = t + p * stacked_rank + q * max_rank;
                if (elem == LORA_BF16)
                    axpy_block_bf16((bf16 *)y + y_at, tp, (const bf16 *)bt + block, out_features, rank, width);
                else
                    axpy_block((float *)y + y_at, tp, (const float *)bt + block, out_features, rank, width);
            }
        }
    }
    free(t);
    return 0;
}

/* dst[j] = scale * src[j * src_cs] (src NULL: 0) for j0 <= j < j1, in float32 then rounded for bf16. */
static void write_row(int elem, void *dst, const void *src, int64_t src_cs, int64_t j0, int64_t j1, float scale) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4;
    if (src == NULL) {
        memset((char *)dst + size * j0, 0, (size_t)(size * (j1 - j0)));
    } else if (elem == LORA_BF16) {
        bf16 *d = (bf16 *)dst;
        const bf16 *s = (const bf16 *)src;
        for (int64_t j = j0; j < j1; ++j) d[j] = f32_to_bf16(scale * bf16_to_f32(s[j * src_cs]));
    } else if (src_cs == 1) {
        float *d = (float *)dst;
        const float *s = (const float *)src;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j];
    } else {
        float *d = (float *)dst;
        const float *s = (const float *)src;
        for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j * src_cs];
    }
}

/* Slot writes of one adapter activation, in one call: for each record r of 8 int64 values
 *     (dst, dst_ld, src, src_row_stride, src_col_stride, rows, cols, elem)
 * set dst[i * dst_ld + j] = scales[r] * src[i * src_row_stride + j * src_col_stride] for i < rows,
 * j < cols, or 0 when src is NULL; dst and src are both of type `elem` (LORA_F32 or LORA_BF16),
 * strides in elements. A transposed source (B^T into the slot's [rank, out] rows) is read in column
 * blocks so each block of it stays in L1. Replaces ~3 torch ops per module. */
void lora_write_blocks(int64_t num_records, const int64_t *records, const float *scales, int num_threads) {
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t r = 0; r < num_records; ++r) {
        const int64_t *rec = records + 8 * r;
        const int elem = (int)rec[7];
        const int64_t size = elem == LORA_BF16 ? 2 : 4;
        char *dst = (char *)(intptr_t)rec[0];
        const char *src = (const char *)(intptr_t)rec[2];
        const int64_t dst_ld = rec[1], src_rs = rec[3], src_cs = rec[4], rows = rec[5], cols = rec[6];
        for (int64_t j0 = 0; j0 < cols; j0 += 64) {
            const int64_t j1 = j0 + 64 < cols ? j0 + 64 : cols;
            for (int64_t i = 0; i < rows; ++i)
                write_row(elem, dst + size * i * dst_ld, src == NULL ? NULL : src + size * i * src_rs, src_cs,
                          j0, j1, scales[r]);
        }
    }
}

/* The vector code paths compiled into this build (its -march=native decides): bit 0 AVX2 + FMA,
 * bit 1 AVX-512 F + BW (bf16), bit 2 AVX512-BF16 dot products; 0 is the portable C alone. */
int lora_code_paths(void) {
    int paths = 0;
#ifdef LORA_AVX2
    paths |= 1;
#endif
#ifdef LORA_AVX512
    paths |= 2;
#ifdef __AVX512BF16__
    paths |= 4;
#endif
#endif
    return paths;
}
