/* Q8_0 / Q4_0 / Q4_1 panels (quant_kernel_packed.h's layout) two at a time in 512-bit registers, on
 * AVX-512 VNNI builds: lanes 0-7 are panel p's rows, lanes 8-15 panel p + 1's (the chunk's two panels).
 *
 * Semantics and shape: packed_dot's for both panels at once (out[i * ld + j], j < 16: panel row j % 8 of
 * panel j / 8 . x row r0 + i). Every lane sums the same exact int32 dot and runs the same float operations
 * in the same order as packed_dot's lane, so its results are packed_dot's bit for bit, for any row count.
 * Why: one broadcast of 4 x bytes, one scale conversion and one float step of the epilogue each serve 16
 * weight rows instead of 8. A Zen 4 core runs a 512-bit vpdpbusd as two 256-bit halves, so the integer
 * products cost the same; what halves is every other instruction (the x broadcasts, the nibble unpacking,
 * the per-block float epilogue). In L2 on one Zen 4 thread (512 x 2048, G multiply-adds a second, 4 / 8 /
 * 16 rows): Q4_1 110 / 113 / 113 -> 131 / 137 / 139, Q8_0 102 / 110 / 120 -> 117 / 128 / 139 (the int8
 * peak: ~230). run_packed_chunk takes them for the passes over a chunk in cache only (see there). */
#ifndef LORASERVE_QUANT_KERNEL_PACKED_PAIRS_H
#define LORASERVE_QUANT_KERNEL_PACKED_PAIRS_H

#if QK_PATH == 2 && defined(__AVX512F__) && defined(__AVX512BW__) && !defined(PACKED_NO_PAIRS)
#define PACKED_PAIRS 1
#define KPAIR_MR 6 /* x rows a pair pass of Q5_K / Q6_K takes at most (cache_pass_rows) */
#define KBYTES_SB 4160 /* a super-block of a panel pair unpacked (quant_kernel_kbytes.h): its quants, */
#define KBYTES_OFF 4096 /* then Q6_K's offset term (-128 sum_g sc_g sum(q_g), 16 int32) */

/* acc + the byte products of w (unsigned) and the 4 signed bytes at x, broadcast to every lane; with
 * `fold` (a constant at each call site) the broadcast is the instruction's own memory operand ({1to16})
 * instead of a vpbroadcastd of its own, which GCC does not fold: Q4_K's pairs 3-4% faster (in L2, 16-64
 * rows, 1 and 2 Zen 4 threads); Q5_K's 10-15% and Q6_K's 20% slower so, Q8_0 / Q4_0 / Q4_1 no faster. */
static inline __attribute__((always_inline)) __m512i dpbusd_x4(__m512i acc, __m512i w, const int8_t *x, int fold) {
    if (fold) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
        return acc;
    }
    int32_t word;
    memcpy(&word, x, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(word));
}

/* 32 bytes at p (panel p) and 32 at p + other (panel p + 1) as one register. */
static inline __m512i pair_load(const uint8_t *p, int64_t other) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + other)), 1);
}

/* 8 float16 at p and 8 at p + other, as 16 floats. */
static inline __m512 pair_halves(const uint8_t *p, int64_t other) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + other)), 1));
}

/* The int32 block dots of both panels' block at pq (the second `other` bytes on) against mr rows of x
 * (xb), in `split` chains per row as packed_steps (a vpdpbusd waits for its accumulator). */
