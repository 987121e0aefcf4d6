/* Q8_0 / Q4_0 / Q4_1 packed at load in panels of 8 rows (types 9-11; formats.repack_panels lays them out;
 * the K-quants' panels, types 12-14, are quant_kernel_kpacked.h's; on AVX-512 VNNI a chunk's two panels
 * together: quant_kernel_packed_pairs.h), read by quant_kernel.c for every row count of x: one path, so a
 * row's result does not depend on how many rows share the call (a speculative verification's rows get the
 * values one decode row gets).
 *
 * Shape: rows [8p, 8p + 8) of W [n, k] (n a multiple of 8) are panel p: k / 32 blocks of 8 * TYPE_SIZE
 * bytes, the file's bytes reordered (RSS stays the file's size):
 *   Q8_0: 8 steps of 32 bytes (step t: quants 4t .. 4t + 3 of rows 0-7, row-major), then 8 float16 scales;
 *   Q4_0 / Q4_1: 4 steps of 32 bytes (step t: nibble bytes 4t .. 4t + 3 of rows 0-7: low nibbles weights
 *   4t .. 4t + 3, high ones 16 + 4t .. 16 + 4t + 3), then 8 float16 scales (Q4_1: then 8 mins).
 * Semantics: out[m][j] = sum over blocks b in order of  i * (s * dx) + a * xs  (i = u . xq, the exact
 * int32 dot of the block's unsigned nibbles u (Q4; Q8_0 its signed quants) with x's int8 quants; dx, xs
 * = dx * sum(xq) x's per-32 scale and sum (quantize_panel_row); s the row's scale, a Q4_1's min or
 * Q4_0's -8 s; Q8_0 has no a term), float32, one FMA each, the same operations for any m.
 * Why this shape (llama.cpp's repack.cpp block_q4_0x8, done once at load): one broadcast of 4 x bytes
 * feeds 8 weight rows, the lanes are the rows (nothing folds across lanes), the byte products add up in
 * int16 over the block (2 * 15 * 127 * 8 < 32767; Q8_0's signed ones widen every step), and nothing is
 * unpacked per call but nibbles (and, shift), so one decode row streams the bytes at the read bound and
 * many rows run the panels' compute rate (quant_kernel_panel.h unpacks file-layout chunks per call). */
#ifndef LORASERVE_QUANT_KERNEL_PACKED_H
#define LORASERVE_QUANT_KERNEL_PACKED_H

#define PACKED_FIRST 9 /* type codes 9-11: Q8_0, Q4_0, Q4_1 in panels; 12-14: Q4_K, Q5_K, Q6_K */
#define PACKED_MR 4     /* x rows per pass over a panel (run_packed_chunk's cases) */
#ifndef PACKED_SPLIT
#define PACKED_SPLIT 2 /* VNNI: int32 chains per x row (packed_steps; 1-4; 4 for 1-2 rows measured no faster) */
#endif
#ifndef PACKED_AHEAD
#define PACKED_AHEAD 16 /* blocks read ahead while streaming (4 left one thread at ~60% of its read bandwidth) */
#endif
static inline int is_packed_type(int type) { return type >= PACKED_FIRST; }
/* Read ahead the block `ahead` blocks of `bytes` past p (a panel streamed from memory). */
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes, int ahead) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + ahead * bytes + at, 0, 0);
}
static inline int64_t packed_block_bytes(int type) { return 8 * (int64_t)TYPE_SIZE[type]; }
static inline int packed_qbytes(int type) { return type == 9 ? 256 : 128; }

#if QK_PATH > 0
/* Q4_0 / Q4_1 step t of a panel block: the 8 rows' low nibbles (weights 4t .. 4t + 3) and high ones
 * (16 + 4t ..); packed_x_words: an x row's 4 bytes for each (wl, wh). */
static inline __attribute__((always_inline)) void packed_nibbles(const uint8_t *pq, int t, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(15), v = _mm256_loadu_si256((const __m256i *)(pq + 32 * t));
    *lo = _mm256_and_si256(v, low4), *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}
static inline void packed_x_words(const int8_t *xr, int t, int32_t *wl, int32_t *wh) {
    memcpy(wl, xr + 4 * t, 4), memcpy(wh, xr + 16 + 4 * t, 4);
}

/* The int32 block dots, lane j = panel row j, of a panel block pq against mr rows of x (xb: each row's
 * 32 quants of the block). */
