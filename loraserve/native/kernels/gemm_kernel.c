/* Dense linear layers on CPU, y = x W^T + b, over a weight packed once for the vector units;
 * loaded through ctypes by gemm_cpu.py.
 *
 * Semantics (the twin is F.linear): y[m, n] = sum_k x[m, k] * W[n, k] + bias[n], summed in float32
 * and, in bfloat16, rounded to bf16 once at the end (to nearest even); the bias is added in float32
 * before that rounding. Shape: x [M, K] with row stride ldx; y [M, N] with row stride ldy; bias [N]
 * or NULL, in x's element type.
 *
 * Packed layout (gemm_pack_layout says which this build uses): the columns of W^T are cut into
 * blocks of NB output columns (the last padded with zeros), and each block is stored contiguous,
 * one k-step after another:
 *     bf16 (AVX512-BF16):  [N/NB][K/2][NB][2]  pairs of k side by side, what vdpbf16ps multiplies
 *     float32:             [N/NB][K][NB]
 * (K padded to even with zero weights in bf16.) The packing is done once, in torch, at load time.
 *
 * Why a kernel: a decode step multiplies 16-64 rows by every weight of the model. oneDNN's packed
 * linear runs those small-M products well below the machine's bf16 peak; a register tile of
 * MR rows x NB columns over a block of W that stays in L2 runs them near peak, and large M as fast
 * (benchmarks/README.md, "The C linear kernel").
 * (K is not blocked: a block is NB x K, 55-150 KB for a 135M model; at K of several thousand it
 * outgrows L2 and the tiles re-read it from L3.)
 * Work items are (row chunk, column block) pairs split statically over OpenMP threads; the library
 * is loaded after torch, so it shares torch's libgomp.
 *
 * Built with -march=native (loraserve/native/build.py): bf16 needs AVX512-BF16, float32 AVX-512.
 * Other builds serve nothing (gemm_pack_layout returns 0) and the caller keeps oneDNN: on AVX2 a
 * 6 x 16 fp32 tile did not beat oneDNN's AVX2 kernels (benchmarks/README.md).
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"
#include "side_stream.h"

#define ROW_CHUNK 128 /* rows per work item at most: x's chunk stays in L2 while the column blocks pass */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define GEMM_BF16 1
#endif
#if defined(__AVX512F__)
#define GEMM_F32 1
#define F32_NV 3 /* zmm columns per tile: 8 rows x 3 = 24 accumulators */
#define F32_NB 48
#define F32_MR 8
#endif
#define BF16_NV 3
#define BF16_NB 48
#define BF16_MR 8

/* A prefetch stream: `lines` cache lines from `next`, issued `per_step` at a time over a tile's k loop. */
typedef struct {
    const char *next;
    int64_t lines, per_step;
} prefetch_t;

static inline __attribute__((always_inline)) void prefetch_step(prefetch_t *pf, int64_t step) {
    for (int64_t j = 0; j < pf->per_step; j++) {
        int64_t line = step * pf->per_step + j;
        if (line < pf->lines) __builtin_prefetch(pf->next + line * 64, 0, 2); /* into L2 */
    }
}

/* A tile of `mr` rows (1 to 8): one instantiation per row count keeps every tile's accumulators in
 * registers (the row loops unroll over a constant). */
#define TILE_SWITCH(tile, mr, ...)                                                                            \
    switch (mr) {                                                                                              \
    case 8: tile(8, __VA_ARGS__); break;                                                                       \
    case 7: tile(7, __VA_ARGS__); break;                                                                       \
    case 6: tile(6, __VA_ARGS__); break;                                                                       \
    case 5: tile(5, __VA_ARGS__); break;                                                                       \
    case 4: tile(4, __VA_ARGS__); break;                                                                       \
    case 3: tile(3, __VA_ARGS__); break;                                                                       \
    case 2: tile(2, __VA_ARGS__); break;                                                                       \
    default: tile(1, __VA_ARGS__); break;                                                                      \
    }

typedef void (*block_fn)(int mr, const void *x, int64_t ldx, const void *w, int64_t k, const void *bias,
                         void *y, int64_t ldy, int64_t ncols, prefetch_t pf);