static inline __attribute__((always_inline)) void pair_steps(int type, const uint8_t *pq, int64_t other,
                                                             const int8_t *const *xb, int mr, __m512i *s32) {
    const int split = PACKED_SPLIT;
    __m512i part[PACKED_MR][4];
    for (int i = 0; i < mr; i++) {
        part[i][0] = s32[i];
        for (int h = 1; h < split; h++) part[i][h] = _mm512_setzero_si512();
    }
    if (type == 9) { /* w + 128 unsigned, s32 entering as -128 sum(x) (packed_dot's) */
        for (int t = 0; t < 8; t++) {
            const __m512i wu = _mm512_xor_si512(pair_load(pq + 32 * t, other), _mm512_set1_epi8(-128));
            for (int i = 0; i < mr; i++) part[i][t % split] = dpbusd_x4(part[i][t % split], wu, xb[i] + 4 * t, 0);
        }
    } else {
        const __m512i low4 = _mm512_set1_epi8(15);
        for (int t = 0; t < 4; t++) {
            const __m512i v = pair_load(pq + 32 * t, other);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int i = 0; i < mr; i++) {
                const int a = (2 * t) % split, b = (2 * t + 1) % split;
                part[i][a] = dpbusd_x4(part[i][a], lo, xb[i] + 4 * t, 0);
                part[i][b] = dpbusd_x4(part[i][b], hi, xb[i] + 16 + 4 * t, 0);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        for (int h = 1; h < split; h++) part[i][0] = _mm512_add_epi32(part[i][0], part[i][h]);
        s32[i] = part[i][0];
    }
}

/* packed_dot over the panels at panel and panel + other together (in cache: no read-ahead): 16 outputs
 * per x row. */
static inline __attribute__((always_inline)) void packed_pair_dot(int type, const uint8_t *panel, int64_t other,
                                                                  const px_t *px, int64_t r0, int mr, float *out,
                                                                  int64_t ld) {
    const int64_t nb = px->nb, bb = packed_block_bytes(type);
    const int qb = packed_qbytes(type);
    __m512 acc[PACKED_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pq = panel + b * bb;
        const int8_t *xb[PACKED_MR];
        __m512i s32[PACKED_MR];
        for (int i = 0; i < mr; i++) {
            xb[i] = px->xq + (r0 + i) * px->k + b * 32;
            s32[i] = type == 9 ? _mm512_set1_epi32(-128 * px->xi[(r0 + i) * nb + b]) : _mm512_setzero_si512();
        }
        pair_steps(type, pq, other, xb, mr, s32);
        const __m512 s = pair_halves(pq + qb, other);
        const __m512 a = type == 11 ? pair_halves(pq + qb + 16, other) : _mm512_mul_ps(_mm512_set1_ps(-8.0f), s);
        for (int i = 0; i < mr; i++) {
            const int64_t at = (r0 + i) * nb + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i]), _mm512_mul_ps(s, _mm512_set1_ps(px->dx[at])), acc[i]);
            if (type != 9) acc[i] = _mm512_fmadd_ps(a, _mm512_set1_ps(px->xs[at]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out + i * ld, acc[i]);
}

/* Q4_K / Q5_K / Q6_K (quant_kernel_kpacked.h's layout and semantics) the same way: kpanel_step, the
 * scales, the mins and the epilogue of both panels in one register each; the int32 sums are exact, the
 * float steps packed_kdot's, so the lanes are packed_kdot's bits. kpair_bytes32: 8 bytes at p and 8 at
 * p + other, widened to 16 int32 lanes (signed: Q6_K's scales). */
static inline __m512i kpair_bytes32(const uint8_t *p, int64_t other, int is_signed) {
    const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + other)));
    return is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

/* The two sub-blocks of a pair that share their bytes (sub and kpair_partner's) at step t, each byte
 * vector loaded once: Q4_K / Q5_K's sub-blocks 2j and 2j + 1 are the low and high nibbles of the same
 * bytes (and Q5_K's high-bit bytes serve both); Q6_K's 4h + r and 4h + r + 2 (r < 2) the low and high
 * nibbles of piece 2h + r, beside the two-bit bytes of group h that all four share. Each gets the bytes
 * kpanel_step (the 256-bit twin) gives it. */