static inline __attribute__((always_inline)) void packed_steps(int type, const uint8_t *pq, const int8_t *const *xb,
                                                               int mr, __m256i *s32) {
#if QK_PATH == 2
    /* A vpdpbusd waits 4-5 cycles for its accumulator: one chain per x row (8 in a row per block) kept 2-3
     * rows 10-20% under two chains (Zen 4, 1 thread, in L2). So each row sums in `split` chains (step t
     * into chain t % split), added at the block's end: int32, exact in any order, so a row's result is
     * the same for every split and row count. */
    const int split = PACKED_SPLIT;
    __m256i part[PACKED_MR][4];
    for (int i = 0; i < mr; i++) {
        part[i][0] = s32[i];
        for (int h = 1; h < split; h++) part[i][h] = _mm256_setzero_si256();
    }
    if (type == 9) { /* w + 128 (w's sign bit flipped) is unsigned: s32 enters as -128 sum(x) (packed_dot) */
        for (int t = 0; t < 8; t++) {
            const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(pq + 32 * t)), _mm256_set1_epi8(-128));
            for (int i = 0; i < mr; i++) {
                int32_t word;
                memcpy(&word, xb[i] + 4 * t, 4);
                part[i][t % split] = _mm256_dpbusd_epi32(part[i][t % split], wu, _mm256_set1_epi32(word));
            }
        }
    } else {
        for (int t = 0; t < 4; t++) {
            __m256i lo, hi;
            packed_nibbles(pq, t, &lo, &hi);
            for (int i = 0; i < mr; i++) {
                int32_t wl, wh;
                packed_x_words(xb[i], t, &wl, &wh);
                const int a = (2 * t) % split, b = (2 * t + 1) % split;
                part[i][a] = _mm256_dpbusd_epi32(part[i][a], lo, _mm256_set1_epi32(wl));
                part[i][b] = _mm256_dpbusd_epi32(part[i][b], hi, _mm256_set1_epi32(wh));
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        for (int h = 1; h < split; h++) part[i][0] = _mm256_add_epi32(part[i][0], part[i][h]);
        s32[i] = part[i][0];
    }
#else
    if (type == 9) { /* signed: |w| times x with w's sign, widened every step */
        for (int t = 0; t < 8; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(pq + 32 * t)), wa = _mm256_abs_epi8(w);
            for (int i = 0; i < mr; i++) {
                int32_t word;
                memcpy(&word, xb[i] + 4 * t, 4);
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(word), w);
                s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, x), _mm256_set1_epi16(1)));
            }
        }
        return;
    }
    __m256i s16[PACKED_MR];
    for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        __m256i lo, hi;
        packed_nibbles(pq, t, &lo, &hi);
        for (int i = 0; i < mr; i++) {
            int32_t wl, wh;
            packed_x_words(xb[i], t, &wl, &wh);
            const __m256i xl = _mm256_set1_epi32(wl), xh = _mm256_set1_epi32(wh);
            s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
            __asm__("" : "+x"(s16[i])); /* each row's sum in a register (see panel_steps) */
        }
    }
    for (int i = 0; i < mr; i++) s32[i] = _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1));
#endif
}

/* out[i * ld + j] = panel row j . x row r0 + i for i < mr (<= PACKED_MR), as the header's semantics;
 * `stream`: the panel comes from memory (the first x rows over it), so read ahead. */
static inline __attribute__((always_inline)) void packed_dot(int type, const uint8_t *panel, const px_t *px, int64_t r0,
                                                             int mr, int stream, float *out, int64_t ld) {
    const int64_t nb = px->nb, bb = packed_block_bytes(type);
    const int qb = packed_qbytes(type);
    __m256 acc[PACKED_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pq = panel + b * bb;
        if (stream && PACKED_AHEAD > 0) prefetch_ahead(pq, bb, PACKED_AHEAD);
        const int8_t *xb[PACKED_MR];
        __m256i s32[PACKED_MR];
        for (int i = 0; i < mr; i++) {
            xb[i] = px->xq + (r0 + i) * px->k + b * 32, s32[i] = _mm256_setzero_si256();
            if (QK_PATH == 2 && type == 9) s32[i] = _mm256_set1_epi32(-128 * px->xi[(r0 + i) * nb + b]);
        }
        packed_steps(type, pq, xb, mr, s32);
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + qb)));
        const __m256 a = type == 11 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + qb + 16)))
                                    : _mm256_mul_ps(_mm256_set1_ps(-8.0f), s);
        for (int i = 0; i < mr; i++) {
            const int64_t at = (r0 + i) * nb + b;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(s, _mm256_set1_ps(px->dx[at])), acc[i]);
            if (type != 9) acc[i] = _mm256_fmadd_ps(a, _mm256_set1_ps(px->xs[at]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * ld, acc[i]);
}
#else
/* The portable twin of packed_dot (same terms and order; separate multiply and add). */
static void packed_dot(int type, const uint8_t *panel, const px_t *px, int64_t r0, int mr, int stream, float *out,
                       int64_t ld) {
    (void)stream;
    const int64_t nb = px->nb, bb = packed_block_bytes(type);
    const int qb = packed_qbytes(type);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *pq = panel + b * bb;
                const int8_t *xb = px->xq + (r0 + i) * px->k + b * 32;
                int32_t dot = 0;
                for (int v = 0; v < 32; v++) {
                    const int q = v % 4, byte_t = type == 9 ? v / 4 : (v % 16) / 4;
                    const uint8_t byte = pq[32 * byte_t + 4 * j + q];
                    const int w = type == 9 ? (int8_t)byte : (v < 16 ? byte & 15 : byte >> 4);
                    dot += w * xb[v];
                }
                const float s = f16_to_f32(pq + qb + 2 * j);
                const float a = type == 11 ? f16_to_f32(pq + qb + 16 + 2 * j) : -8.0f * s;
                const int64_t at = (r0 + i) * nb + b;
                acc += (float)dot * (s * px->dx[at]);
                if (type != 9) acc += a * px->xs[at];
            }
            out[i * ld + j] = acc;
        }
}
#endif

