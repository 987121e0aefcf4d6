/* Linear layers over GGUF block-quantized weights, y = x W^T + b, loaded through ctypes by
 * layers/quant/kernel.py (the formats' layouts and their torch twin: layers/quant/formats.py).
 *
 * W is [n, k] in one of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K (type codes 0-5), row after row, each row
 * k / block_size blocks. Every format is read 32 weights at a time as value = s * q + add, with q 32
 * bytes (signed: Q8_0, Q4_0 as q - 8, Q6_K as q - 32; unsigned: Q4_1, Q4_K, Q5_K), s one float per
 * 16 weights (equal halves except Q6_K) and `add` one float (0 for the signed formats).
 *
 * quant_linear (decode: few rows): bf16 x is quantized per 32 values to int8 (scale amax/127,
 * round to nearest: llama.cpp's q8_0 for activations), and every block's integer dot product with its
 * 32 quantized activations is scaled once: sum_blocks dx * (s * idot + add * sum(xq)). A step reads
 * each weight byte once. Integer dot products: AVX512-VNNI's vpdpbusd (u8 x s8; signed weights go in
 * as |q| with x's signs flipped where q < 0), AVX2's vpmaddubsw + vpmaddwd (the same operands: |q| <=
 * 128 and |xq| <= 127 keep its int16 pair sums from saturating), or portable C. float32 x stays
 * float32 (that dtype is the precise one): each block is widened to float32 in registers and FMA'd.
 * quant_dequantize (prefill: many rows): rows [n0, n1) of W as float32 or bf16, for a tile product.
 * Parallel over output rows with OpenMP (torch's libgomp: the library is loaded after torch).
 * Semantics of quant_linear: float32 sums, one rounding to x's dtype at the end, bias added before it.
 */
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>

#include "simd.h"

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

static const int BLOCK_SIZE[6] = {32, 32, 32, 256, 256, 256};
static const int TYPE_SIZE[6] = {34, 18, 20, 144, 176, 210};

/* Which integer dot product this build runs: 2 AVX512-VNNI, 1 AVX2, 0 portable C. */
int quant_kernel_path(void) { return QK_PATH; }

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t u;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) u = sign | 0x7f800000u | (mant << 13);
    else u = sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Q4_K/Q5_K: the six-bit scale and min of sub-block j (0-7) from the 12 scale bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

typedef struct {
    float s0, s1, add; /* scale of weights 0-15, of 16-31, and the additive term */
} blockinfo;

/* The scales of 32-weight block `b` of a row (the part of the unpacking every path shares). */
static inline __attribute__((always_inline)) const uint8_t *block_info(int type, const uint8_t *row, int64_t b,
                                                                       blockinfo *bi) {
    if (type <= 2) {
        const uint8_t *p = row + b * TYPE_SIZE[type];
        bi->s0 = bi->s1 = f16_to_f32(p);
        bi->add = type == 2 ? f16_to_f32(p + 2) : 0.0f;
        return p;
    }
    const uint8_t *p = row + (b / 8) * TYPE_SIZE[type];
    const int j = (int)(b % 8);
    if (type == 5) {
        const float d = f16_to_f32(p + 208);
        bi->s0 = d * (float)(int8_t)p[192 + 2 * j], bi->s1 = d * (float)(int8_t)p[193 + 2 * j];
        bi->add = 0.0f;
        return p;
    }
    int sc, mn;
    k_scale_min(p + 4, j, &sc, &mn);
    bi->s0 = bi->s1 = f16_to_f32(p) * (float)sc;
    bi->add = -f16_to_f32(p + 2) * (float)mn;
    return p;
}