static inline __attribute__((always_inline)) void kpair_step2(int type, const uint8_t *pq, int64_t other, int sub,
                                                              int t, __m512i *wa, __m512i *wb) {
    const __m512i low4 = _mm512_set1_epi8(15);
    if (type == 14) {
        const int h = sub / 4, r = sub % 4; /* r < 2: the pair is (sub, sub + 2) */
        const __m512i ql = pair_load(pq + 256 * (2 * h + r) + 32 * t, other);
        const __m512i qh = pair_load(pq + K6_QH + 256 * h + 32 * t, other), two = _mm512_set1_epi8(0x30);
        const __m512i ha = _mm512_slli_epi16(qh, 4 - 2 * r), hb = r == 0 ? qh : _mm512_srli_epi16(qh, 2);
        *wa = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(ha, two));
        *wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(hb, two));
        return;
    }
    const __m512i v = pair_load(pq + 256 * (sub / 2) + 32 * t, other);
    *wa = _mm512_and_si512(v, low4), *wb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if (type != 13) return;
    const __m512i hbits = pair_load(pq + K5_QH + 32 * t, other), bit = _mm512_set1_epi8(16);
    const __m512i ha = sub <= 4 ? _mm512_slli_epi16(hbits, 4 - sub) : _mm512_srli_epi16(hbits, sub - 4);
    const __m512i hb = sub + 1 <= 4 ? _mm512_slli_epi16(hbits, 3 - sub) : _mm512_srli_epi16(hbits, sub - 3);
    *wa = _mm512_or_si512(*wa, _mm512_and_si512(ha, bit)), *wb = _mm512_or_si512(*wb, _mm512_and_si512(hb, bit));
}

/* The second sub-block of the pair kpair_step2 takes from `sub`. */
static inline int kpair_partner(int type, int sub) { return type == 14 ? sub + 2 : sub + 1; }

/* Both panels' scales of sub-block sub (Q6_K: of its 16-weight group from step t0) as int32 lanes. */
static inline __m512i kpair_scales(int type, const uint8_t *pq, int64_t other, int sub, int t0) {
    return type == 14 ? kpair_bytes32(pq + K6_SC + 8 * (2 * sub + t0 / 4), other, 1)
                      : kpair_bytes32(pq + kpanel_sc(type) + 8 * sub, other, 0);
}

/* isum[i] += sum over sub-blocks (and Q6_K's 16-weight groups) of scale * (q . xq), for both panels and
 * mr rows of x, the sub-blocks taken in pairs that share their bytes (kpair_step2): per step one load and
 * unpack of the shared bytes serves both, where a sub-block at a time loaded and unpacked them twice
 * (Zen 4, in L2, 32 rows at 2 threads: Q6_K 139 -> 152 G multiply-adds a second, Q5_K 154 -> 166, Q4_K
 * 186 -> 193; 64 rows at 1 thread Q6_K 95 -> 106). The int32 sums are exact, so the order of the adds
 * changes no bit. */
