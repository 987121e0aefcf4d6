/* Fused multi-LoRA shrink + expand for float32 on CPU, loaded through ctypes by cpu_ops.py.
 *
 * Semantics (the pure-torch twin is torch_ops.add_lora): for every active token p of the step
 * (token_ids[p], grouped into segments of one slot each) and every slice q of the layer (packed
 * qkv / gate_up have several, a plain layer one), with s the segment's slot and r = ranks[s, q]:
 *     t = A[s, q*R : q*R + r, :] @ x[token]                                        (shrink)
 *     y[token, off[q] : off[q+1]] += t @ Bt[s, q*R : q*R + r, off[q] : off[q+1]]   (expand)
 * A is [L, n*R, in] and Bt is [L, n*R, out], both contiguous: the block-diagonal slot buffers of
 * LinearWithLoRA. Only their non-zero blocks are read (never the off-diagonal zeros of a packed
 * layer, never the rows past an adapter's rank), so a decode step streams each adapter's weights
 * from memory once.
 *
 * Why a kernel: a decode step with many adapters is memory-bound (16 adapters x 2 tokens read
 * ~300 MB of adapter weights per step for a 135M model), and torch's bmm path reads the zero
 * blocks too and pays ~10 dispatches per layer. Work is split over OpenMP threads; the library is
 * loaded after torch, so it shares torch's libgomp and its thread pool.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

#define CHUNK 256 /* expand columns per work item: a [rank, CHUNK] block of Bt stays in L1 */

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

/* A slot's rank for one slice, clamped to [0, max_rank] so no value can index past the buffers. */
static inline int64_t slice_rank(const int32_t *ranks, int64_t index, int64_t max_rank) {
    const int64_t rank = ranks[index];
    return rank < 0 ? 0 : (rank > max_rank ? max_rank : rank);
}

/* Returns 0 on success, 1 when the scratch buffer cannot be allocated (nothing written then).
 * The caller guarantees: token_ids < rows of x and y, seg_slots < L, slice offsets increasing
 * from 0 to out_features (cpu_ops.py checks all three). */
int lora_fused_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t in_features,
                   int64_t out_features, const float *a, const float *bt, int64_t max_rank,
                   int64_t num_slices, const int64_t *slice_offsets, const int32_t *ranks,
                   const int64_t *token_ids, const int64_t *seg_slots, const int64_t *seg_starts,
                   const int64_t *seg_lens, int64_t num_segs, int64_t num_active, int num_threads) {
    const int64_t stacked_rank = num_slices * max_rank;
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
            const float *a_row = a + (slot * stacked_rank + row) * in_features;
            const int64_t start = seg_starts[seg], len = seg_lens[seg];
            for (int64_t m = 0; m < len; m += 2) {
                const int64_t p = start + m;
                const float *x1 = m + 1 < len ? x + token_ids[p + 1] * x_stride : NULL;
                float *t1 = m + 1 < len ? &t[(p + 1) * stacked_rank + row] : NULL;
                dot2(a_row, x + token_ids[p] * x_stride, x1, in_features, &t[p * stacked_rank + row], t1);
            }
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
            const float *block = bt + (slot * stacked_rank + q * max_rank) * out_features + col;
            for (int64_t p = seg_starts[seg]; p < seg_starts[seg] + seg_lens[seg]; ++p)
                axpy_block(y + token_ids[p] * y_stride + col, t + p * stacked_rank + q * max_rank, block,
                           out_features, rank, width);
        }
    }
    free(t);
    return 0;
}

/* Slot writes of one adapter activation, in one call: for each record r of 7 int64 values
 *     (dst, dst_ld, src, src_row_stride, src_col_stride, rows, cols)
 * set dst[i * dst_ld + j] = scales[r] * src[i * src_row_stride + j * src_col_stride] for i < rows,
 * j < cols, or 0 when src is NULL. A transposed source (B^T into the slot's [rank, out] rows) is
 * read in column blocks so each block of it stays in L1. Replaces ~3 torch ops per module. */
void lora_write_blocks(int64_t num_records, const int64_t *records, const float *scales, int num_threads) {
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t r = 0; r < num_records; ++r) {
        const int64_t *rec = records + 7 * r;
        float *dst = (float *)(intptr_t)rec[0];
        const float *src = (const float *)(intptr_t)rec[2];
        const int64_t dst_ld = rec[1], src_rs = rec[3], src_cs = rec[4], rows = rec[5], cols = rec[6];
        const float scale = scales[r];
        for (int64_t j0 = 0; j0 < cols; j0 += 64) {
            const int64_t j1 = j0 + 64 < cols ? j0 + 64 : cols;
            for (int64_t i = 0; i < rows; ++i) {
                float *d = dst + i * dst_ld;
                if (src == NULL) {
                    for (int64_t j = j0; j < j1; ++j) d[j] = 0.0f;
                } else if (src_cs == 1) {
                    const float *s = src + i * src_rs;
#pragma omp simd
                    for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j];
                } else {
                    const float *s = src + i * src_rs;
                    for (int64_t j = j0; j < j1; ++j) d[j] = scale * s[j * src_cs];
                }
            }
        }
    }
}
