/* Fused multi-LoRA shrink + expand on CPU, for float32 or bfloat16, loaded through ctypes by lora_cpu.py.
 *
 * Semantics (the pure-torch twin is lora_torch.add_lora): for every active token p of the step
 * (token_ids[p], grouped into segments of one slot each) and every slice q of the layer (packed
 * qkv / gate_up have several, a plain layer one), with s the segment's slot and r = ranks[s, q]:
 *     t = scale[p] * A[s, q*R : q*R + r, :] @ x[token]                             (shrink)
 *     y[token, off[q] : off[q+1]] += t @ Bt[s, q*R : q*R + r, off[q] : off[q+1]]   (expand)
 * (scale[p] is the token's per-request LoRA scale, 1 when the step has none; it scales the float32 sums
 * before t is stored, so t is rounded once.) A is [L, n*R, in] and Bt is [L, n*R, out], both contiguous: the block-diagonal slot buffers of
 * LinearWithLoRA. Only their non-zero blocks are read (never the off-diagonal zeros of a packed
 * layer, never the rows past an adapter's rank), so a decode step streams each adapter's weights
 * from memory once. x, y, A and Bt share one element type. In bfloat16, products are summed in
 * float32 and each element of y is rounded back to bf16 once (to nearest even). t is rounded to bf16
 * (to nearest even) before the expand in builds with AVX512-BF16, whose expand multiplies bf16 pairs,
 * as the torch twin and PEFT round it (theirs is a bf16 matmul's output); the other builds keep t in
 * float32. vdpbf16ps treats denormals as zero and flushes them, so with AVX512-BF16 a bf16 denormal in
 * x, A, Bt or in a row of y the expand adds to counts as zero.
 *
 * Why a kernel: a decode step with many adapters is memory-bound (16 adapters x 2 tokens read
 * ~300 MB of adapter weights per step for a 135M model), and torch's bmm path reads the zero
 * blocks too and pays ~10 dispatches per layer. Work is split over OpenMP threads; the library is
 * loaded after torch, so it shares torch's libgomp and its thread pool.
 *
 * Built with -march=native (loraserve/native/build.py), so the feature macros pick the code:
 * float32 runs AVX-512, AVX2 + FMA or scalar code; bfloat16 runs AVX-512 (vdpbf16ps dot products in
 * both halves where the CPU has AVX512-BF16, else bf16 -> fp32 widening and fp32 FMAs), AVX2, or
 * scalar code.
 * Parts: lora_kernel_vec.h (the shrink and expand blocks per ISA level), lora_kernel_items.h (work
 * items, the threads' walk over them, scratch); this file holds the entry points.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
#endif
#if W == 16 /* simd.h's AVX-512 level (F + BW + VL) */
#define LORA_AVX512 1 /* bf16: 32 values per vector, tails through masked loads and stores */
#ifdef __AVX512BF16__
#define LORA_BF16_DOT 1 /* vdpbf16ps / vcvtne2ps2bf16: the bf16 expand works on pairs of rank */
#endif
#endif

/* Expand columns per work item, at most, in a step whose segments are all one token group or less
 * (decode), and in float32: narrow items keep each thread's prefetches running ahead in an even
 * trickle, which draws more DRAM bandwidth than wide items in a many-adapter decode step. A bf16 step
 * with a longer segment reads each block of Bt once for all its token groups (the later ones find it
 * in L1), so the width there is the most (up to 4 * CHUNK) that keeps a [max_rank, width] block within
 * LONG_BLOCK_BYTES: fewer, wider items cut the per-item work. float32 was slower with wider items,
 * so it keeps 64 (the timings: benchmarks/README.md, "Kernel tuning figures"). The width only splits
 * columns among items, each column's sum is the same: results do not change. */
#define CHUNK 64
#define LONG_BLOCK_BYTES 8192

enum { LORA_F32 = 0, LORA_BF16 = 1 }; /* element type of x, y, A and Bt (and of a write record) */
typedef uint16_t bf16;

#include "lora_kernel_vec.h"
#include "lora_kernel_items.h"

