/* Linear layers over GGUF block-quantized weights, y = x W^T + b, loaded through ctypes by
 * layers/quant/kernel.py (the formats' layouts and their torch twin: layers/quant/formats.py).
 *
 * W is [n, k] in one of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K (type codes 0-5), the file's bytes (RSS
 * stays the file's size) in panels of 8 rows at one activation level (Q8_0 / Q4_0 / Q4_1: 9-11,
 * quant_kernel_packed.h; Q4_K / Q5_K / Q6_K: 12-14, quant_kernel_kpacked.h; one path for every row count),
 * else (two levels, rows not a multiple of 8, LORASERVE_CPU_QUANT_LAYOUT=rows) the K-quants row after row
 * in the file's layout and Q8_0 / Q4_0 / Q4_1 in their row layout (6-8), as follows.
 *
 * quant_linear below PANEL_MIN_ROWS rows of x (decode) streams every weight byte once against x quantized
 * to int8 once per product (quant_kernel_act.h): per 32 values for Q8_0 / Q4_0 / Q4_1, whose weights
 * have a float scale per 32 (each block's integer dot product, vpmaddubsw + vpmaddwd on AVX2 or vpdpbusd
 * with AVX512-VNNI, is scaled once: sum_blocks dx * (s * idot + add * sum(xq))), and per 256 for the
 * K-quants, whose sub-block scales are small integers (quant_kernel_ksuper.h: int32 sums to the end of
 * each super-block, one float multiply per 256 weights). Signed weights go into the unsigned-by-signed
 * byte products as |q| with x's signs flipped where q < 0. float32 x takes one int8 level by default,
 * llama.cpp's precision (amax / 254 per value), or two (amax / 32512; the X_TWO_LEVELS flag).
 * From PANEL_MIN_ROWS rows at one level (prefill, big batches) it unpacks each chunk of weight rows once
 * into 8-row panels that every row of x passes (quant_kernel_panel.h), the same x quantized the same way.
 * quant_dequantize (prefill at two levels): rows [n0, n1) of W as float32 or bf16, for a tile product.
 * Parallel over chunks of N_CHUNK output rows with OpenMP (torch's libgomp: the library is loaded after
 * torch), claimed guided, so a thread slowed by another process takes fewer.
 * Semantics of quant_linear: float32 sums, one rounding to x's dtype at the end, bias added before it.
 * Parts: quant_kernel_blocks.h (the formats' decoding), quant_kernel_act.h (x's quantization and its
 * scratch), quant_kernel_ksuper.h (the K-quants' super-block loop), quant_kernel_rows.h (the row
 * layouts' loop), quant_kernel_panel.h (the many-rows path), quant_kernel_packed.h (the panel layouts),
 * quant_kernel_dequantize.h (the tiles), quant_kernel_embed.h (an embedding's rows).
 */
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>

#include "simd.h"
#include "side_stream.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QK_PATH 2
#elif defined(__AVX2__)
#define QK_PATH 1
#else
#define QK_PATH 0
#endif

#define MR 4        /* rows of x per pass over a weight row: its unpacked blocks are reused that often */
#define PREFETCH_ROWS 4 /* weight rows ahead of the one being read (past the end: a harmless hint) */
#define N_CHUNK 16  /* weight rows per work item (a few KB: stays in L1 while the row groups pass) */
#define M_BLOCK 64  /* rows of x per work item: their quants (64 x k bytes) stay in L2 while the chunks pass */
#define PANEL_M_BLOCK 256 /* the panel path's rows of x per work item: a chunk is packed once per block (x's
                           * rows pass the packed chunk 4 at a time, so they need not stay in cache) */
/* Rows of x from which a product takes the panel path (quant_kernel_panel.h; tests build with
 * -DPANEL_MIN_ROWS=1 to run it on every row count). It is faster from about 10 rows (Zen 3, AVX2: Q4_K
 * 1B shapes at 2 threads, 12 rows 95 against 84 G multiply-adds a second, 16 rows 108 against 85), but
 * its float32 sums run in another order than the row streaming's, so a request's logits depend on the
 * path its step took; speculative decoding verifies k + 1 rows per sequence where the same request
 * without it decodes one, and its greedy output must stay the same. 33 keeps the switch where the tile
 * path took over before (batches of up to 32 sequences decode on one path), until both paths sum in one
 * order. */
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 33
#endif
/* Up to this many rows of x every thread quantizes all of them into its own scratch instead of its share
 * into one buffer: x's quants are read by every thread, so a shared buffer's lines sit in both cores'
 * caches when the next product rewrites them, and each store waits for the other core to give its copy
 * up (on Zen 4, 16 rows: over half of the quantization's samples on its stores); a private copy costs the
 * quantization once more per thread and no barrier. Past it the duplicated work outweighs that. */