#include "quant_kernel_kpacked.h"
#include "quant_kernel_packed_pairs.h"

/* One pass of mr x rows over one panel, into out (row stride N_CHUNK). */
static inline void packed_pass(int type, const uint8_t *panel, const px_t *px, int64_t r0, int mr, int stream,
                              float *out) {
    switch (type * 8 + mr) { /* type and mr constants: each loop its own registers */
#define PACKED_CASE(T, M) \
    case T * 8 + M: packed_dot(T, panel, px, r0, M, stream, out, N_CHUNK); break;
#define PACKED_TYPE(T) PACKED_CASE(T, 1) PACKED_CASE(T, 2) PACKED_CASE(T, 3) PACKED_CASE(T, 4)
        PACKED_TYPE(9) PACKED_TYPE(10) PACKED_TYPE(11)
#define KPACKED_CASE(T, M) \
    case T * 8 + M: packed_kdot(T, panel, px, r0, M, stream, out, N_CHUNK); break;
#define KPACKED_TYPE(T) KPACKED_CASE(T, 1) KPACKED_CASE(T, 2) KPACKED_CASE(T, 3) KPACKED_CASE(T, 4)
        KPACKED_TYPE(12) KPACKED_TYPE(13) KPACKED_TYPE(14)
#undef KPACKED_TYPE
#undef KPACKED_CASE
#undef PACKED_TYPE
#undef PACKED_CASE
    default: break;
    }
}

#ifdef PACKED_PAIRS
/* Whether the pass that streams a chunk from memory takes both panels at once for `rows` x rows. One
 * panel at a time, Q4_K's and Q5_K's streaming pass ran at about half a pair pass's rate (4 rows of
 * Llama-3.2-1B-shaped linears, 2 Zen 4 threads: 37.5 ms, where each further pair pass of 4 took 15-20),
 * so from 8 rows they stream in pairs: 8 / 32 rows Q4_K 63.4 / 156.7 -> 50.3 / 142.1 ms, Q5_K 85.1 /
 * 192.4 -> 70.8 / 180.0; with fewer rows memory decides and one panel at a time read faster (2 rows
 * 23.0 against 28.8 ms; 1-4 rows 0.6-0.8x as fast in pairs, one Q4_K row 2.4x slower, with and
 * without read-ahead). Q6_K streamed in pairs ran slower at every row count (8 / 32 rows 64.5 /
 * 179.5 -> 84.0 / 203.1 ms, reading 4 super-blocks ahead), Q4_1 no faster (SmolLM2's shapes). */
static inline int stream_in_pairs(int type, int64_t rows) { return (type == 12 || type == 13) && rows >= 8; }
#endif

/* x rows of the pass that streams a chunk from memory. From 8 rows Q6_K's takes one, memory-bound (its
 * one-row decode), and leaves the rest to the passes in cache, in pairs (AVX-512 VNNI builds):
 * 16 / 32 rows of Llama-3.2-1B-shaped linears, 2 Zen 4 threads, 129.5 / 199.8 -> 121.5 / 185.9 ms.
 * Q4_1's 8 / 32 rows of SmolLM2's shapes ran slower so (5.5 / 16.2 -> 6.0 / 17.0 ms). */
static inline int64_t streamed_rows(int type, int64_t rows) {
#ifdef PACKED_PAIRS
    if (type == 14 && rows >= 8) return 1;
#endif
    (void)type, (void)rows;
    return PACKED_MR;
}

/* The most x rows a pass over a chunk in cache takes: 4, and on AVX-512 VNNI builds 6 for Q5_K's and
 * Q6_K's pairs, whose unpacking of each step's weights then serves more rows (one panel pair, in L1,
 * one Zen 4 thread: Q6_K 124 -> 139.5 G multiply-adds a second, Q5_K 143 -> 151.5; Q4_K 183 -> 182,
 * and 8 rows 176, so it keeps 4). */
