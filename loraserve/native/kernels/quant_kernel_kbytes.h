/* A K-quant chunk (two panels, quant_kernel_kpacked.h's layout) unpacked to one byte a weight once, a
 * slab of super-blocks at a time, for every pass of x rows over it (AVX-512 VNNI builds, many rows).
 *
 * Shape: kbytes_unpack writes super-block sb of the slab at u8 + KBYTES_SB sb: sub-block s, step t at
 * + 512 s + 64 t, the 64 bytes kpair_step2 gives (lanes 0-31 the first panel's 4 weights of rows 0-7);
 * Q6_K's as signed q = u - 32, then at + KBYTES_OFF the lanes' -128 sum_g sc_g sum(q_g) (int32).
 * Semantics: packed_pair_kdot's, bit for bit (the same exact int32 sums, the same float steps in the
 * same order: a slab's passes continue each row's sums from the last slab's stored float32). Q6_K's
 * q . x is taken as q . (x + 128) - 128 sum(q) (vpdpbusd's unsigned side is then x, px->xu), so its
 * offset term no longer depends on x: computed once per chunk, where each pass had multiplied x's
 * 16-value sums by the scales (8 vpdpwssd a super-block and row; Zen 4 runs every multiply, vpdpbusd,
 * vpmulld, vpdpwssd and FMA alike, on the same two pipes). One thread over 64 chunks of 2048 inputs,
 * 32 / 16 / 256 rows: 123 / 108 / 138 -> 130 / 112 / 152 G a second (medians of 4, noisy VM).
 * Why: a pair pass over the panels unpacks every step's weights again for each pass of x rows; Q6_K's
 * 6-bit unpack (two loads, shifts, masks, an or per weight vector) took a sixth of its time or more
 * (one panel pair in L1, one Zen 4 thread, 4 rows: 128 G multiply-adds a second from the
 * panels, 156 from bytes). Llama-3.2-1B-shaped linears, 2 Zen 4 threads, builds alternated in one
 * process: Q6_K 32 / 16 rows 159.4 / 94.1 -> 137.9 / 83.9 ms, Q5_K 135.2 / 79.3 -> 125.9 / 66.6. Q4_K's
 * nibbles are cheap to unpack and ran slower so (171 -> 154 G a second, 32 rows, one thread over
 * 64 chunks); Q5_K's passes of 6 rows over bytes spilled (143 -> 113 G at 4 -> 6). A slab of 4
 * super-blocks (16 KB) ran as fast as a whole 2048-wide chunk and keeps the room small for any width
 * (1 or 2: 123 / 130 against 134 G). */
#ifndef LORASERVE_QUANT_KERNEL_KBYTES_H
#define LORASERVE_QUANT_KERNEL_KBYTES_H

#ifdef PACKED_PAIRS
#ifndef KBYTES_SLAB
#define KBYTES_SLAB 4 /* super-blocks unpacked at a time */
#endif
#define KBYTES_ROWS XU_ROWS /* x rows from which a chunk is unpacked (px then holds xu) */
#ifndef KBYTES_TYPE
#define KBYTES_TYPE(type) ((type) == 13 || (type) == 14)
#endif
#ifndef KBYTES_MR
#define KBYTES_MR(type) ((type) == 14 ? 6 : 4) /* x rows a pass over unpacked bytes takes at most */
#endif

/* Whether a chunk of `count` panels of `type` is unpacked for `rows` x rows. */
static inline int unpack_chunk(int type, int count, int64_t rows) {
    return count == 2 && KBYTES_TYPE(type) && rows >= KBYTES_ROWS;
}

