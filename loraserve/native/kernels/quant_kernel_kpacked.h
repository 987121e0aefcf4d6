/* Q4_K / Q5_K / Q6_K packed at load in panels of 8 rows (types 12-14; layers/quant/kpanels.py lays them
 * out), read by quant_kernel_packed.h's run_packed_chunk for every row count of x: one path, so a row's
 * result does not depend on how many rows share the call.
 *
 * Shape: per super-block (256 weights) a panel of 8 rows holds steps (32 bytes: bytes 4t .. 4t + 3 of a
 * field of rows 0-7), then scale bytes [scale][row], then the rows' float16 fields:
 *   Q4_K (12): 32 steps of nibble bytes (steps 8j .. 8j + 7: bytes 32j .. 32j + 31, low nibbles sub-block
 *              2j, high 2j + 1), 8 x 8 six-bit scales, 8 x 8 mins, d, dmin: 1184 bytes (148 a row);
 *   Q5_K (13): the same, with 8 steps of the high-bit bytes after the nibbles (byte i's bit j: weight i of
 *              sub-block j): 1440 bytes (180 a row);
 *   Q6_K (14): 32 steps of low-nibble bytes (32-byte piece 2h + r % 2 holds sub-block 4h + r's, the high
 *              nibbles for r >= 2), 16 steps of two-bit bytes (piece h: sub-block 4h + r's at bit 2r), 16 x 8
 *              int8 scales (one per 16 weights), d: 1680 bytes (210 a row, as the file).
 * Semantics: out[i][j] = sum over super-blocks, x per 256 (px: dx its d, xq its quants, xi / xi16 their
 * integer sums per 32 / 16), of
 *   Q4_K / Q5_K: d dx sum_s sc_s (q_s . xq_s) - dmin dx sum_s mn_s sum(xq_s)
 *   Q6_K:        d dx (sum_g sc_g (u_g . xq_g) - 32 sum_g sc_g sum(xq_g))     (u = q + 32, unsigned)
 * each integer sum exact in int32, then float32 FMAs: the same operations for any number of rows.
 * Why this shape (llama.cpp's q4_K x q8_K, its repack.cpp's 8-row interleave): one broadcast of 4 x bytes
 * feeds 8 rows in lanes of their own; on AVX2 the byte-pair sums (vpmaddubsw) add up in int16 until they could
 * overflow (Q4_K 8 steps: 8 x 2 x 15 x 127 < 2^15; Q5_K 4: 4 x 2 x 31 x 127; Q6_K 2: 2 x 2 x 63 x 127),
 * then vpmaddwd widens them against each lane's row scale (held in both of its int16 halves); a
 * super-block's sums stay below 2^31 (Q6_K's: 256 x 63 x 127 x 128 + 32 x 16 x 128 x 2032). */
#ifndef LORASERVE_QUANT_KERNEL_KPACKED_H
#define LORASERVE_QUANT_KERNEL_KPACKED_H

/* Super-blocks read ahead while streaming (KPACKED_AHEAD: Q6_K's). Q4_K / Q5_K read a super-block front to
 * back, and the hardware prefetchers follow: asking for 4 ahead too made one row slower (Zen 4, 1 thread:
 * the 1B file's Q4_K linears 24 against 19 ms, a Q5_K stack 36%; 2 threads: no faster). Q6_K's one-row
 * pass reads three places of a super-block at once (two low-nibble pieces, the two-bit bytes), which they
 * do not follow: 4 ahead (0 ran 4.5x slower, 8 12-20% slower; 2 left it at ~80% of 4's rate on Zen 3). */
#ifndef KPACKED_AHEAD
#define KPACKED_AHEAD 4
#endif
static inline int kpacked_ahead(int type) { return type == 14 ? KPACKED_AHEAD : 0; }
enum { K5_QH = 1024, K6_QH = 1024, K6_SC = 1536, K6_D = 1664 };
/* Q4_K / Q5_K: where a super-block's scales start (the mins, d and dmin follow at +64, +128, +144). */
static inline int kpanel_sc(int type) { return type == 12 ? 1024 : 1280; }
/* The unsigned quant of row j's weight v (0-31) of sub-block sub (the portable twin's reading). */
static inline int kpanel_quant(int type, const uint8_t *pq, int sub, int v, int j) {
    const int at = 32 * (v / 4) + 4 * j + v % 4;
    if (type == 14) {
        const int h = sub / 4, r = sub % 4;
        const uint8_t ql = pq[256 * (2 * h + r % 2) + at], qh = pq[K6_QH + 256 * h + at];
        return (r >= 2 ? ql >> 4 : ql & 15) | (((qh >> (2 * r)) & 3) << 4);
    }
    const uint8_t b = pq[256 * (sub / 2) + at];
    const int q = sub % 2 ? b >> 4 : b & 15;
    return type == 13 ? q | (((pq[K5_QH + at] >> sub) & 1) << 4) : q;
}