/* Block b's 32 quants as bytes (signed for types 0, 1, 5), portable. */
static inline void unpack_scalar(int type, const uint8_t *p, int64_t b, int8_t *q) {
    const int j = (int)(b % 8);
    switch (type) {
    case 0: memcpy(q, p + 2, 32); break;
    case 1:
    case 2: {
        const uint8_t *qs = p + (type == 1 ? 2 : 4);
        const int off = type == 1 ? 8 : 0;
        for (int i = 0; i < 16; i++) q[i] = (int8_t)((qs[i] & 15) - off), q[i + 16] = (int8_t)((qs[i] >> 4) - off);
        break;
    }
    case 3:
    case 4: {
        const uint8_t *qs = p + (type == 3 ? 16 : 48) + (j / 2) * 32, *qh = p + 16;
        const int shift = (j & 1) * 4;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)(((qs[i] >> shift) & 15) | (type == 4 ? ((qh[i] >> j) & 1) << 4 : 0));
        break;
    }
    default: { /* Q6_K: half h, 32-block r of it */
        const int h = j / 4, r = j % 4;
        const uint8_t *ql = p + h * 64 + (r % 2) * 32, *qh = p + 128 + h * 32;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)((((ql[i] >> (4 * (r / 2))) & 15) | (((qh[i] >> (2 * r)) & 3) << 4)) - 32);
    }
    }
}

#if QK_PATH > 0
/* Block b's 32 quants in one register (what unpack_scalar computes). */
static inline __attribute__((always_inline)) __m256i unpack_vec(int type, const uint8_t *p, int64_t b) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const int j = (int)(b % 8);
    if (type == 0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    if (type <= 2) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(p + (type == 1 ? 2 : 4)));
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        return type == 1 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
    if (type <= 4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (type == 3 ? 16 : 48) + (j / 2) * 32));
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128((j & 1) * 4)), low4);
        if (type == 4) {
            const __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)), _mm_cvtsi32_si128(j));
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
        return q;
    }
    const int h = j / 4, r = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (r % 2) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r / 2))), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

/* The 8 int32 partial sums of q . x over 32 bytes (lanes 0-3: weights 0-15, lanes 4-7: 16-31). */
static inline __attribute__((always_inline)) __m256i dot32(__m256i q, __m256i x, int is_signed) {
    const __m256i u = is_signed ? _mm256_sign_epi8(q, q) : q;
    const __m256i s = is_signed ? _mm256_sign_epi8(x, q) : x;
#if QK_PATH == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

typedef struct {
    int64_t nb;       /* 32-blocks per row */
    const int8_t *xq; /* [m][k] */
    const float *dx;  /* [m][k / 32] activation scales */
    const float *dxs; /* [m][k / 32] scale * sum of the block's quants */
} qx_t;

#if QK_PATH > 0
/* One block of the int8 path for rows r0 .. r0 + mr - 1: acc += dx * s * (q . xq), add += dx * add * sum(xq). */
static inline __attribute__((always_inline)) void int8_block(int type, const uint8_t *row, int64_t b, const qx_t *qx,
                                                             int64_t r0, int mr, __m256 *acc, float *add) {
    const int is_signed = type == 0 || type == 1 || type == 5;
    const int64_t nb_row = qx->nb;
    blockinfo bi;
    const uint8_t *p = block_info(type, row, b, &bi);
    const __m256i q = unpack_vec(type, p, b);
    /* one scale for the whole block but in Q6_K: then a broadcast of s * dx is all a row needs */
    const __m256 s = type == 5 ? _mm256_setr_m128(_mm_set1_ps(bi.s0), _mm_set1_ps(bi.s1)) : _mm256_setzero_ps();
    for (int m = 0; m < MR; m++) {
        if (m >= mr) break;
        const int64_t at = (r0 + m) * nb_row + b;
        const __m256i x = _mm256_loadu_si256((const __m256i *)(qx->xq + at * 32));
        const __m256 d = _mm256_cvtepi32_ps(dot32(q, x, is_signed));
        const __m256 sd = type == 5 ? _mm256_mul_ps(s, _mm256_set1_ps(qx->dx[at])) : _mm256_set1_ps(bi.s0 * qx->dx[at]);
        acc[m] = _mm256_fmadd_ps(d, sd, acc[m]);
        if (!is_signed) add[m] += bi.add * qx->dxs[at];
    }
}
#endif

/* out[i] = sum over the row's blocks for rows r0 .. r0 + mr - 1 of x (mr <= MR). `type` is a
 * constant after inlining, so each format gets its own loop. */
static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *row, int64_t k, const qx_t *qx,
                                                          int64_t r0, int mr, float *out) {
    const int64_t nb = k / 32;
#if QK_PATH > 0
    /* Two accumulators per row, blocks alternating between them: one chain of dependent FMAs per row
     * would hold the loop to its latency (4 cycles a block). */
    __m256 acc0[MR], acc1[MR];
    float add0[MR], add1[MR];
    for (int m = 0; m < MR; m++) acc0[m] = acc1[m] = _mm256_setzero_ps(), add0[m] = add1[m] = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        int8_block(type, row, b, qx, r0, mr, acc0, add0);
        int8_block(type, row, b + 1, qx, r0, mr, acc1, add1);
    }
    if (b < nb) int8_block(type, row, b, qx, r0, mr, acc0, add0);
    for (int m = 0; m < mr; m++) out[m] = hsum8(_mm256_add_ps(acc0[m], acc1[m])) + (add0[m] + add1[m]);