static inline int cache_pass_rows(int type, int count) {
#ifdef PACKED_PAIRS
    if (count == 2 && (type == 13 || type == 14)) return KPAIR_MR;
#endif
    (void)type, (void)count;
    return PACKED_MR;
}

/* Pass `index` of the `passes` over a chunk in cache fetches its share of the next chunk's `total`
 * bytes (the ones right after this chunk, usually the next work item of this thread: guided schedule)
 * into L2, so that chunk's streaming pass finds them there and memory works while these passes compute
 * (where it had waited for the streaming pass). Llama-3.2-1B-shaped linears, 2 Zen 4 threads, one
 * process alternating builds: 32 rows Q4_K 123.4 / 132.1 -> 114.4 / 118.5 ms, Q5_K 159.9 -> 141.5,
 * Q6_K 203.7 -> 189.4; 16 rows Q4_K 68.1 -> 62.4. At 8 rows it ran slower (Q4_K 44.5 -> 45.7 ms, Q6_K
 * 59.2 -> 63.7), so run_packed_chunk asks for it from 9 rows (FETCH_ROWS). */
#define FETCH_ROWS 9
static inline void fetch_next_share(const uint8_t *next, int64_t total, int64_t index, int64_t passes) {
    const int64_t share = (total / passes + 63) & ~(int64_t)63, from = index * share;
    for (int64_t b = from; b < from + share && b < total; b += 64) __builtin_prefetch(next + b, 0, 2);
}

#include "quant_kernel_kbytes.h"

/* Chunk c (N_CHUNK rows: two panels) of packed weight w against x rows [r_lo, r_hi) into y (acc:
 * [r_hi - r_lo][N_CHUNK] scratch). The passes in cache split the rows after the streaming pass's
 * evenly (31 rows at 6 at most: 6 5 5 5 5 5, not 6 6 6 6 6 1). */
static void run_packed_chunk(const int64_t *w, int64_t c, const px_t *px, int x_bf16, const void *bias, void *y,
                             int64_t ldy, int64_t r_lo, int64_t r_hi, float *acc) {
    const chunk_t ch = chunk_of(w, c);
    const int64_t bytes = 8 * ch.row_bytes;
    const int count = (int)((ch.n1 - ch.n0) / 8);
    const uint8_t *panels = ch.wp + ch.n0 / 8 * bytes;
    const int fetch = r_hi - r_lo >= FETCH_ROWS;
#ifdef PACKED_PAIRS
    uint8_t *u8 = unpack_chunk(ch.type, count, r_hi - r_lo) ? thread_scratch(3, KBYTES_SLAB * KBYTES_SB) : NULL;
    if (u8 != NULL) { /* without the room (malloc failed) the panels' passes give the same bits */
        run_unpacked_chunk(ch.type, panels, bytes, px, r_lo, r_hi, fetch, u8, acc);
        store_chunk(acc, x_bf16, bias, y, ldy, ch.n0, ch.n1, r_lo, r_hi);
        return;
    }
#endif
    const int64_t first = streamed_rows(ch.type, r_hi - r_lo), most = cache_pass_rows(ch.type, count);
    const int64_t passes = r_hi - r_lo > first ? (r_hi - r_lo - first + most - 1) / most : 0;
    int64_t index = 0;
    for (int64_t r0 = r_lo, step; r0 < r_hi; r0 += step) {
        const int stream = r0 == r_lo;
        step = stream ? (first < r_hi - r0 ? first : r_hi - r0) : (r_hi - r0 + passes - index - 1) / (passes - index);
        const int mr = (int)step;
        float *a = acc + (r0 - r_lo) * N_CHUNK;
        if (!stream && fetch) fetch_next_share(panels + count * bytes, count * bytes, index, passes);
        index += !stream;
#ifdef PACKED_PAIRS
        /* Both panels in 512-bit registers for the passes over a chunk in cache; the first pass, which
         * streams it from memory, keeps one panel at a time (stream_in_pairs says when not). */
        if (count == 2 && (!stream || stream_in_pairs(ch.type, r_hi - r_lo))) {
            pair_pass(ch.type, panels, bytes, px, r0, mr, a); /* Q4_K / Q5_K stream without read-ahead */
            continue;
        }
#endif
        for (int p = 0; p < count; p++) packed_pass(ch.type, panels + p * bytes, px, r0, mr, stream, a + p * 8);
    }
    store_chunk(acc, x_bf16, bias, y, ldy, ch.n0, ch.n1, r_lo, r_hi);
}

#endif
