/* Q8_0 / Q4_0 / Q4_1 (and Q4_K, packed_kdot) packed at load in panels of 8 rows (types 9-12; formats.repack_panels lays them
 * out), read by quant_kernel.c for every row count of x: one path, so a row's result does not depend on
 * how many rows share the call (a speculative verification's rows get the values one decode row gets).
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

#define PACKED_FIRST 9 /* type codes 9-11: Q8_0, Q4_0, Q4_1 in panels; 12: Q4_K */
#define PACKED_MR 4     /* x rows per pass over a panel (run_packed_chunk's cases) */
#ifndef PACKED_AHEAD
#define PACKED_AHEAD 16 /* blocks read ahead while streaming (4 left one thread at ~60% of its read bandwidth) */
#endif
static inline int is_packed_type(int type) { return type >= PACKED_FIRST; }
static inline int64_t packed_block_bytes(int type) { return 8 * (int64_t)TYPE_SIZE[type]; }
/* Q4_K's panel, per super-block: 4 sub-block pairs of 8 steps (step t of pair j: nibble bytes 32j + 4t ..
 * + 3 of rows 0-7: low nibbles sub-block 2j, high 2j + 1), then the six-bit scales and mins as bytes
 * [sub-block][row], then the rows' float16 d, then their dmin: 1184 bytes (148 a row, the file's 144
 * with its 12 packed scale bytes spread to 16). */
enum { PK_SC = 1024, PK_MN = 1088, PK_D = 1152, PK_DMIN = 1168 };
static inline int packed_qbytes(int type) { return type == 9 ? 256 : 128; }

#if QK_PATH > 0
/* The int32 block dots, lane j = panel row j, of a panel block pq against mr rows of x (xb: each row's
 * 32 quants of the block). */
static inline __attribute__((always_inline)) void packed_steps(int type, const uint8_t *pq, const int8_t *const *xb,
                                                               int mr, __m256i *s32) {
    if (type == 9) { /* signed: |w| times x with w's sign, widened every step */
        for (int t = 0; t < 8; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(pq + 32 * t)), wa = _mm256_abs_epi8(w);
            for (int i = 0; i < mr; i++) {
                int32_t word;
                memcpy(&word, xb[i] + 4 * t, 4);
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(word), w);
#if QK_PATH == 2
                s32[i] = _mm256_dpbusd_epi32(s32[i], wa, x);
#else
                s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, x), _mm256_set1_epi16(1)));
#endif
            }
        }
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i s16[PACKED_MR];
    for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(pq + 32 * t));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int i = 0; i < mr; i++) {
            int32_t wl, wh;
            memcpy(&wl, xb[i] + 4 * t, 4), memcpy(&wh, xb[i] + 16 + 4 * t, 4);
            const __m256i xl = _mm256_set1_epi32(wl), xh = _mm256_set1_epi32(wh);
#if QK_PATH == 2
            s32[i] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s32[i], lo, xl), hi, xh);
#else
            s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
            __asm__("" : "+x"(s16[i])); /* each row's sum in a register (see panel_steps) */
#endif
        }
    }
#if QK_PATH != 2
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
        if (stream && PACKED_AHEAD > 0)
            for (int64_t at = 0; at < bb; at += 64) __builtin_prefetch(pq + PACKED_AHEAD * bb + at, 0, 0);
        const int8_t *xb[PACKED_MR];
        __m256i s32[PACKED_MR];
        for (int i = 0; i < mr; i++) xb[i] = px->xq + (r0 + i) * px->k + b * 32, s32[i] = _mm256_setzero_si256();
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
/* Q4_K: out[i * ld + j] = panel row j . x row r0 + i over the super-blocks, x per 256 (px: its d per
 * 32-block, the same for a super-block's 8, and xi its integer sums): per super-block
 * d dx sum_s sc_s (q_s . xq_s) - dmin dx sum_s mn_s sum(xq_s), both sums exact in int32 (each
 * sub-block's int16 byte-pair sums widened by vpmaddwd against its scale; at most 8 x 63 x 30480 <
 * 2^31), then two FMAs. */