#else
    const int is_signed = type == 0 || type == 1 || type == 5, has_add = !is_signed;
    float acc[MR] = {0}, add[MR] = {0};
    for (int64_t b = 0; b < nb; b++) {
        blockinfo bi;
        int8_t q[32];
        const uint8_t *p = block_info(type, row, b, &bi);
        unpack_scalar(type, p, b, q);
        for (int m = 0; m < mr; m++) {
            const int64_t at = (r0 + m) * nb + b;
            const int8_t *x = qx->xq + at * 32;
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 16; i++) {
                /* unsigned formats hold 0..31 / 0..15 in the byte: read them unsigned */
                const int32_t a = is_signed ? q[i] : (uint8_t)q[i], c = is_signed ? q[i + 16] : (uint8_t)q[i + 16];
                lo += a * x[i], hi += c * x[i + 16];
            }
            acc[m] += qx->dx[at] * (bi.s0 * (float)lo + bi.s1 * (float)hi);
            if (has_add) add[m] += bi.add * qx->dxs[at];
        }
    }
    for (int m = 0; m < mr; m++) out[m] = acc[m] + add[m];
#endif
}

/* The float32 path (x float32): out[i] = row . x[r0 + i] with each block dequantized in registers,
 * the activations unrounded (the float32 serving dtype is the precise one). */
static inline __attribute__((always_inline)) void row_dot_f32(int type, const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, int64_t r0, int mr, float *out) {
    const int is_signed = type == 0 || type == 1 || type == 5;
#if QK_PATH > 0
    __m256 acc[MR][4]; /* one per 8 weights of a block: independent FMA chains */
    for (int m = 0; m < MR; m++)
        for (int g = 0; g < 4; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        blockinfo bi;
        const uint8_t *p = block_info(type, row, b, &bi);
        const __m256i q = unpack_vec(type, p, b);
        const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        __m256 w[4];
        for (int g = 0; g < 4; g++) {
            const __m128i eight = g & 1 ? _mm_srli_si128(halves[g / 2], 8) : halves[g / 2];
            const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
            w[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(g < 2 ? bi.s0 : bi.s1), _mm256_set1_ps(bi.add));
        }
        for (int m = 0; m < MR; m++) {
            if (m >= mr) break;
            const float *xb = x + (r0 + m) * ldx + b * 32;
            for (int g = 0; g < 4; g++) acc[m][g] = _mm256_fmadd_ps(w[g], _mm256_loadu_ps(xb + 8 * g), acc[m][g]);
        }
    }
    for (int m = 0; m < mr; m++)
        out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
#else
    float acc[MR] = {0};
    for (int64_t b = 0; b < k / 32; b++) {
        blockinfo bi;
        int8_t q[32];
        float w[32];
        const uint8_t *p = block_info(type, row, b, &bi);
        unpack_scalar(type, p, b, q);
        for (int i = 0; i < 32; i++)
            w[i] = (i < 16 ? bi.s0 : bi.s1) * (is_signed ? (float)q[i] : (float)(uint8_t)q[i]) + bi.add;
        for (int m = 0; m < mr; m++) {
            const float *xb = x + (r0 + m) * ldx + b * 32;
            for (int i = 0; i < 32; i++) acc[m] += w[i] * xb[i];
        }
    }
    for (int m = 0; m < mr; m++) out[m] = acc[m];
#endif
}