#ifndef PRIVATE_X_ROWS
#define PRIVATE_X_ROWS 32
#endif

/* by type code: 0-2 (Q8_0, Q4_0, Q4_1 in GGUF's block layout) are not read here (formats.repack_rows
 * gives them their row layout, 6-8, at load, or formats.repack_panels their panels, 9-11); 3-5 the
 * K-quants (their panels: 12-14, Q4_K's and Q5_K's rows 4 bytes longer a super-block) */
static const int BLOCK_SIZE[15] = {32, 32, 32, 256, 256, 256, 32, 32, 32, 32, 32, 32, 256, 256, 256};
static const int TYPE_SIZE[15] = {34, 18, 20, 144, 176, 210, 34, 18, 20, 34, 18, 20, 148, 180, 210};

/* Which integer dot product this build runs: 2 AVX512-VNNI, 1 AVX2, 0 portable C. */
int quant_kernel_path(void) { return QK_PATH; }

/* The x argument's flags: its dtype, and (float32 only) whether it is quantized to two int8 levels
 * (amax / 32512 per value, about 1.6x the integer work) instead of one (llama.cpp's precision). */
enum { X_BF16 = 1, X_TWO_LEVELS = 2 };

#include "quant_kernel_blocks.h"

#if QK_PATH > 0
/* The 8 int32 partial sums of q . x over 32 bytes (lanes 0-3: weights 0-15, lanes 4-7: 16-31). */
static inline __attribute__((always_inline)) __m256i dot_us(__m256i u, __m256i s) {
#if QK_PATH == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __attribute__((always_inline)) __m256i dot32(__m256i q, __m256i x, int is_signed) {
    return is_signed ? dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)) : dot_us(q, x);
}

/* The partial sums of block q against 32-block `at` of the activations: q . xq, or with `two` (float32
 * x) q . (256 xq + xq2) = 256 (q . xq) + q . xq2 (|q . xq| <= 32 * 128 * 127: no int32 overflow). */
static inline __attribute__((always_inline)) __m256i dotq(__m256i q, const int8_t *xq, const int8_t *xq2, int64_t at,
                                                          int is_signed, int two) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + at * 32));
    if (!two) return dot32(q, x, is_signed);
    const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq2 + at * 32));
    const __m256i u = is_signed ? _mm256_sign_epi8(q, q) : q;
    const __m256i s = is_signed ? _mm256_sign_epi8(x, q) : x, s2 = is_signed ? _mm256_sign_epi8(x2, q) : x2;
#if QK_PATH == 2
    return _mm256_add_epi32(_mm256_slli_epi32(dot_us(u, s), 8), dot_us(u, s2));
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s2), _mm256_set1_epi16(1)));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#include "quant_kernel_act.h"

#include "quant_kernel_ksuper.h"
#include "quant_kernel_rows.h"

/* out[i] = the row's dot product with rows r0 .. r0 + mr - 1 of x (mr <= MR). `type` and `two` are
 * constants after inlining, so each format gets its own loop. */
static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *row, int64_t k, const qx_t *qx,
                                                          int64_t r0, int mr, int two, const uint8_t *ahead, float *out) {
#if QK_PATH > 0
    if (type >= 6) rows_row_dot(type, row, k, qx, r0, mr, two, ahead, out);
    else kq_row_dot(type, row, k, qx, r0, mr, two, ahead, out);
#else
    (void)ahead;
    if (type >= 6) rows_row_dot_scalar(type, row, k, qx, r0, mr, two, out);
    else kq_row_dot_scalar(type, row, k, qx, r0, mr, two, out);
#endif
}

/* Weight rows [n0, n1) against x's rows r0 .. r0 + mr - 1; `mr` and `two` are constants after inlining
 * (the switch below), so the per-row accumulators are registers rather than a stack array. */
static inline __attribute__((always_inline)) void rows_pass(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                            int64_t n1, int64_t k, const qx_t *qx, int64_t r0, int mr,
                                                            int two, int first, float *acc) {
    for (int64_t n = n0; n < n1; n++) {
        float out[MR];
        /* the first pass over the chunk streams its weights from memory: ask for rows PREFETCH_ROWS
         * ahead (the hardware prefetcher alone left a single thread at about half the read bandwidth
         * on the LM head); later passes find them in L1 */
        const uint8_t *ahead = first ? w + (n + PREFETCH_ROWS) * row_bytes : NULL;
        row_dot(type, w + n * row_bytes, k, qx, r0, mr, two, ahead, out);
        for (int i = 0; i < mr; i++) acc[i * N_CHUNK + (n - n0)] = out[i];
    }
}