static inline __attribute__((always_inline)) void packed_kdot(const uint8_t *panel, const px_t *px, int64_t r0, int mr,
                                                              int stream, float *out, int64_t ld) {
    const int64_t nsb = px->k / 256, bb = 8 * (int64_t)TYPE_SIZE[12];
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[PACKED_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *pq = panel + sb * bb;
        if (stream && PACKED_AHEAD > 0)
            for (int64_t at = 0; at < bb; at += 64) __builtin_prefetch(pq + 2 * bb + at, 0, 0);
        __m256i isum[PACKED_MR], imin[PACKED_MR];
        for (int i = 0; i < mr; i++) isum[i] = imin[i] = _mm256_setzero_si256();
        for (int sub = 0; sub < 8; sub++) {
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pq + PK_SC + 8 * sub)));
            const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); /* the row's scale in both halves */
            __m256i s16[PACKED_MR];
            for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(pq + 256 * (sub / 2) + 32 * t));
                const __m256i w = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
                for (int i = 0; i < mr; i++) {
                    int32_t word;
                    memcpy(&word, px->xq + (r0 + i) * px->k + sb * 256 + 32 * sub + 4 * t, 4);
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(w, _mm256_set1_epi32(word)));
                    __asm__("" : "+x"(s16[i]));
                }
            }
            for (int i = 0; i < mr; i++) isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(s16[i], sc2));
        }
        for (int sub = 0; sub < 8; sub++) {
            const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pq + PK_MN + 8 * sub)));
            for (int i = 0; i < mr; i++) {
                const int16_t xsum = px->xi[(r0 + i) * px->nb + sb * 8 + sub];
                imin[i] = _mm256_add_epi32(imin[i], _mm256_madd_epi16(mn, _mm256_set1_epi32((uint16_t)xsum)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + PK_D)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + PK_DMIN)));
        for (int i = 0; i < mr; i++) {
            const __m256 dx = _mm256_set1_ps(px->dx[(r0 + i) * px->nb + sb * 8]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, dx), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[i]), _mm256_mul_ps(dmin, dx), acc[i]);
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
/* The portable twin of packed_kdot (same integer sums, then the same two terms unfused). */
static void packed_kdot(const uint8_t *panel, const px_t *px, int64_t r0, int mr, int stream, float *out, int64_t ld) {
    (void)stream;
    const int64_t nsb = px->k / 256, bb = 8 * (int64_t)TYPE_SIZE[12];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *pq = panel + sb * bb;
                const int8_t *xb = px->xq + (r0 + i) * px->k + sb * 256;
                int32_t isum = 0, imin = 0;
                for (int sub = 0; sub < 8; sub++) {
                    int32_t dot = 0;
                    for (int v = 0; v < 32; v++) {
                        const uint8_t byte = pq[256 * (sub / 2) + 32 * (v / 4) + 4 * j + v % 4];
                        dot += (sub % 2 ? byte >> 4 : byte & 15) * xb[32 * sub + v];
                    }
                    isum += pq[PK_SC + 8 * sub + j] * dot;
                    imin += pq[PK_MN + 8 * sub + j] * px->xi[(r0 + i) * px->nb + sb * 8 + sub];
                }
                const float dx = px->dx[(r0 + i) * px->nb + sb * 8];
                acc += (float)isum * (f16_to_f32(pq + PK_D + 2 * j) * dx);
                acc -= (float)imin * (f16_to_f32(pq + PK_DMIN + 2 * j) * dx);
            }
            out[i * ld + j] = acc;
        }
}
#endif

/* Chunk c (N_CHUNK rows: two panels) of packed weight w against x rows [r_lo, r_hi) into y (acc:
 * [r_hi - r_lo][N_CHUNK] scratch). */
static void run_packed_chunk(const int64_t *w, int64_t c, const px_t *px, int x_bf16, const void *bias, void *y,
                             int64_t ldy, int64_t r_lo, int64_t r_hi, float *acc) {
    const chunk_t ch = chunk_of(w, c);
    const int64_t bytes = 8 * ch.row_bytes;
    const int count = (int)((ch.n1 - ch.n0) / 8);
    const uint8_t *panels = ch.wp + ch.n0 / 8 * bytes;
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += PACKED_MR) {
        const int mr = r_hi - r0 < PACKED_MR ? (int)(r_hi - r0) : PACKED_MR, stream = r0 == r_lo;
        float *a = acc + (r0 - r_lo) * N_CHUNK;
        for (int p = 0; p < count; p++) {
            const uint8_t *panel = panels + p * bytes;
            float *o = a + p * 8;
            switch (ch.type * 8 + mr) { /* type and mr constants: each loop its own registers */
#define PACKED_CASE(T, M) \
    case T * 8 + M: packed_dot(T, panel, px, r0, M, stream, o, N_CHUNK); break;
#define PACKED_TYPE(T) PACKED_CASE(T, 1) PACKED_CASE(T, 2) PACKED_CASE(T, 3) PACKED_CASE(T, 4)
                PACKED_TYPE(9) PACKED_TYPE(10) PACKED_TYPE(11)
            case 12 * 8 + 1: packed_kdot(panel, px, r0, 1, stream, o, N_CHUNK); break;
            case 12 * 8 + 2: packed_kdot(panel, px, r0, 2, stream, o, N_CHUNK); break;
            case 12 * 8 + 3: packed_kdot(panel, px, r0, 3, stream, o, N_CHUNK); break;
            case 12 * 8 + 4: packed_kdot(panel, px, r0, 4, stream, o, N_CHUNK); break;
#undef PACKED_TYPE
#undef PACKED_CASE
            default: break;
            }
        }
    }
    store_chunk(acc, x_bf16, bias, y, ldy, ch.n0, ch.n1, r_lo, r_hi);
}

#endif