static inline __attribute__((always_inline)) void kpair_sums(int type, const uint8_t *pq, int64_t other, const px_t *px,
                                                             int64_t r0, int mr, int64_t sb, int unpacked,
                                                             const uint8_t *u8, __m512i *isum) {
    const int widen = kpanel_widen(type);
    const int8_t *xs[KPAIR_MR]; /* each row's super-block: one base register per row, every x byte the
                                    * steps read at a constant offset from it (GCC had kept a pointer per
                                    * row and sub-block, spilled: 3.7 scalar instructions per vpdpbusd) */
    const uint8_t *xu[KPAIR_MR]; /* Q6_K's unpacked bytes are signed (q - 32): x unsigned (x + 128) */
    const int signed_w = unpacked && type == 14;
    for (int i = 0; i < mr; i++) { /* xu is laid out only from XU_ROWS rows, where Q6_K is unpacked */
        xs[i] = px->xq + (r0 + i) * px->k + sb * 256;
        xu[i] = signed_w ? px->xu + (r0 + i) * px->k + sb * 256 : NULL;
    }
    for (int q = 0; q < 4; q++) {
        const int sub = type == 14 ? 4 * (q / 2) + q % 2 : 2 * q, subb = kpair_partner(type, sub);
        for (int t0 = 0; t0 < 8; t0 += widen) {
            __m512i pa[KPAIR_MR], pb[KPAIR_MR];
            for (int i = 0; i < mr; i++) pa[i] = pb[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int t = t0; t < t0 + widen; t++) {
                __m512i wa, wb;
                if (unpacked) { /* the chunk's quants unpacked once (kbytes_unpack) */
                    wa = _mm512_loadu_si512(u8 + 512 * sub + 64 * t), wb = _mm512_loadu_si512(u8 + 512 * subb + 64 * t);
                    /* in registers, loaded once for the mr rows: GCC folded the loads into each row's
                     * vpdpbusd at 3-4 rows, loading every weight vector mr times (Llama-3.2-1B-shaped
                     * linears, 2 Zen 4 threads, 9 rows: Q6_K 75.2 -> 63.2 ms, Q5_K 74.1 -> 52.5) */
                    __asm__("" : "+v"(wa), "+v"(wb));
                }
                else
                    kpair_step2(type, pq, other, sub, t, &wa, &wb);
                for (int i = 0; i < mr; i++) {
                    if (signed_w) {
                        int32_t a, b;
                        memcpy(&a, xu[i] + 4 * t + 32 * sub, 4), memcpy(&b, xu[i] + 4 * t + 32 * subb, 4);
                        pa[i] = _mm512_dpbusd_epi32(pa[i], _mm512_set1_epi32(a), wa);
                        pb[i] = _mm512_dpbusd_epi32(pb[i], _mm512_set1_epi32(b), wb);
                        continue;
                    }
                    const int8_t *xr = xs[i] + 4 * t;
                    pa[i] = dpbusd_x4(pa[i], wa, xr + 32 * sub, type == 12);
                    pb[i] = dpbusd_x4(pb[i], wb, xr + 32 * subb, type == 12);
                }
            }
            const __m512i sa = kpair_scales(type, pq, other, sub, t0), sbb = kpair_scales(type, pq, other, subb, t0);
            for (int i = 0; i < mr; i++)
                isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(pa[i], sa),
                                                                     _mm512_mullo_epi32(pb[i], sbb)));
        }
    }
}

/* kpanel_offsets for both panels (lanes 8-15: the second panel's rows). */
static inline __attribute__((always_inline)) void kpair_offsets(int type, const uint8_t *pq, int64_t other,
                                                                const px_t *px, int64_t r0, int mr, int64_t sb,
                                                                __m512i *isum, __m512i *imin) {
    const uint8_t *s = pq + (type == 14 ? K6_SC : kpanel_sc(type) + 64);
    __m512i off[KPAIR_MR];
    for (int i = 0; i < mr; i++) off[i] = _mm512_setzero_si512();
    for (int h = 0; h < (type == 14 ? 8 : 4); h++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + 16 * h));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + 16 * h + other));
        const __m256i mixed = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(b, _mm_srli_si128(b, 8))),
                                                      _mm_unpacklo_epi8(c, _mm_srli_si128(c, 8)), 1);
        const __m512i w = type == 14 ? _mm512_cvtepi8_epi16(mixed) : _mm512_cvtepu8_epi16(mixed);
        for (int i = 0; i < mr; i++) {
            const int16_t *xsum = type == 14 ? px->xi16 + ((r0 + i) * px->nb + sb * 8) * 2 : px->xi + (r0 + i) * px->nb + sb * 8;
            int32_t two;
            memcpy(&two, xsum + 2 * h, 4);
            off[i] = _mm512_dpwssd_epi32(off[i], w, _mm512_set1_epi32(two));
        }
    }
    for (int i = 0; i < mr; i++) {
        if (type == 14) isum[i] = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(off[i], 5));
        else imin[i] = off[i];
    }
}