/* Weight rows [n0, n1) against x's rows [r_lo, r_hi) (at most M_BLOCK), MR rows at a time; acc is
 * [r_hi - r_lo][N_CHUNK]. */
static inline __attribute__((always_inline)) void chunk_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                             int64_t n1, int64_t k, const qx_t *qx, int64_t r_lo,
                                                             int64_t r_hi, float *acc) {
    const int two = qx->xq2 != NULL || qx->kq2 != NULL;
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += MR) {
        const int mr = r_hi - r0 < MR ? (int)(r_hi - r0) : MR, first = r0 == r_lo;
        float *a = acc + (r0 - r_lo) * N_CHUNK;
        if (two) {
            switch (mr) {
            case 1: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 1, 1, first, a); break;
            case 2: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 2, 1, first, a); break;
            case 3: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 3, 1, first, a); break;
            default: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, MR, 1, first, a); break;
            }
        } else {
            switch (mr) {
            case 1: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 1, 0, first, a); break;
            case 2: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 2, 0, first, a); break;
            case 3: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, 3, 0, first, a); break;
            default: rows_pass(type, w, row_bytes, n0, n1, k, qx, r0, MR, 0, first, a); break;
            }
        }
    }
}

/* Whether w = {address, n, k, type} is a weight this kernel multiplies. */
static int weight_ok(const int64_t *w) {
    const int type = (int)w[3];
    const int rows_ok = type >= 9 ? w[1] % 8 == 0 : 1; /* panels of 8 rows */
    return type >= 3 && type <= 14 && rows_ok && w[1] >= 0 && w[2] > 0 && w[2] % BLOCK_SIZE[type] == 0;
}

/* y[r_lo .. r_hi, n0 .. n1] = acc ([r_hi - r_lo][N_CHUNK]) + bias, rounded to y's dtype. */
static void store_chunk(const float *acc, int x_bf16, const void *bias, void *y, int64_t ldy, int64_t n0, int64_t n1,
                        int64_t r_lo, int64_t r_hi) {
    const int64_t n = n1 - n0; /* W lanes a step (simd.h: masked past n; its bf16 rounding is f32_to_bf16's) */
    for (int64_t j = 0; j < n; j += W) {
        vf b = vzero();
        if (bias != NULL)
            b = x_bf16 ? vload_bf16((const uint16_t *)bias + n0 + j, n - j) : vload((const float *)bias + n0 + j, n - j);
        for (int64_t r = r_lo; r < r_hi; r++) {
            vf v = vload(acc + (r - r_lo) * N_CHUNK + j, n - j);
            if (bias != NULL) v = vadd(v, b); /* not + 0 without: -0 stays -0 */
            if (x_bf16) vstore_bf16((uint16_t *)y + r * ldy + n0 + j, v, n - j);
            else vstore((float *)y + r * ldy + n0 + j, v, n - j);
        }
    }
}

/* Chunk c of weight w = {address, n, k, type}: its rows [n0, n1) and what reading them needs. */
typedef struct {
    const uint8_t *wp;
    int64_t n, k, row_bytes, n0, n1;
    int type;
} chunk_t;

static inline chunk_t chunk_of(const int64_t *w, int64_t c) {
    chunk_t ch;
    ch.wp = (const uint8_t *)(intptr_t)w[0], ch.n = w[1], ch.k = w[2], ch.type = (int)w[3];
    ch.row_bytes = ch.k / BLOCK_SIZE[ch.type] * TYPE_SIZE[ch.type];
    ch.n0 = c * N_CHUNK, ch.n1 = ch.n0 + N_CHUNK < ch.n ? ch.n0 + N_CHUNK : ch.n;
    return ch;
}

#include "quant_kernel_panel.h"
#include "quant_kernel_packed.h"

/* Chunk c (N_CHUNK weight rows) of w's y = x W^T + bias for x's rows [r_lo, r_hi), x from qx (acc:
 * [M_BLOCK][N_CHUNK] scratch). */