/* Super-blocks [0, nsb) of the panel pair at panels and panels + other (bb bytes a super-block) into u8. */
static void kbytes_unpack(int type, const uint8_t *panels, int64_t other, int64_t nsb, int64_t bb, uint8_t *u8) {
    const __m512i ones = _mm512_set1_epi8(1), off = _mm512_set1_epi8(32);
    for (int64_t sb = 0; sb < nsb; sb++, u8 += KBYTES_SB) {
        const uint8_t *pq = panels + sb * bb;
        prefetch_ahead(pq, bb, KPACKED_AHEAD), prefetch_ahead(pq + other, bb, KPACKED_AHEAD);
        __m512i qsum = _mm512_setzero_si512(), ga = qsum, gb = qsum; /* Q6_K: sum_g sc_g sum(q_g) */
        for (int q = 0; q < 4; q++) {
            const int sub = type == 14 ? 4 * (q / 2) + q % 2 : 2 * q, subb = kpair_partner(type, sub);
            for (int t = 0; t < 8; t++) {
                __m512i wa, wb;
                kpair_step2(type, pq, other, sub, t, &wa, &wb);
                if (type == 14) { /* q = u - 32, signed; a group's sum of q per lane, then its scale */
                    wa = _mm512_sub_epi8(wa, off), wb = _mm512_sub_epi8(wb, off);
                    ga = _mm512_dpbusd_epi32(ga, ones, wa), gb = _mm512_dpbusd_epi32(gb, ones, wb);
                    if (t % 4 == 3) {
                        const __m512i sa = kpair_scales(type, pq, other, sub, t - 3);
                        const __m512i sbb = kpair_scales(type, pq, other, subb, t - 3);
                        qsum = _mm512_add_epi32(qsum, _mm512_add_epi32(_mm512_mullo_epi32(ga, sa), _mm512_mullo_epi32(gb, sbb)));
                        ga = gb = _mm512_setzero_si512();
                    }
                }
                _mm512_storeu_si512(u8 + 512 * sub + 64 * t, wa), _mm512_storeu_si512(u8 + 512 * subb + 64 * t, wb);
            }
        }
        if (type == 14)
            _mm512_storeu_si512(u8 + KBYTES_OFF, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(qsum, 7)));
    }
}

/* One pass of mr (<= KBYTES_MR(type), at most 6) x rows over super-blocks [sb0, sb1), their quants at
 * u8, into out. */
static inline void kbytes_pass(int type, const uint8_t *panels, int64_t other, const px_t *px, int64_t r0, int mr,
                               const uint8_t *u8, int64_t sb0, int64_t sb1, float *out) {
    switch (type * 8 + mr) {
#define KBYTES_CASE(T, M) \
    case T * 8 + M: packed_pair_kdot(T, panels, other, px, r0, M, 1, u8, sb0, sb1, out, N_CHUNK); break;
#define KBYTES_PASSES(T) \
    KBYTES_CASE(T, 1) KBYTES_CASE(T, 2) KBYTES_CASE(T, 3) KBYTES_CASE(T, 4) KBYTES_CASE(T, 5) KBYTES_CASE(T, 6)
        KBYTES_PASSES(12) KBYTES_PASSES(13) KBYTES_PASSES(14)
#undef KBYTES_PASSES
#undef KBYTES_CASE
    default: break;
    }
}

/* x rows [r_lo, r_hi) over the chunk's panel pair at panels (`bytes` a panel) into acc, a slab at a
 * time (u8: room for KBYTES_SLAB super-blocks); the rows split evenly into passes, each of which (with
 * `fetch`) asks for its share of the next chunk, as run_packed_chunk's passes in cache do. */
static void run_unpacked_chunk(int type, const uint8_t *panels, int64_t bytes, const px_t *px, int64_t r_lo,
                               int64_t r_hi, int fetch, uint8_t *u8, float *acc) {
    const int64_t nsb = px->k / 256, bb = 8 * (int64_t)TYPE_SIZE[type];
    const int64_t passes = (r_hi - r_lo + KBYTES_MR(type) - 1) / KBYTES_MR(type);
    const int64_t slabs = (nsb + KBYTES_SLAB - 1) / KBYTES_SLAB;
    for (int64_t s = 0; s < slabs; s++) {
        const int64_t sb0 = s * KBYTES_SLAB, sb1 = sb0 + KBYTES_SLAB < nsb ? sb0 + KBYTES_SLAB : nsb;
        kbytes_unpack(type, panels + sb0 * bb, bytes, sb1 - sb0, bb, u8);
        int64_t index = 0;
        for (int64_t r0 = r_lo, step; r0 < r_hi; r0 += step, index++) {
            step = (r_hi - r0 + passes - index - 1) / (passes - index);
            if (fetch) fetch_next_share(panels + 2 * bytes, 2 * bytes, s * passes + index, slabs * passes);
            kbytes_pass(type, panels, bytes, px, r0, (int)step, u8, sb0, sb1, acc + (r0 - r_lo) * N_CHUNK);
        }
    }
}
#endif

#endif