#if QK_PATH > 0
/* Step t of sub-block sub: its 32 unsigned quants (4 weights of rows 0-7). */
static inline __attribute__((always_inline)) __m256i kpanel_step(int type, const uint8_t *pq, int sub, int t) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (type == 14) {
        const int h = sub / 4, r = sub % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(pq + 256 * (2 * h + r % 2) + 32 * t));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(pq + K6_QH + 256 * h + 32 * t));
        const __m256i lo = _mm256_and_si256(r >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
        /* bits 2r, 2r + 1 to 4, 5 (a 16-bit shift by at most 4 moves no wanted bit across a byte) */
        const __m256i hi = r < 2 ? _mm256_slli_epi16(qh, 4 - 2 * r) : r == 2 ? qh : _mm256_srli_epi16(qh, 2);
        return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(pq + 256 * (sub / 2) + 32 * t));
    const __m256i w = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
    if (type != 13) return w;
    const __m256i h = _mm256_loadu_si256((const __m256i *)(pq + K5_QH + 32 * t));
    const __m256i bit = sub <= 4 ? _mm256_slli_epi16(h, 4 - sub) : _mm256_srli_epi16(h, sub - 4); /* bit sub to 4 */
    return _mm256_or_si256(w, _mm256_and_si256(bit, _mm256_set1_epi8(16)));
}

/* The 8 rows' scale for step t of sub-block sub, one int32 a lane. */
static inline __attribute__((always_inline)) __m256i kpanel_scale32(int type, const uint8_t *pq, int sub, int t) {
    return type == 14 ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(pq + K6_SC + 8 * (2 * sub + t / 4))))
                      : _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pq + kpanel_sc(type) + 8 * sub)));
}

#if QK_PATH == 2
/* AVX512-VNNI: vpdpbusd adds each step's byte products into int32 at once, so the steps that share a
 * scale (a sub-block; Q6_K: 16 weights, 4 steps) sum there, then one vpmulld by the rows' scales: 2
 * instructions a step and x row (broadcast, product) where vpmaddubsw takes 3. */
static inline int kpanel_widen(int type) { return type == 14 ? 4 : 8; }
/* One x row's even and odd steps in sums of their own: a vpdpbusd waits 4-5 cycles for the sum it adds
 * to, and one row has only 2-4 sub-blocks' chains (Zen 4, one Q4_K row in L2: 57-60 G MAC/s against 53
 * with one sum; 4 sums no faster than 2; 4 x rows split 8 ways spilled). */
#ifndef KSPLIT
#define KSPLIT 2
#endif
#define KSUM_STEP(s, w, x) ((s) = _mm256_dpbusd_epi32((s), (w), (x)))
static inline __attribute__((always_inline)) __m256i kpanel_scaled(int type, const uint8_t *pq, int sub, int t, __m256i s) {
    return _mm256_mullo_epi32(s, kpanel_scale32(type, pq, sub, t));
}
#else
/* AVX2: the byte-pair sums add up in int16 for as many steps as cannot overflow, then vpmaddwd widens them
 * against the rows' scales (each in both int16 halves of its lane). */