/* The weights lora_fused(layer, step) reads, for the base product to fetch ahead of it
 * (gemm_linear_prefetch): out = {num_runs, runs per segment when the call splits segments among
 * num_threads threads (segment-major), else 0; then runs of (address, bytes per row, rows, row stride
 * in bytes)}: per segment and slice, A's rows and Bt's block of that slot (its rank's rows, its
 * slice's columns). Returns their bytes, or -1 (out[0] = 0) when they need more than max_runs runs. */
int64_t lora_weight_ranges(const int64_t *layer, const int64_t *step, int64_t *out, int64_t max_runs,
                           int num_threads) {
    const int64_t size = layer[0] == LORA_BF16 ? 2 : 4, in = layer[1], o = layer[2], max_rank = layer[5];
    const int64_t num_slices = layer[6], stacked = max_rank * num_slices;
    const int64_t *offsets = (const int64_t *)(intptr_t)layer[7];
    const int32_t *ranks = (const int32_t *)(intptr_t)layer[8];
    const int64_t *seg_slots = (const int64_t *)(intptr_t)step[1], *seg_lens = (const int64_t *)(intptr_t)step[3];
    int64_t n = 0, total = 0, max_len = 0, *run = out + 2;
    out[0] = out[1] = 0;
    for (int64_t g = 0; g < step[4]; ++g) {
        max_len = seg_lens[g] > max_len ? seg_lens[g] : max_len;
        if (seg_lens[g] <= 0) continue;
        if (n + 2 * num_slices > max_runs) return out[0] = 0, -1;
        const int64_t slot = seg_slots[g];
        for (int64_t q = 0; q < num_slices; ++q, n += 2, run += 8) {
            const int64_t rank = slice_rank(ranks, slot * num_slices + q, max_rank), row = slot * stacked + q * max_rank;
            const int64_t width = offsets[q + 1] - offsets[q];
            run[0] = layer[3] + size * row * in, run[1] = size * rank * in, run[2] = 1, run[3] = 0;
            run[4] = layer[4] + size * (row * o + offsets[q]), run[5] = size * width, run[6] = rank, run[7] = size * o;
            total += size * rank * (in + width);
        }
    }
    out[0] = n;
    out[1] = n == 2 * num_slices * step[4] && segment_major(max_len, max_rank > 0, num_threads, step[4])
                 ? 2 * num_slices : 0;
    return total;
}

/* Returns 0 on success, 1 when the scratch buffers cannot be allocated (nothing written then).
 * layer: {elem, in_features, out_features, a, bt, max_rank, num_slices, slice_offsets, ranks}, with
 * elem LORA_F32 or LORA_BF16 (the type of x, y, a and bt) and the last two pointers to int64 [n + 1]
 * and int32 [L, n]; step: {token_ids, seg_slots, seg_starts, seg_lens, num_segs, num_active, scales},
 * the first four pointers to int64 arrays, scales to float32 [num_active] (per active token in
 * token_ids order: t = scale * A x) or 0 when every scale is 1. Two arrays built once (per layer, per step) instead of 20
 * arguments per call: ctypes converts every argument of every call. The caller guarantees:
 * token_ids < rows of x and y, seg_slots < L, slice offsets increasing from 0 to out_features
 * (lora_cpu.py checks all three). */