static void run_chunk(const int64_t *w, int64_t c, const qx_t *qx, int x_bf16, const void *bias, void *y, int64_t ldy,
                      int64_t r_lo, int64_t r_hi, float *acc) {
    const chunk_t ch = chunk_of(w, c);
    const uint8_t *wp = ch.wp;
    const int64_t k = ch.k, row_bytes = ch.row_bytes, n0 = ch.n0, n1 = ch.n1;
    const int type = ch.type;
    switch (type) {
    case 3: chunk_rows(3, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    case 4: chunk_rows(4, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    case 5: chunk_rows(5, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    case 6: chunk_rows(6, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    case 7: chunk_rows(7, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    default: chunk_rows(8, wp, row_bytes, n0, n1, k, qx, r_lo, r_hi, acc); break;
    }
    store_chunk(acc, x_bf16, bias, y, ldy, n0, n1, r_lo, r_hi);
}

/* x as the parts' paths read it: quantized per row streaming (qx) or per panel (p32, p256). */
typedef struct {
    const qx_t *qx;
    const px_t *p32, *p256;
    int panel, x_bf16;
} act_t;

/* Chunk c of the parts' chunks (w: linear_parts' list, each part's chunks in turn) for x's rows
 * [r_lo, r_hi), into y's columns of its part (bias likewise). */
static void run_part_chunk(const int64_t *w, int64_t c, const act_t *x, const void *bias, void *y, int64_t ldy,
                           int64_t r_lo, int64_t r_hi, uint8_t *panels, float *acc) {
    int64_t p = 0, first = 0, col = 0; /* the part chunk c falls in, its first chunk and column */
    while (c >= first + (w[4 * p + 1] + N_CHUNK - 1) / N_CHUNK)
        first += (w[4 * p + 1] + N_CHUNK - 1) / N_CHUNK, col += w[4 * p + 1], p++;
    const int64_t elem = x->x_bf16 ? 2 : 4;
    const void *b = bias == NULL ? NULL : (const char *)bias + col * elem;
    void *yp = (char *)y + col * elem;
    if (is_packed_type((int)w[4 * p + 3])) {
        const px_t *pxp = w[4 * p + 3] >= 12 ? x->p256 : x->p32;
        run_packed_chunk(w + 4 * p, c - first, pxp, x->x_bf16, b, yp, ldy, r_lo, r_hi, acc);
        return;
    }
#if QK_PATH > 0
    if (x->panel) {
        run_panel_chunk(w + 4 * p, c - first, x->p32, x->p256, x->x_bf16, b, yp, ldy, r_lo, r_hi, panels, acc);
        return;
    }
#else
    (void)panels;
#endif
    run_chunk(w + 4 * p, c - first, x->qx, x->x_bf16, b, yp, ldy, r_lo, r_hi, acc);
}

/* y[:, col_p : col_p + n_p] = x W_p^T + bias_p for the `parts` weights w[4p .. 4p + 3] side by side
 * (all taking k = w[2] inputs), bias [sum n_p] in x's dtype or NULL: x quantized once, one parallel
 * region over every part's chunks (a packed layer's slices are one fork, not one each). Packed parts
 * (types 9-14) take their panels at every row count (one activation level only); the others stream
 * their rows, or from PANEL_MIN_ROWS rows (one level) take per-call panels. Returns 0, 1 for packed
 * parts at two levels, or 2 without memory. `side` (or NULL): memory the caller reads next, fetched
 * meanwhile (side_stream.h), each thread its share spread over its items. */
static int linear_parts(const int64_t *w, int64_t parts, const void *x, int64_t ldx, int x_flags, const void *bias,
                        void *y, int64_t ldy, int64_t m, int num_threads, const int64_t *side) {
    const int64_t k = w[2];
    const int x_bf16 = x_flags & X_BF16, two = !x_bf16 && (x_flags & X_TWO_LEVELS);
    const int panel = QK_PATH > 0 && !two && m >= PANEL_MIN_ROWS;
    int need32 = 0, need256 = 0, packed32 = 0, packed256 = 0, streamed = 0;
    int64_t num_chunks = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int type = (int)w[4 * p + 3];
        if (type >= 12) packed256 = 1;
        else if (is_packed_type(type)) packed32 = 1;
        else if (type <= 5) need256 = streamed = 1;
        else need32 = streamed = 1;
        num_chunks += (w[4 * p + 1] + N_CHUNK - 1) / N_CHUNK;
    }
    if ((packed32 || packed256) && two) return 1;
    qx_t qx;
    px_t px32, px256;
    memset(&qx, 0, sizeof(qx)), memset(&px32, 0, sizeof(px32)), memset(&px256, 0, sizeof(px256));
    const int want32 = packed32 || (panel && need32), want256 = packed256 || (panel && need256);
    const int private_x = m <= PRIVATE_X_ROWS && (want32 || want256);
    if (!private_x && px_layout(m, k, want32, want256, &px32, &px256)) return 2;
    if (streamed && !panel && quantize_x(x, ldx, x_bf16, m, k, two, need32, need256, &qx)) return 2;
    int64_t panel_bytes = 0;
#if QK_PATH > 0
    if (panel && streamed) panel_bytes = panel_bytes_of(w, parts);
#endif
    int failed = 0;
    /* Work items: (block of M_BLOCK x rows, chunk of N_CHUNK weight rows), the chunks of one block in a
     * row, so a block's quants stay in L2 while the weights stream past (a decode step is one block).
     * guided: a thread slowed by a neighbour's process takes fewer items, at few claims per call. */
    const int64_t m_block = panel ? PANEL_M_BLOCK : M_BLOCK, num_items = (m + m_block - 1) / m_block * num_chunks;
#pragma omp parallel num_threads(num_threads)
    {
        float *acc = malloc(sizeof(float) * (size_t)(m_block * N_CHUNK));
        uint8_t *panels = panel_bytes > 0 ? thread_scratch(1, (size_t)panel_bytes) : NULL;
        px_t own32, own256; /* private_x: this thread's quants of every row */
        const px_t *p32 = &px32, *p256 = &px256;
        int bad = acc == NULL || (panel_bytes > 0 && panels == NULL);
        if (private_x) {
            bad = bad || px_layout(m, k, want32, want256, &own32, &own256);
            if (!bad) quantize_panel_rows(x, ldx, x_bf16, 0, m, &own32, &own256);
            p32 = &own32, p256 = &own256;
        }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
        if (!private_x && (px32.xq != NULL || px256.xq != NULL)) { /* shared: every thread its share first */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_panel_rows(x, ldx, x_bf16, r, r + 1, &px32, &px256);
        }
        int64_t tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num(), nth = omp_get_num_threads();
#endif
        side_t sd;
        const int64_t lines = side_share(side, tid, nth, &sd); /* over about num_items / nth items */
        const int64_t per_item = lines > 0 ? (lines * nth + num_items - 1) / num_items : 0;
        const act_t act = {&qx, p32, p256, panel, x_bf16};
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < num_items; item++) {
            if (bad) continue;
            if (per_item > 0) side_fetch(&sd, per_item);
            const int64_t r_lo = item / num_chunks * m_block, r_hi = r_lo + m_block < m ? r_lo + m_block : m;
            run_part_chunk(w, item % num_chunks, &act, bias, y, ldy, r_lo, r_hi, panels, acc);
        }
        free(acc);
    }
    return failed ? 2 : 0;
}

/* y[:, :n] = x W^T + bias for x [m, k] (row stride ldx, float32 or bf16 and its levels as x_flags
 * says), y likewise with row stride ldy, bias [n] in x's dtype or NULL. w = {address, n, k, type}.
 * Returns 0, or 1 for an unknown type or a k the type does not divide (nothing written), 2 without
 * memory. */
int quant_linear(const int64_t *w, const void *x, int64_t ldx, int x_flags, const void *bias, void *y, int64_t ldy,
                 int64_t m, int num_threads) {
    if (!weight_ok(w) || m < 0) return 1;
    return linear_parts(w, 1, x, ldx, x_flags, bias, y, ldy, m, num_threads, NULL);
}

/* The decoder stack's linear (models/decoder_stack.c's gemm_fn signature): a layer of one or more
 * quantized output slices, a = {parts, x_flags, n_total, then per part {address, n, k, type}}; y is
 * [m, n_total] contiguous, bias [n_total] or NULL. Each slice's values are those of the quant_linear
 * call the Python path (Linear._quant_forward) makes, so the two agree bit for bit. `side` (or NULL):
 * the layer's LoRA weights, fetched while the product runs (side_stream.h). Returns quant_linear's
 * status, or 1 for a bad part list. */
int quant_gemm(const int64_t *a, const void *x, int64_t ldx, const void *bias, void *y, int64_t m, int num_threads,
               const int64_t *side) {
    const int64_t parts = a[0], n_total = a[2];
    int64_t off = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *w = a + 3 + 4 * p;
        if (!weight_ok(w) || w[2] != a[3 + 2]) return 1;
        off += w[1];
    }
    if (parts < 1 || off != n_total || m < 0) return 1;
    return linear_parts(a + 3, parts, x, ldx, (int)a[1], bias, y, n_total, m, num_threads, side);
}

#include "quant_kernel_dequantize.h"
#include "quant_kernel_embed.h"