static inline int kpanel_widen(int type) { return type == 12 ? 8 : type == 13 ? 4 : 2; }
#define KSPLIT 1 /* the int16 sums' vpaddw waits one cycle: one chain keeps up */
#define KSUM_STEP(s, w, x) ((s) = _mm256_add_epi16((s), _mm256_maddubs_epi16((w), (x))))
static inline __attribute__((always_inline)) __m256i kpanel_scaled(int type, const uint8_t *pq, int sub, int t, __m256i s) {
    const __m256i sc = kpanel_scale32(type, pq, sub, t);
    return _mm256_madd_epi16(s, type == 14 ? _mm256_blend_epi16(sc, _mm256_slli_epi32(sc, 16), 0xaa)
                                           : _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
}
#endif
/* isum[i] += super-block pq's sum over sub-blocks of scale x (q . xq) for x rows r0 .. r0 + mr - 1. */
static inline __attribute__((always_inline)) void kpanel_sums(int type, const uint8_t *pq, const px_t *px, int64_t r0,
                                                              int mr, int64_t sb, __m256i *isum) {
    const int widen = kpanel_widen(type);
    for (int sub = 0; sub < 8; sub++)
        for (int t0 = 0; t0 < 8; t0 += widen) {
            __m256i part[PACKED_MR];
            for (int i = 0; i < mr; i++) part[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = t0; t < t0 + widen; t++) {
                const __m256i w = kpanel_step(type, pq, sub, t);
                for (int i = 0; i < mr; i++) {
                    int32_t word;
                    memcpy(&word, px->xq + (r0 + i) * px->k + sb * 256 + 32 * sub + 4 * t, 4);
                    KSUM_STEP(part[i], w, _mm256_set1_epi32(word));
                    __asm__("" : "+x"(part[i])); /* each row's sum in a register (see panel_steps) */
                }
            }
            for (int i = 0; i < mr; i++) isum[i] = _mm256_add_epi32(isum[i], kpanel_scaled(type, pq, sub, t0, part[i]));
        }
}

/* kpanel_sums for one x row (xs: its super-block's 256 quants): a step's load feeds every sub-block it
 * holds (Q4_K / Q5_K: the low and high nibbles, 2 sub-blocks; Q6_K: two low-nibble loads and one two-bit
 * load, 4), the x row's one decode stream being bound by the instructions per weight byte. The same
 * integer sum as kpanel_sums (exact: the order of int32 additions does not matter). */
static inline __attribute__((always_inline)) __m256i kpanel_sums1(int type, const uint8_t *pq, const int8_t *xs) {
    const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    const int pieces = type == 14 ? 2 : 4, subs = type == 14 ? 4 : 2, widen = kpanel_widen(type);
    __m256i isum = _mm256_setzero_si256();
    for (int p = 0; p < pieces; p++)
        for (int t0 = 0; t0 < 8; t0 += widen) {
            __m256i part[KSPLIT][4];
            for (int h = 0; h < KSPLIT; h++)
                for (int u = 0; u < subs; u++) part[h][u] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = t0; t < t0 + widen; t++) {
                __m256i w[4];
                if (type == 14) { /* sub-blocks 4p + r: r = 0, 1 low nibbles of pieces 2p, 2p + 1; 2, 3 high */
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(pq + 512 * p + 32 * t));
                    const __m256i b = _mm256_loadu_si256((const __m256i *)(pq + 512 * p + 256 + 32 * t));
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(pq + K6_QH + 256 * p + 32 * t));
                    w[0] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), two));
                    w[1] = _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), two));
                    w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, two));
                    w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(h, 2), two));
                } else { /* sub-blocks 2p (low nibbles), 2p + 1 (high) */
                    w[0] = kpanel_step(type, pq, 2 * p, t), w[1] = kpanel_step(type, pq, 2 * p + 1, t);
                }
                for (int u = 0; u < subs; u++) {
                    int32_t word;
                    memcpy(&word, xs + 32 * (subs * p + u) + 4 * t, 4);
                    KSUM_STEP(part[t % KSPLIT][u], w[u], _mm256_set1_epi32(word));
                }
            }
            for (int u = 0; u < subs; u++) {
                for (int h = 1; h < KSPLIT; h++) part[0][u] = _mm256_add_epi32(part[0][u], part[h][u]);
                isum = _mm256_add_epi32(isum, kpanel_scaled(type, pq, subs * p + u, t0, part[0][u]));
            }
        }
    return isum;
}

#if QK_PATH == 2
/* The x sums' terms of a super-block for x rows r0 .. r0 + mr - 1: Q6_K's 32 sum_g sc_g sum(xq_g) off
 * isum, Q4_K / Q5_K's sum_s mn_s sum(xq_s) into imin. vpdpwssd multiplies two groups a lane at once (the
 * scale bytes of groups g, g + 1 interleaved to int16 pairs, once for all the rows; x's sums of g, g + 1
 * are adjacent int16, one broadcast): 1 instruction a pair of groups and row where vpmaddwd and the add
 * took 2 a group. The int32 sums are exact, so the result is the same. */
static inline __attribute__((always_inline)) void kpanel_offsets(int type, const uint8_t *pq, const px_t *px,
                                                                 int64_t r0, int mr, int64_t sb, __m256i *isum,
                                                                 __m256i *imin) {
    const uint8_t *s = pq + (type == 14 ? K6_SC : kpanel_sc(type) + 64);
    __m256i off[PACKED_MR];
    for (int i = 0; i < mr; i++) off[i] = _mm256_setzero_si256();
    for (int h = 0; h < (type == 14 ? 8 : 4); h++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + 16 * h)); /* groups 2h, 2h + 1 */
        const __m128i mixed = _mm_unpacklo_epi8(b, _mm_srli_si128(b, 8));  /* lane j: (2h, 2h + 1) of row j */
        const __m256i w = type == 14 ? _mm256_cvtepi8_epi16(mixed) : _mm256_cvtepu8_epi16(mixed);
        for (int i = 0; i < mr; i++) {
            const int16_t *xsum = type == 14 ? px->xi16 + ((r0 + i) * px->nb + sb * 8) * 2 : px->xi + (r0 + i) * px->nb + sb * 8;
            int32_t two;
            memcpy(&two, xsum + 2 * h, 4);
            off[i] = _mm256_dpwssd_epi32(off[i], w, _mm256_set1_epi32(two));
        }
    }
    for (int i = 0; i < mr; i++) {
        if (type == 14) isum[i] = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(off[i], 5));
        else imin[i] = off[i];
    }
}
#endif