int lora_fused(const int64_t *layer, const int64_t *step, const void *x, int64_t x_stride, void *y,
               int64_t y_stride, int num_threads) {
    const int elem = (int)layer[0];
    const int64_t in_features = layer[1], out_features = layer[2], max_rank = layer[5], num_slices = layer[6];
    const void *a = (const void *)(intptr_t)layer[3], *bt = (const void *)(intptr_t)layer[4];
    const int64_t *slice_offsets = (const int64_t *)(intptr_t)layer[7];
    const int32_t *ranks = (const int32_t *)(intptr_t)layer[8];
    const int64_t *token_ids = (const int64_t *)(intptr_t)step[0], *seg_slots = (const int64_t *)(intptr_t)step[1];
    const int64_t *seg_starts = (const int64_t *)(intptr_t)step[2], *seg_lens = (const int64_t *)(intptr_t)step[3];
    const int64_t num_segs = step[4], num_active = step[5];
    int64_t max_len = 0;
    for (int64_t g = 0; g < num_segs; ++g) max_len = seg_lens[g] > max_len ? seg_lens[g] : max_len;
    int64_t chunk = CHUNK; /* expand columns per item (see CHUNK) */
    if (elem == LORA_BF16 && max_len > TOKEN_GROUP && max_rank > 0) {
        chunk = LONG_BLOCK_BYTES / (2 * max_rank) / CHUNK * CHUNK;
        chunk = chunk < CHUNK ? CHUNK : (chunk > 4 * CHUNK ? 4 * CHUNK : chunk);
    }
    const int64_t num_chunks = slice_chunks(slice_offsets, num_slices, chunk, NULL);
    const int64_t stacked_rank = num_slices * max_rank, row_blocks = (max_rank + ROW_BLOCK - 1) / ROW_BLOCK;
    /* One line-aligned scratch: t first (sized for float elements, the larger kind; a thread's token
     * groups start on their own lines whenever a group's rows of t are a multiple of 64 bytes, as 8
     * tokens at rank 16 are in float32 or bf16), then the chunks, then both passes' seg_first. */
    const size_t t_bytes = (sizeof(float) * (size_t)(num_active > 0 ? num_active : 1) * (size_t)stacked_rank + 63) / 64 * 64;
    const size_t chunk_bytes = (sizeof(SliceChunk) * (size_t)num_chunks + 63) / 64 * 64;
    const size_t first_bytes = sizeof(int64_t) * (size_t)(2 * (num_segs + 2));
    char *scratch = (char *)scratch_get((t_bytes + chunk_bytes + first_bytes + 63) / 64 * 64);
    if (scratch == NULL) return 1;
    void *t = scratch;
    SliceChunk *chunks = (SliceChunk *)(scratch + t_bytes);
    int64_t *shrink_first = (int64_t *)(scratch + t_bytes + chunk_bytes), *expand_first = shrink_first + num_segs + 2;
    slice_chunks(slice_offsets, num_slices, chunk, chunks);
    first_items(seg_lens, num_segs, num_slices * row_blocks, shrink_first);
    first_items(seg_lens, num_segs, num_chunks, expand_first);
    const Step s = {elem, elem == LORA_BF16 ? 2 : 4, t_elem_size(elem), in_features, out_features, max_rank,
                    num_slices, stacked_rank, row_blocks, num_chunks, num_segs, (const char *)a, (const char *)bt,
                    ranks, token_ids, seg_slots, seg_starts, seg_lens, shrink_first, expand_first, chunks,
                    (const float *)(intptr_t)step[6]};

    /* Each thread takes a contiguous range of items, so it can prefetch the ones it does next. */
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t nth = omp_get_num_threads();
#else
        const int64_t nth = 1;
#endif
        /* Many short segments on several threads: segment-major, which was faster there; one thread
         * streams DRAM better in the two-pass order, so it keeps that (benchmarks/README.md). */
        if (segment_major(max_len, row_blocks > 0, nth, num_segs)) {
            int64_t g0, g1;
            thread_range(num_segs, &g0, &g1);
            run_segments(&s, g0, g1, x, x_stride, y, y_stride, t);
        } else {
            int64_t lo, hi;
            thread_range(shrink_first[num_segs], &lo, &hi);
            RUN_RANGE(shrink_at, shrink_first, num_slices * row_blocks, row_blocks, lo, hi, x, x_stride, t);
#pragma omp barrier
            thread_range(expand_first[num_segs], &lo, &hi);
            RUN_RANGE(expand_at, expand_first, num_chunks, num_chunks, lo, hi, y, y_stride, t);
        }
    }
    scratch_put(scratch);
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
 * bit 1 AVX-512 F + BW + VL (bf16), bit 2 AVX512-BF16 dot products; 0 is the portable C alone. */
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