/* Row r of x, k values (float32 or bf16), as int8 per 32 with their scales. */
static void quantize_row(const void *x, int64_t ldx, int x_bf16, int64_t r, int64_t k, int8_t *xq, float *dx,
                         float *dxs) {
    float v[32];
    for (int64_t b = 0; b < k / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const int64_t at = r * ldx + b * 32 + i;
            v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inv = d > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            const int32_t q = (int32_t)nearbyintf(v[i] * inv);
            xq[b * 32 + i] = (int8_t)q, sum += q;
        }
        dx[b] = d, dxs[b] = d * (float)sum;
    }
}

/* Weight rows [n0, n1) against x's rows r0 .. r0 + mr - 1; `mr` is a constant after inlining (the
 * switch below), so the per-row accumulators are registers rather than a stack array. */
static inline __attribute__((always_inline)) void rows_pass(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                            int64_t n1, int64_t k, const qx_t *qx, const float *x_f32,
                                                            int64_t ldx, int64_t r0, int mr, float *acc) {
    for (int64_t n = n0; n < n1; n++) {
        float out[MR];
        /* a step streams each weight once from memory: ask for rows PREFETCH_ROWS ahead (the hardware
         * prefetcher alone left a single thread at about half the read bandwidth on the LM head) */
        if (r0 == 0)
            for (int64_t at = 0; at < row_bytes; at += 64)
                __builtin_prefetch(w + (n + PREFETCH_ROWS) * row_bytes + at, 0, 0);
        if (x_f32 != NULL) row_dot_f32(type, w + n * row_bytes, k, x_f32, ldx, r0, mr, out);
        else row_dot(type, w + n * row_bytes, k, qx, r0, mr, out);
        for (int i = 0; i < mr; i++) acc[(r0 + i) * N_CHUNK + (n - n0)] = out[i];
    }
}

/* x_f32 (or NULL: the int8 path over qx) is float32 x with row stride ldx. */
static inline __attribute__((always_inline)) void chunk_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                             int64_t n1, int64_t k, const qx_t *qx, const float *x_f32,
                                                             int64_t ldx, int64_t m, float *acc /*[m][N_CHUNK]*/) {
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        switch (m - r0 < MR ? m - r0 : MR) {
        case 1: rows_pass(type, w, row_bytes, n0, n1, k, qx, x_f32, ldx, r0, 1, acc); break;
        case 2: rows_pass(type, w, row_bytes, n0, n1, k, qx, x_f32, ldx, r0, 2, acc); break;
        case 3: rows_pass(type, w, row_bytes, n0, n1, k, qx, x_f32, ldx, r0, 3, acc); break;
        default: rows_pass(type, w, row_bytes, n0, n1, k, qx, x_f32, ldx, r0, MR, acc); break;
        }
    }
}

/* y[:, :n] = x W^T + bias for x [m, k] (row stride ldx, float32 or bf16 as x_bf16 says), y likewise
 * with row stride ldy, bias [n] in x's dtype or NULL. w = {address, n, k, type}.
 * Returns 0, or 1 for an unknown type or a k the type does not divide (nothing written), 2 without
 * memory. */