/* out[i * ld + j] = panel row j . x row r0 + i for i < mr (<= PACKED_MR), as the header's semantics;
 * `stream`: the panel comes from memory, so read ahead. */
static inline __attribute__((always_inline)) void packed_kdot(int type, const uint8_t *panel, const px_t *px, int64_t r0,
                                                              int mr, int stream, float *out, int64_t ld) {
    const int64_t nsb = px->k / 256, bb = 8 * (int64_t)TYPE_SIZE[type];
    __m256 acc[PACKED_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *pq = panel + sb * bb;
        if (stream && kpacked_ahead(type) > 0) prefetch_ahead(pq, bb, kpacked_ahead(type));
        __m256i isum[PACKED_MR], imin[PACKED_MR];
        for (int i = 0; i < mr; i++) isum[i] = imin[i] = _mm256_setzero_si256();
        if (mr == 1) isum[0] = kpanel_sums1(type, pq, px->xq + r0 * px->k + sb * 256);
        else kpanel_sums(type, pq, px, r0, mr, sb, isum);
#if QK_PATH == 2
        kpanel_offsets(type, pq, px, r0, mr, sb, isum, imin);
#else
        for (int g = 0; g < (type == 14 ? 16 : 8); g++) { /* Q6_K: 32 sc_g sum_g off isum; else mn_s sum_s */
            const uint8_t *s = pq + (type == 14 ? K6_SC : kpanel_sc(type) + 64) + 8 * g;
            const __m128i b = _mm_loadl_epi64((const __m128i *)s);
            const __m256i v = type == 14 ? _mm256_slli_epi32(_mm256_cvtepi8_epi32(b), 5) : _mm256_cvtepu8_epi32(b);
            for (int i = 0; i < mr; i++) {
                const int16_t xsum = type == 14 ? px->xi16[((r0 + i) * px->nb + sb * 8) * 2 + g]
                                                : px->xi[(r0 + i) * px->nb + sb * 8 + g];
                const __m256i term = _mm256_madd_epi16(v, _mm256_set1_epi32((uint16_t)xsum));
                if (type == 14) isum[i] = _mm256_sub_epi32(isum[i], term);
                else imin[i] = _mm256_add_epi32(imin[i], term);
            }
        }
#endif
        const int d_at = type == 14 ? K6_D : kpanel_sc(type) + 128;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + d_at)));
        const __m256 dmin = type == 14 ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pq + d_at + 16)));
        for (int i = 0; i < mr; i++) {
            const __m256 dx = _mm256_set1_ps(px->dx[(r0 + i) * px->nb + sb * 8]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, dx), acc[i]);
            if (type != 14) acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[i]), _mm256_mul_ps(dmin, dx), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * ld, acc[i]);
}
#else
/* The portable twin of packed_kdot (the same integer sums, then the same terms unfused). */
static void packed_kdot(int type, const uint8_t *panel, const px_t *px, int64_t r0, int mr, int stream, float *out,
                        int64_t ld) {
    (void)stream;
    const int64_t nsb = px->k / 256, bb = 8 * (int64_t)TYPE_SIZE[type];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *pq = panel + sb * bb;
                const int8_t *xb = px->xq + (r0 + i) * px->k + sb * 256;
                const int64_t at = (r0 + i) * px->nb + sb * 8;
                int32_t isum = 0, imin = 0;
                for (int g = 0; g < 16; g++) { /* groups of 16 weights */
                    int32_t dot = 0;
                    for (int v = 16 * (g % 2); v < 16 * (g % 2) + 16; v++) dot += kpanel_quant(type, pq, g / 2, v, j) * xb[16 * g + v % 16];
                    if (type == 14) {
                        const int sc = (int8_t)pq[K6_SC + 8 * g + j];
                        isum += sc * dot - 32 * sc * px->xi16[2 * at + g];
                    } else {
                        isum += pq[kpanel_sc(type) + 8 * (g / 2) + j] * dot;
                        if (g % 2) imin += pq[kpanel_sc(type) + 64 + 8 * (g / 2) + j] * px->xi[at + g / 2];
                    }
                }
                const int d_at = type == 14 ? K6_D : kpanel_sc(type) + 128;
                acc += (float)isum * (f16_to_f32(pq + d_at + 2 * j) * px->dx[at]);
                if (type != 14) acc -= (float)imin * (f16_to_f32(pq + d_at + 16 + 2 * j) * px->dx[at]);
            }
            out[i * ld + j] = acc;
        }
}
#endif

#endif