#ifdef GEMM_BF16
static inline __m512 bf16_bias(const uint16_t *bias, int v, int64_t ncols) {
    if (bias == NULL || v * 16 >= ncols) return _mm512_setzero_ps();
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask16_first(ncols - v * 16), bias + v * 16));
}

/* MR rows of x times one packed column block, k in pairs. `mr` is a constant after inlining, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void bf16_tile(int mr, const uint16_t *x, int64_t ldx,
                                                            const uint16_t *w, int64_t k, const uint16_t *bias,
                                                            uint16_t *y, int64_t ldy, int64_t ncols,
                                                            prefetch_t pf) {
    __m512 acc[BF16_MR][BF16_NV];
    for (int v = 0; v < BF16_NV; v++) {
        __m512 b = bf16_bias(bias, v, ncols);
        for (int m = 0; m < mr; m++) acc[m][v] = b;
    }
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[BF16_NV];
        for (int v = 0; v < BF16_NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * BF16_NB + v * 16) * 2);
        prefetch_step(&pf, p);
        for (int m = 0; m < mr; m++) {
            int32_t both;
            memcpy(&both, x + m * ldx + 2 * p, sizeof both);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(both);
            for (int v = 0; v < BF16_NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
        }
    }
    if (k & 1) { /* the last k alone: its partner weight is a packed zero, its partner x a zero */
        __m512bh wv[BF16_NV];
        for (int v = 0; v < BF16_NV; v++)
            wv[v] = (__m512bh)_mm512_loadu_si512(w + (pairs * BF16_NB + v * 16) * 2);
        for (int m = 0; m < mr; m++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[m * ldx + k - 1]);
            for (int v = 0; v < BF16_NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < BF16_NV && v * 16 < ncols; v++) {
            __m256i r = (__m256i)_mm512_cvtneps_pbh(acc[m][v]);
            int64_t n = ncols - v * 16;
            if (n >= 16) _mm256_storeu_si256((__m256i *)(y + m * ldy + v * 16), r);
            else _mm256_mask_storeu_epi16(y + m * ldy + v * 16, mask16_first(n), r);
        }
}

static void bf16_block(int mr, const void *x, int64_t ldx, const void *w, int64_t k, const void *bias, void *y,
                       int64_t ldy, int64_t ncols, prefetch_t pf) {
    TILE_SWITCH(bf16_tile, mr, (const uint16_t *)x, ldx, (const uint16_t *)w, k, (const uint16_t *)bias,
                (uint16_t *)y, ldy, ncols, pf);
}
#endif