int quant_linear(const int64_t *w, const void *x, int64_t ldx, int x_bf16, const void *bias, void *y, int64_t ldy,
                 int64_t m, int num_threads) {
    const uint8_t *wp = (const uint8_t *)(intptr_t)w[0];
    const int64_t n = w[1], k = w[2];
    const int type = (int)w[3];
    if (type < 0 || type > 5 || k % BLOCK_SIZE[type] != 0 || m < 0) return 1;
    const int64_t row_bytes = k / BLOCK_SIZE[type] * TYPE_SIZE[type], nb = k / 32;
    int8_t *xq = malloc((size_t)(m * k + 1));
    float *scales = malloc(sizeof(float) * (size_t)(2 * m * nb + 1));
    if (xq == NULL || scales == NULL) {
        free(xq), free(scales);
        return 2;
    }
    const qx_t qx = {nb, xq, scales, scales + m * nb};
    const float *x_f32 = x_bf16 ? NULL : (const float *)x;
    if (x_bf16)
        for (int64_t r = 0; r < m; r++) quantize_row(x, ldx, x_bf16, r, k, xq + r * k, scales + r * nb, scales + m * nb + r * nb);
    const int64_t num_chunks = (n + N_CHUNK - 1) / N_CHUNK;
#pragma omp parallel num_threads(num_threads)
    {
        float *acc = malloc(sizeof(float) * (size_t)(m * N_CHUNK + 1));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; c++) {
            if (acc == NULL) continue;
            const int64_t n0 = c * N_CHUNK, n1 = n0 + N_CHUNK < n ? n0 + N_CHUNK : n;
            switch (type) {
            case 0: chunk_rows(0, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            case 1: chunk_rows(1, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            case 2: chunk_rows(2, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            case 3: chunk_rows(3, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            case 4: chunk_rows(4, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            default: chunk_rows(5, wp, row_bytes, n0, n1, k, &qx, x_f32, ldx, m, acc); break;
            }
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = n0; j < n1; j++) {
                    float v = acc[r * N_CHUNK + (j - n0)];
                    if (bias != NULL) v += x_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
                    if (x_bf16) ((uint16_t *)y)[r * ldy + j] = f32_to_bf16(v);
                    else ((float *)y)[r * ldy + j] = v;
                }
        }
        free(acc);
    }
    free(xq), free(scales);
    return 0;
}

/* The decoder stack's linear (models/decoder_stack.c's gemm_fn signature): a layer of one or more
 * quantized output slices, a = {parts, x_bf16, n_total, then per part {address, n, k, type}}; y is
 * [m, n_total] contiguous, bias [n_total] or NULL. Each slice is the quant_linear call the Python path
 * (Linear._quant_forward) makes, so the two agree bit for bit. `side` (the dense kernel's LoRA
 * prefetch) is not used. Returns quant_linear's status, or 1 for a bad part count. */
int quant_gemm(const int64_t *a, const void *x, int64_t ldx, const void *bias, void *y, int64_t m, int num_threads,
               const int64_t *side) {
    (void)side;
    const int64_t parts = a[0], n_total = a[2];
    const int x_bf16 = (int)a[1];
    const int64_t elem = x_bf16 ? 2 : 4;
    int64_t off = 0;
    for (int64_t p = 0; p < parts; p++) off += a[3 + 4 * p + 1];
    if (parts < 1 || off != n_total) return 1;
    off = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *w = a + 3 + 4 * p;
        const void *b = bias == NULL ? NULL : (const char *)bias + off * elem;
        const int status = quant_linear(w, x, ldx, x_bf16, b, (char *)y + off * elem, n_total, m, num_threads);
        if (status != 0) return status;
        off += w[1];
    }
    return 0;
}

#if QK_PATH > 0
/* 8 floats at p as float32 or bf16 (to nearest even: weights are finite). */
static inline __attribute__((always_inline)) void store8(void *out, int64_t at, __m256 v, int out_bf16) {
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* One block of row r dequantized with the vector unpacking; s * q + add unfused (see below). */
static inline __attribute__((always_inline)) void dequantize_block(int type, const uint8_t *row, int64_t b, void *out,
                                                                   int64_t at, int out_bf16) {
    const int is_signed = type == 0 || type == 1 || type == 5;
    blockinfo bi;
    const uint8_t *p = block_info(type, row, b, &bi);
    const __m256i q = unpack_vec(type, p, b);
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    /* 16 weights a vector and one vcvtne2ps2bf16 (round to nearest even, as store8; no weight is a
     * float32 denormal, which it would flush) for the block: a quarter of the 256-bit form's work */
    __m512 v[2];
    for (int g = 0; g < 2; g++) {
        const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(halves[g]) : _mm512_cvtepu8_epi32(halves[g]);
        v[g] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(g == 0 ? bi.s0 : bi.s1)),
                             _mm512_set1_ps(bi.add));
    }
    if (out_bf16) {
        _mm512_storeu_si512((uint16_t *)out + at, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    } else {
        _mm512_storeu_ps((float *)out + at, v[0]);
        _mm512_storeu_ps((float *)out + at + 16, v[1]);
    }
#else
    for (int g = 0; g < 4; g++) {
        const __m128i eight = g & 1 ? _mm_srli_si128(halves[g / 2], 8) : halves[g / 2];
        const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(g < 2 ? bi.s0 : bi.s1)),
                                       _mm256_set1_ps(bi.add));
        store8(out, at + 8 * g, v, out_bf16);
    }
#endif
}
#endif