/* Super-blocks [sb0, sb1) of packed_kdot for both panels (16 outputs per x row into out): from sb0 > 0
 * each row's sums continue from out's (a float32 stored and loaded is the same value, so the slabs
 * give the bits of one sweep). unpacked: the quants come from u8 (kbytes_unpack's layout, super-block
 * sb0 first), not from the panels. */
static inline __attribute__((always_inline)) void packed_pair_kdot(int type, const uint8_t *panel, int64_t other,
                                                                   const px_t *px, int64_t r0, int mr, int unpacked,
                                                                   const uint8_t *u8, int64_t sb0, int64_t sb1,
                                                                   float *out, int64_t ld) {
    const int64_t bb = 8 * (int64_t)TYPE_SIZE[type];
    __m512 acc[KPAIR_MR];
    for (int i = 0; i < mr; i++) acc[i] = sb0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * ld);
    for (int64_t sb = sb0; sb < sb1; sb++) {
        const uint8_t *pq = panel + sb * bb;
        __m512i isum[KPAIR_MR], imin[KPAIR_MR];
        const uint8_t *ub = unpacked ? u8 + (sb - sb0) * KBYTES_SB : u8;
        for (int i = 0; i < mr; i++) isum[i] = imin[i] = _mm512_setzero_si512();
        if (unpacked && type == 14) /* the offset term, the same for every x row */
            for (int i = 0; i < mr; i++) isum[i] = _mm512_loadu_si512(ub + KBYTES_OFF);
        kpair_sums(type, pq, other, px, r0, mr, sb, unpacked, ub, isum);
        if (!unpacked || type != 14) kpair_offsets(type, pq, other, px, r0, mr, sb, isum, imin);
        const int d_at = type == 14 ? K6_D : kpanel_sc(type) + 128;
        const __m512 d = pair_halves(pq + d_at, other);
        const __m512 dmin = type == 14 ? d : pair_halves(pq + d_at + 16, other);
        for (int i = 0; i < mr; i++) {
            const __m512 dx = _mm512_set1_ps(px->dx[(r0 + i) * px->nb + sb * 8]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, dx), acc[i]);
            if (type != 14) acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[i]), _mm512_mul_ps(dmin, dx), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out + i * ld, acc[i]);
}

/* One pass of mr (<= PACKED_MR) x rows over the panels at panels and panels + other, into out (row stride
 * N_CHUNK). */
static inline void pair_pass(int type, const uint8_t *panels, int64_t other, const px_t *px, int64_t r0, int mr,
                             float *out) {
    switch (type * 8 + mr) { /* 8 rows a pass ran no faster: Q8_0 spilled, at half the rate; Q4_K 4% slower */
#define PAIR_CASE(T, M) \
    case T * 8 + M: packed_pair_dot(T, panels, other, px, r0, M, out, N_CHUNK); break;
#define KPAIR_CASE(T, M) \
    case T * 8 + M: packed_pair_kdot(T, panels, other, px, r0, M, 0, NULL, 0, px->k / 256, out, N_CHUNK); break;
#define PAIR_ROWS(C, T) C(T, 1) C(T, 2) C(T, 3) C(T, 4)
        PAIR_ROWS(PAIR_CASE, 9) PAIR_ROWS(PAIR_CASE, 10) PAIR_ROWS(PAIR_CASE, 11)
        PAIR_ROWS(KPAIR_CASE, 12) PAIR_ROWS(KPAIR_CASE, 13) PAIR_ROWS(KPAIR_CASE, 14)
        KPAIR_CASE(13, 5) KPAIR_CASE(13, 6) KPAIR_CASE(14, 5) KPAIR_CASE(14, 6)
#undef PAIR_ROWS
#undef KPAIR_CASE
#undef PAIR_CASE
    default: break;
    }
}
#endif

#endif