#ifdef GEMM_F32
static inline __attribute__((always_inline)) void f32_tile(int mr, const float *x, int64_t ldx, const float *w,
                                                           int64_t k, const float *bias, float *y, int64_t ldy,
                                                           int64_t ncols, prefetch_t pf) {
    __m512 acc[F32_MR][F32_NV];
    for (int v = 0; v < F32_NV; v++) {
        __m512 b = _mm512_setzero_ps();
        if (bias != NULL && v * 16 < ncols) b = _mm512_maskz_loadu_ps(mask16_first(ncols - v * 16), bias + v * 16);
        for (int m = 0; m < mr; m++) acc[m][v] = b;
    }
    for (int64_t p = 0; p < k; p++) {
        __m512 wv[F32_NV];
        for (int v = 0; v < F32_NV; v++) wv[v] = _mm512_loadu_ps(w + p * F32_NB + v * 16);
        prefetch_step(&pf, p);
        for (int m = 0; m < mr; m++) {
            __m512 xb = _mm512_set1_ps(x[m * ldx + p]);
            for (int v = 0; v < F32_NV; v++) acc[m][v] = _mm512_fmadd_ps(xb, wv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < F32_NV && v * 16 < ncols; v++)
            _mm512_mask_storeu_ps(y + m * ldy + v * 16, mask16_first(ncols - v * 16), acc[m][v]);
}

static void f32_block(int mr, const void *x, int64_t ldx, const void *w, int64_t k, const void *bias, void *y,
                      int64_t ldy, int64_t ncols, prefetch_t pf) {
    TILE_SWITCH(f32_tile, mr, (const float *)x, ldx, (const float *)w, k, (const float *)bias, (float *)y, ldy,
                ncols, pf);
}
#endif

/* The block width NB and tile height MR this build packs and runs for a dtype (0: float32, 1: bf16),
 * as nb | mr << 16; 0 when it serves that dtype not at all. */
int gemm_pack_layout(int dtype) {
#ifdef GEMM_BF16
    if (dtype == 1) return BF16_NB | BF16_MR << 16;
#endif
#ifdef GEMM_F32
    if (dtype == 0) return F32_NB | F32_MR << 16;
#endif
    (void)dtype;
    return 0;
}

typedef struct {
    const char *x, *w, *bias;
    char *y;
    int64_t ldx, ldy, m, n, k, nb, mr, elem, steps, num_blocks, block_bytes, row_chunk;
    block_fn block;
} gemm_t;

/* One work item: rows [m0, m1) of x times column block b, prefetching `next` (a block of
 * `next_bytes`, or nothing) into L2 spread evenly over the item's tiles. */
static void run_item(const gemm_t *g, int64_t item, const char *next, int64_t next_bytes, side_t *sd,
                     int64_t item_lines) {
    const int64_t b = item % g->num_blocks, m0 = item / g->num_blocks * g->row_chunk;
    const int64_t m1 = m0 + g->row_chunk < g->m ? m0 + g->row_chunk : g->m;
    const int64_t ncols = g->n - b * g->nb < g->nb ? g->n - b * g->nb : g->nb;
    const char *bias = g->bias == NULL ? NULL : g->bias + b * g->nb * g->elem;
    const int64_t num_tiles = (m1 - m0 + g->mr - 1) / g->mr, lines = next == NULL ? 0 : next_bytes / 64;
    const int64_t lines_per_tile = (lines + num_tiles - 1) / num_tiles;
    for (int64_t r = m0, tile = 0; r < m1; r += g->mr, tile++) {
        int rows = (int)(m1 - r < g->mr ? m1 - r : g->mr);
        int64_t first = tile * lines_per_tile, count = lines - first < lines_per_tile ? lines - first : lines_per_tile;
        prefetch_t pf = {next == NULL ? NULL : next + first * 64, count > 0 ? count : 0,
                         (lines_per_tile + g->steps - 1) / g->steps};
        if (sd != NULL) side_fetch(sd, (item_lines + num_tiles - 1) / num_tiles);
        g->block(rows, g->x + r * g->ldx * g->elem, g->ldx, g->w + b * g->block_bytes, g->k, bias,
                 g->y + (r * g->ldy + b * g->nb) * g->elem, g->ldy, ncols, pf);
    }
}

/* y = x W^T + bias over a packed W (see the top of this file). `next_w` (or NULL) is the packed
 * weight of the linear that runs next, `next_n` x `next_k`: a model's weights stream from memory,
 * so each thread fetches the block it will start that call with while it finishes this one; `side`
 * (or NULL) is more memory to fetch meanwhile (see gemm_linear_prefetch).
 * Returns 0, or 1 if this build does not serve the dtype (nothing written). */
static int gemm_run(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int64_t m,
                    int64_t n, int64_t k, const void *next_w, int64_t next_n, int64_t next_k, int dtype,
                    int num_threads, const int64_t *side) {
    int layout = gemm_pack_layout(dtype);
    if (layout == 0) return 1;
    gemm_t g = {.x = x, .w = w, .bias = bias, .y = y, .ldx = ldx, .ldy = ldy, .m = m, .n = n, .k = k,
                .nb = layout & 0xffff, .mr = layout >> 16, .elem = dtype == 1 ? 2 : 4, .block = NULL};
#ifdef GEMM_BF16
    if (dtype == 1) g.block = bf16_block;
#endif
#ifdef GEMM_F32
    if (dtype == 0) g.block = f32_block;
#endif
    const int64_t k_packed = dtype == 1 ? k + (k & 1) : k, next_k_packed = dtype == 1 ? next_k + (next_k & 1) : next_k;
    g.steps = dtype == 1 ? (k / 2 > 0 ? k / 2 : 1) : (k > 0 ? k : 1); /* k steps of a tile's main loop */
    g.num_blocks = (n + g.nb - 1) / g.nb;
    g.block_bytes = k_packed * g.nb * g.elem;
    int64_t row_chunk = ROW_CHUNK; /* narrower where too few items would leave threads idle */
    while (row_chunk > g.mr && g.num_blocks * ((m + row_chunk - 1) / row_chunk) < 2 * num_threads) row_chunk /= 2;
    g.row_chunk = row_chunk;
    const int64_t num_chunks = (m + row_chunk - 1) / row_chunk, num_items = g.num_blocks * num_chunks;
    const int64_t next_blocks = (next_n + g.nb - 1) / g.nb, next_bytes = next_k_packed * g.nb * g.elem;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        /* Contiguous ranges, computed the same way for every call, so a thread knows which block it
         * starts the next call with (assuming it has as many row chunks as this one). */
        const int64_t begin = num_items * tid / nth, end = num_items * (tid + 1) / nth;
        side_t sd; /* this thread's share of side (side_stream.h) */
        const int64_t lines = side_share(side, tid, nth, &sd);
        side_t *sdp = lines > 0 && end > begin ? &sd : NULL;
        const int64_t lines_per_item = end > begin ? (lines + (end - begin) - 1) / (end - begin) : 0;
        for (int64_t item = begin; item < end; item++) {
            if (item + 1 < end) {
                run_item(&g, item, g.w + (item + 1) % g.num_blocks * g.block_bytes, g.block_bytes, sdp, lines_per_item);
            } else if (next_w != NULL && next_blocks > 0) {
                int64_t first = next_blocks * num_chunks * tid / nth % next_blocks;
                run_item(&g, item, (const char *)next_w + first * next_bytes, next_bytes, sdp, lines_per_item);
            } else {
                run_item(&g, item, NULL, 0, sdp, lines_per_item);
            }
        }
    }
    return 0;
}

/* gemm_run without a side stream. */
int gemm_linear(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, const void *next_w, int64_t next_n, int64_t next_k, int dtype,
                int num_threads) {
    return gemm_run(x, ldx, w, bias, y, ldy, m, n, k, next_w, next_n, next_k, dtype, num_threads, NULL);
}

/* gemm_linear_packed that also fetches `side` into L2 (or NULL: nothing), memory the caller reads
 * next (side_stream.h: its layout, each thread's share; a malformed list fetches nothing). A decode
 * step's product leaves memory mostly idle, so a small LoRA term's weights arrive at little cost (one
 * adapter's step got faster); many adapters' weights compete with the product's own stream (16
 * adapters made the step slower), so the fetch is skipped when it exceeds 1 / SIDE_MAX_SHARE of the
 * weight's bytes. */
#define SIDE_MAX_SHARE 4
int gemm_linear_prefetch(const int64_t *weight, const void *x, int64_t ldx, const void *bias, void *y, int64_t m,
                         int num_threads, const int64_t *side) {
    if (side != NULL) {
        int64_t bytes = 0;
        for (int64_t i = 0; i < side[0]; i++) bytes += side[3 + 4 * i] * side[4 + 4 * i];
        if (bytes * SIDE_MAX_SHARE > weight[1] * weight[2] * (weight[6] == 1 ? 2 : 4)) side = NULL;
    }
    return gemm_run(x, ldx, (const void *)(intptr_t)weight[0], bias, y, weight[1], m, weight[1], weight[2],
                    (const void *)(intptr_t)weight[3], weight[4], weight[5], (int)weight[6], num_threads, side);
}

/* gemm_linear with the weight's fixed arguments in one array, built once per weight: ctypes converts
 * every argument of every call, and a decode step makes ~120 of these calls.
 * weight = {w, n, k, next_w, next_n, next_k, dtype}; y's row stride is n. */
int gemm_linear_packed(const int64_t *weight, const void *x, int64_t ldx, const void *bias, void *y, int64_t m,
                       int num_threads) {
    return gemm_run(x, ldx, (const void *)(intptr_t)weight[0], bias, y, weight[1], m, weight[1], weight[2],
                    (const void *)(intptr_t)weight[3], weight[4], weight[5], (int)weight[6], num_threads, NULL);
}