/* Rows [n0, n1) of w = {address, n, k, type} as float32 (out_bf16 = 0) or bf16, [n1 - n0, k] dense at
 * out. Returns 0, or 1 as quant_linear does. */
int quant_dequantize(const int64_t *w, int64_t n0, int64_t n1, void *out, int out_bf16, int num_threads) {
    const uint8_t *wp = (const uint8_t *)(intptr_t)w[0];
    const int64_t k = w[2];
    const int type = (int)w[3];
    if (type < 0 || type > 5 || k % BLOCK_SIZE[type] != 0 || n0 < 0 || n1 > w[1]) return 1;
    const int64_t row_bytes = k / BLOCK_SIZE[type] * TYPE_SIZE[type], nb = k / 32;
    const int is_signed = type == 0 || type == 1 || type == 5;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = n0; r < n1; r++) {
#if QK_PATH > 0
        switch (type) {
        case 0: for (int64_t b = 0; b < nb; b++) dequantize_block(0, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        case 1: for (int64_t b = 0; b < nb; b++) dequantize_block(1, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        case 2: for (int64_t b = 0; b < nb; b++) dequantize_block(2, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        case 3: for (int64_t b = 0; b < nb; b++) dequantize_block(3, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        case 4: for (int64_t b = 0; b < nb; b++) dequantize_block(4, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        default: for (int64_t b = 0; b < nb; b++) dequantize_block(5, wp + r * row_bytes, b, out, (r - n0) * k + b * 32, out_bf16); break;
        }
        (void)is_signed;
#else
        for (int64_t b = 0; b < nb; b++) {
            blockinfo bi;
            int8_t q[32];
            const uint8_t *p = block_info(type, wp + r * row_bytes, b, &bi);
            unpack_scalar(type, p, b, q);
            const int64_t at = (r - n0) * k + b * 32;
            for (int i = 0; i < 32; i++) {
                const float qi = is_signed ? (float)q[i] : (float)(uint8_t)q[i];
                const float v = (i < 16 ? bi.s0 : bi.s1) * qi + bi.add;
                if (out_bf16) ((uint16_t *)out)[at + i] = f32_to_bf16(v);
                else ((float *)out)[at + i] = v;
            }
        }
#endif
    }
    return 0;
}
