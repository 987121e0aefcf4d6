/* Paged attention on CPU that reads K/V in place through the block tables, loaded through ctypes by
 * paged_attention_cpu.py.
 *
 * Semantics (the pure-torch twin is paged_attention_torch.paged_attention): the step is a flat batch
 * of T new tokens from B sequences; sequence b owns tokens query_starts[b] .. query_starts[b+1]-1, has
 * context_lens[b] tokens in the cache (its new ones included), and its query i sits at absolute
 * position p = context_lens[b] - q_len + i. Query head h attends with KV head h / (H / KVH) to the keys
 * at positions k <= p (and k > p - window when window > 0); key k lives in cache slot
 * block_tables[b][k / block_size] * block_size + k % block_size. Scores are q.k * scale, then
 * softcap * tanh(s / softcap) when softcap > 0; softmax and accumulation are in float32 (online softmax
 * over blocks of at most KEY_BLOCK keys), and the output is rounded to the input dtype. For bf16 on
 * CPUs with bf16 dot products the (unnormalized, block-rescaled) probabilities are rounded to bf16
 * before the value products, much as the twin's probs.to(v.dtype) rounds its normalized ones; the
 * values differ by bf16 rounding only, and the normalizer stays the float32 sum.
 *
 * Why a kernel: the torch path copies every sequence's whole context out of the cache in every layer
 * and builds a [B, max_q, max_ctx] mask; here each K/V row is read once from where it lies and shared
 * by the query heads of its group (GQA), and requested one block ahead (blocks lie anywhere in the
 * cache, so no hardware prefetcher follows them). A block's keys are all scored first, so each row pays
 * one max, one rescale and one exp pass per block rather than per tile, and the values are summed with
 * each 2W-column slice of a row's accumulator held in registers across the block's keys. Work items are
 * (sequence, query chunk, KV heads, key partition) over OpenMP threads (torch's libgomp: the library is
 * loaded after torch), claimed one ahead so the next item's keys are requested while the current one
 * finishes; a long context with too few items for the threads is split into key partitions that a
 * second pass merges. A short query's item (decode) takes all the KV heads that fit MAX_ROWS rows,
 * their turns interleaved every few keys: the cache interleaves a token's heads, so one head's keys
 * are short pieces a whole row apart, which a core reads at well under its sequential bandwidth, while
 * all heads of a token are one contiguous run. In bf16 a small GQA group (up to 4 rows per KV head and
 * query) scores keys transposed four at a time within 128-bit lanes, which leaves each row one level
 * of horizontal sums where vsum_keys takes four: decode is bound by vector instructions. A bf16 prefill
 * chunk instead puts its rows in vector lanes (attend_lanes): scores, softmax and value sums then run
 * across rows, where row by row each paid a horizontal max and sum and a masked store per tile.
 * The vector width W is simd.h's, the build's: 16 (AVX-512; bf16 pair dot products with AVX512-BF16),
 * 8 (AVX2 + FMA) or 1 (portable C); -march=native makes that the runtime dispatch.
 */
#include <stdlib.h>

#include "simd.h"

/* The attention-only vector helpers on top of simd.h: transposing sum trees and the bf16 pair order. */
#if W == 16
/* 128-bit lane g = the sum of c[g]'s four 128-bit lanes. */
static inline vf vsum_quarters(const vf *c) {
    vf d[2];
    for (int i = 0; i < 2; ++i)
        d[i] = vadd(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                    _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return vadd(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
/* Lane j = the sum of a[j]'s lanes: a transposing tree, ~3 instructions per key instead of ~8. */
static inline vf vsum_keys(const vf *a) {
    vf b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        c[i] = vadd(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return vsum_quarters(c);
}
#if defined(__AVX512BF16__)
#define NATIVE_BF16_DOT 1
#endif
/* (even elements, odd elements) of vload_pair_bf16 back to (first W, next W). */
static inline void vinterleave(vf *a, vf *b) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const vf x = _mm512_permutex2var_ps(*a, lo, *b), y = _mm512_permutex2var_ps(*a, hi, *b);
    *a = x, *b = y;
}
#elif W == 8
static inline vf vsum_keys(const vf *a) {
    vf b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = vadd(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        c[i] = vadd(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return vadd(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
static inline void vinterleave(vf *a, vf *b) {
    const vf lo = _mm256_unpacklo_ps(*a, *b), hi = _mm256_unpackhi_ps(*a, *b);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20), *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}
#else /* portable C: one key per tile */
static inline vf vsum_keys(const vf *a) { return a[0]; }
static inline void vinterleave(vf *a, vf *b) { (void)a, (void)b; }
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#define MAX_ROWS 32   /* query rows (queries x heads of a group) per work item: their accumulators stay in L1 */
#define MIN_PART 256  /* shortest key partition worth a merge */
#define TRANSPOSE_ROWS 8 /* rows from which a tile's keys are transposed once rather than summed per row */
#define SCORE_PREFETCH ((W + 1) / 2) /* next block's keys requested per tile scored (the rest while the values are summed) */
#ifndef PV_COLS /* columns of a row's accumulator held in registers while the values are summed */
#define PV_COLS (W == 16 ? 4 * W : 2 * W)
#endif
#define KEY_BLOCK 128 /* keys scored before their softmax and values: one max, one rescale per row and block */

/* tanh x (Cephes): an odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign;
 * ~1 ulp, so a softcap multiplies no cancellation error into the scores. */
static inline vf vtanh(vf x) {
    const vf a = vabs(x), z = vmul(x, x);
    vf p = vset1(-5.70498872745e-3f);
    p = vfma(p, z, vset1(2.06390887954e-2f));
    p = vfma(p, z, vset1(-5.37397155531e-2f));
    p = vfma(p, z, vset1(1.33314422036e-1f));
    p = vfma(p, z, vset1(-3.33332819422e-1f));
    const vf small = vfma(vmul(p, z), x, x);
    const vf large = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(vexp(vadd(a, a)), vset1(1.0f))));
    const vf signed_large = vselect(vless(x, vzero()), vsub(vzero(), large), large);
    return vselect(vless(a, vset1(0.625f)), small, signed_large);
}

/* Lane j = q . k[j] over d float32 values, for the W keys of a tile. */
static inline vf qk_f32(const float *q, const float *const *k, int64_t d) {
    vf acc[W];
    for (int j = 0; j < W; ++j) acc[j] = vzero();
    for (int64_t i = 0; i < d; i += W) {
        const vf qv = vload(q + i, d - i);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) acc[j] = vfma(qv, vload(k[j] + i, d - i), acc[j]);
    }
    return vsum_keys(acc);
}

#ifdef NATIVE_BF16_DOT
/* The same for bf16 q and keys: 32 products per instruction, exact, summed in float32. */
static inline vf qk_bf16(const uint16_t *q, const uint16_t *const *k, int64_t d) {
    vf acc[W];
    for (int j = 0; j < W; ++j) acc[j] = vzero();
    for (int64_t i = 0; i < d; i += 32) {
        const __mmask32 m = mask32_first(d - i);
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + i);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + i));
    }
    return vsum_keys(acc);
}

/* Query pairs for qk_bf16_quads: qt[c * 4 + t] lane 4L + i = pair 16c + 4L + t of q (d bf16 values),
 * the same for every i: each 128-bit lane broadcasts its own t-th pair. */
static void quad_queries(const uint16_t *q, int64_t d, __m512i *qt) {
    for (int64_t c = 0; 32 * c < d; ++c) {
        const int64_t n = d - 32 * c;
        const __mmask32 m = mask32_first(n);
        const __m512i x = _mm512_maskz_loadu_epi16(m, q + 32 * c);
        qt[4 * c] = _mm512_shuffle_epi32(x, 0x00), qt[4 * c + 1] = _mm512_shuffle_epi32(x, 0x55);
        qt[4 * c + 2] = _mm512_shuffle_epi32(x, 0xAA), qt[4 * c + 3] = _mm512_shuffle_epi32(x, 0xFF);
    }
}

/* out[r] lane j = q_r . k[j] for nr (<= 4, a constant at each call site) rows of quad_queries (qt_stride
 * vectors apart). Four keys at a time are transposed within each 128-bit lane (8 shuffles per 32 pairs,
 * shared by the rows), so a row's dot products leave only the four 128-bit lanes to sum: ~45 shuffles
 * and adds per row and tile become 9, for 16 shuffles per four keys. */
__attribute__((always_inline)) static inline void qk_bf16_quads(const __m512i *qt, int64_t qt_stride, int nr,
                                                                const uint16_t *const *k, int64_t d, vf *out) {
    vf acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) acc[r][g] = vzero();
    for (int64_t c = 0; 32 * c < d; ++c) {
        const int64_t n = d - 32 * c;
        const __mmask32 m = mask32_first(n);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
            __m512i x[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) x[i] = _mm512_maskz_loadu_epi16(m, k[4 * g + i] + 32 * c);
            const __m512i a0 = _mm512_unpacklo_epi32(x[0], x[1]), a1 = _mm512_unpackhi_epi32(x[0], x[1]);
            const __m512i a2 = _mm512_unpacklo_epi32(x[2], x[3]), a3 = _mm512_unpackhi_epi32(x[2], x[3]);
            const __m512i t[4] = {_mm512_unpacklo_epi64(a0, a2), _mm512_unpackhi_epi64(a0, a2),
                                  _mm512_unpacklo_epi64(a1, a3), _mm512_unpackhi_epi64(a1, a3)};
#pragma GCC unroll 4
            for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
                for (int e = 0; e < 4; ++e)
                    acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)t[e],
                                                 (__m512bh)qt[r * qt_stride + 4 * c + e]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r) out[r] = vsum_quarters(acc[r]);
}

/* r[p] = column p of the 16 x 16 dword matrix with rows r[0..16): unpacks build 4 x 4 blocks within
 * each 128-bit lane, two rounds of 128-bit lane shuffles move the blocks. */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i)
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
        r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[4 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD), r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* kt[p * W + j] = elements 2p and 2p + 1 of key j (0 past d), p < ceil(d / 2): the tile's keys
 * across the lanes, so that a row's scores need no horizontal sums. */
static void transpose_keys(const uint16_t *const *k, int64_t d, uint32_t *kt) {
    const int64_t pairs = (d + 1) / 2;
    for (int64_t c = 0; c < pairs; c += 16) {
        const int64_t n = d - 2 * c;
        const __mmask32 m = mask32_first(n);
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_epi16(m, k[j] + 2 * c);
        transpose16(r);
        for (int64_t p = 0; p < min64(16, pairs - c); ++p) _mm512_storeu_si512(kt + (c + p) * 16, r[p]);
    }
}

/* out[r * 2 + t] lane j = row r's q . key j of tile t for the nr rows of q (bf16, q_stride apart,
 * zero-padded to an even length) against the transposed tiles (tile t at kt + t * pairs * W); each
 * query pair is broadcast once for both tiles. nr and tiles are constants at each call site. */
__attribute__((always_inline)) static inline void qk_transposed(const uint32_t *kt, int64_t pairs, const uint16_t *q,
                                                                int64_t q_stride, int nr, int tiles, vf *out) {
    vf acc[8][2];
    for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 16);
        const __m512bh k1 = tiles > 1 ? (__m512bh)_mm512_loadu_si512(kt + (pairs + p) * 16) : k0;
        for (int r = 0; r < nr; ++r) {
            uint32_t qp;
            memcpy(&qp, q + r * q_stride + 2 * p, sizeof qp);
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qv);
            if (tiles > 1) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qv);
        }
    }
    for (int r = 0; r < nr; ++r) out[2 * r] = acc[r][0], out[2 * r + 1] = acc[r][1];
}
#endif

/* dst row j (d floats) = bf16 row src[j], for the W rows of a tile. */
static inline void rows_to_f32(float *dst, const uint16_t *const *src, const float **rows, int64_t d) {
    for (int j = 0; j < W; ++j) {
        for (int64_t i = 0; i < d; i += W) vstore(dst + j * d + i, vload_bf16(src[j] + i, d - i), d - i);
        rows[j] = dst + j * d;
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables, *context_lens, *query_starts;
    int64_t q_stride, max_blocks, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap;
    int is_bf16;
} Args;

/* Rows [0, num_kv * num_queries * group) of one item: query qi of the chunk with head g of the item's
 * KV head kv_head + h is row (h * num_queries + qi) * group + g, so each KV head's rows are contiguous. */
typedef struct {
    int64_t seq, first, num_queries, kv_head, num_kv, key_begin, key_end;
    int64_t partial;   /* index of its partial result, or -1: the item writes the output itself */
    int64_t num_parts; /* on the first partition of a split (sequence, chunk, head): how many follow */
} Item;

/* The next block's keys, requested a few at a time all through the current block: a core has only so
 * many misses in flight, so a steady trickle keeps memory busy where a burst would stall. The unit is
 * one head's piece of a key's K and V rows: pieces u = j * heads + h lie at k / v + offsets[j] + h * D
 * elements, so an item of several heads requests each token's row front to back. */
typedef struct {
    const int64_t *offsets;
    const char *k, *v;
    int64_t n, heads, done, piece_bytes, esize; /* n keys of `heads` pieces */
} Ahead;

/* Asks for the next `count` pieces ahead of use: blocks lie anywhere, so no hardware prefetcher
 * follows them, and without this the kernel waits on memory latency, not bandwidth.
 * always_inline: GCC deems a function of prefetches alone free of effects and drops calls to it. */
__attribute__((always_inline)) static inline void prefetch_ahead(Ahead *ahead, int64_t count) {
    const int64_t u1 = min64(ahead->done + count, ahead->n * ahead->heads), bytes = ahead->piece_bytes;
    for (int64_t u = ahead->done, j = u / ahead->heads, h = u % ahead->heads; u < u1; ++u) {
        const int64_t skip = h * bytes + ahead->offsets[j] * ahead->esize;
        const char *k = ahead->k + skip, *v = ahead->v + skip;
        if (++h == ahead->heads) h = 0, ++j;
        const int64_t skew = (int64_t)((uintptr_t)k & 63); /* v's too where the caches align alike (torch's do) */
        for (int64_t b = -skew; b < bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 3);
            __builtin_prefetch(v + b, 0, 3);
        }
    }
    ahead->done = max64(ahead->done, u1);
}

typedef struct {
    float *q, *acc, *m, *l, *k_tile, *p; /* p: [rows_cap, KEY_BLOCK] scores, then probabilities */
    uint16_t *q_bf16;                    /* rows q_stride_bf16(d) apart */
    uint32_t *kt;                        /* two transposed tiles of bf16 keys, [2, ceil(d / 2), W] */
    uint32_t *pb;                        /* p rounded to bf16 in key pairs, [rows_cap, KEY_BLOCK / 2] */
    void *qt;                            /* quad_queries of each row, quad_stride(d) vectors apart */
    int64_t *row_range;                  /* [2 * rows_cap]: each row's key range in the current block */
    float *lanes;                        /* attend_lanes' state and block buffers (Lanes), or NULL */
} Scratch;

/* Vectors of quad_queries per row. */
static inline int64_t quad_stride(int64_t d) { return 4 * ((d + 31) / 32); }

/* bf16 query rows are padded to an even length: the transposed scores read them in pairs. */
static inline int64_t q_stride_bf16(int64_t d) { return d + (d & 1); }

/* Keys [lo, hi) that query qi of the item sees, within the item's partition. */
static inline void key_range(const Args *a, const Item *it, int64_t qi, int64_t *lo, int64_t *hi) {
    const int64_t b = it->seq, q_len = a->query_starts[b + 1] - a->query_starts[b];
    const int64_t pos = a->context_lens[b] - q_len + it->first + qi;
    *lo = max64(it->key_begin, a->window > 0 ? pos - a->window + 1 : 0);
    *hi = min64(it->key_end, pos + 1);
}

/* dst[0..n) = src[0..n): a libc call per short row costs as much as the copy. */
static inline void copy_bf16(uint16_t *dst, const uint16_t *src, int64_t n) {
#if W == 16
    for (int64_t i = 0; i < n; i += 32) {
        const __mmask32 m = mask32_first(n - i);
        _mm512_mask_storeu_epi16(dst + i, m, _mm512_maskz_loadu_epi16(m, src + i));
    }
#else
    memcpy(dst, src, (size_t)n * sizeof(uint16_t));
#endif
}

/* The step token and query head of an item's rows, walked in order (see Item) without divisions. */
typedef struct {
    int64_t token, head, g, qi, group;
} RowAt;

static inline RowAt first_row(const Args *a, const Item *it) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const RowAt at = {a->query_starts[it->seq] + it->first, it->kv_head * group, 0, 0, group};
    return at;
}

static inline void next_row(const Item *it, RowAt *at) {
    if (++at->g < at->group) {
        ++at->head;
    } else if (at->g = 0, ++at->qi < it->num_queries) {
        ++at->token, at->head -= at->group - 1;
    } else { /* the next KV head's first query head */
        at->qi = 0, at->token -= it->num_queries - 1, ++at->head;
    }
}

static inline int64_t item_rows(const Args *a, const Item *it) {
    return it->num_kv * it->num_queries * (a->num_heads / a->num_kv_heads);
}

static void load_queries(const Args *a, const Item *it, Scratch *s) {
    const int64_t d = a->head_dim, qs = q_stride_bf16(d), rows = item_rows(a, it);
    /* Only items that score row by row read the quads (see score_block); larger ones transpose keys. */
    const int quads = s->qt != NULL && it->num_queries * (a->num_heads / a->num_kv_heads) < TRANSPOSE_ROWS;
    RowAt at = first_row(a, it);
    for (int64_t r = 0; r < rows; ++r, next_row(it, &at)) {
        const int64_t offset = at.token * a->q_stride + at.head * d;
        if (a->is_bf16) {
            const uint16_t *src = (const uint16_t *)a->q + offset;
            copy_bf16(s->q_bf16 + r * qs, src, d);
            if (qs > d) s->q_bf16[r * qs + d] = 0;
#ifdef NATIVE_BF16_DOT
            if (quads) quad_queries(src, d, (__m512i *)s->qt + r * quad_stride(d));
#else /* else the bf16 copy is all the scores read */
            for (int64_t i = 0; i < d; i += W) vstore(s->q + r * d + i, vload_bf16(src + i, d - i), d - i);
#endif
        } else {
            memcpy(s->q + r * d, (const float *)a->q + offset, (size_t)d * sizeof(float));
        }
        memset(s->acc + r * d, 0, (size_t)d * sizeof(float));
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
}

/* Lane j = the scores of row r against the tile's keys (bf16 keys read in place where the CPU has
 * bf16 dot products, else from their float32 copy). */
static inline vf row_scores(const Args *a, const Scratch *s, int64_t r, const uint16_t *const *k_bf16,
                            const float *const *k_rows) {
#ifdef NATIVE_BF16_DOT
    if (a->is_bf16) return qk_bf16(s->q_bf16 + r * q_stride_bf16(a->head_dim), k_bf16, a->head_dim);
#else
    (void)k_bf16;
#endif
    return qk_f32(s->q + r * a->head_dim, k_rows, a->head_dim);
}

/* Row scores x against the tile's keys: scale, softcap, -inf outside the lanes [lo, hi) the row sees. */
static inline void store_scores(const Args *a, vf x, int64_t lo, int64_t hi, float *p) {
    x = vmul(x, vset1(a->scale));
    if (a->softcap > 0.0f) x = vmul(vset1(a->softcap), vtanh(vmul(x, vset1(1.0f / a->softcap))));
    vstore(p, vselect(vrange(lo, hi), x, vset1(-INFINITY)), W);
}

#ifdef NATIVE_BF16_DOT
/* score_block's tiles t0 (and t0 + W when k1 is not NULL) for many rows: the keys are transposed once,
 * then each row's scores are dot products of broadcast query pairs with the key columns, eight rows
 * at a time. */
static void score_tiles_transposed(const Args *a, const Item *it, Scratch *s, int64_t t0, int64_t nk,
                                   const uint16_t *const *k0, const uint16_t *const *k1, const int64_t *lo,
                                   const int64_t *hi) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads, rows = it->num_queries * group;
    const int64_t pairs = (d + 1) / 2, qs = q_stride_bf16(d), tiles = k1 != NULL ? 2 : 1;
    transpose_keys(k0, d, s->kt);
    if (k1 != NULL) transpose_keys(k1, d, s->kt + pairs * W);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        vf x[16];
        const uint16_t *q = s->q_bf16 + r0 * qs;
        const int nr = (int)min64(8, rows - r0);
#define QK_CASE(NR) \
        case NR: \
            if (tiles > 1) qk_transposed(s->kt, pairs, q, qs, NR, 2, x); \
            else qk_transposed(s->kt, pairs, q, qs, NR, 1, x); \
            break;
        switch (nr) {
        QK_CASE(8) QK_CASE(7) QK_CASE(6) QK_CASE(5) QK_CASE(4) QK_CASE(3) QK_CASE(2) QK_CASE(1)
        }
#undef QK_CASE
        for (int r = 0; r < nr; ++r) {
            const int64_t qi = (r0 + r) / group;
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t base = t0 + t * W;
                store_scores(a, x[2 * r + t], lo[qi] - base, min64(hi[qi], nk) - base, s->p + (r0 + r) * KEY_BLOCK + base);
            }
        }
    }
}
#endif

/* Scores of one KV head's rows of the item against the block's keys [t_begin, t_end) (of nk; cache
 * element offsets `offsets`; t_begin a multiple of W) into s->p, -inf where a row does not see a key
 * (query qi sees [lo[qi], hi[qi])); tiles a row does not see at all cost it no dot products. A share
 * of the next block is requested per tile when `ahead` is not NULL. */
static void score_block(const Args *a, const Item *it, Scratch *s, int64_t nk, const int64_t *offsets,
                        const int64_t *lo, const int64_t *hi, int64_t t_begin, int64_t t_end, Ahead *ahead) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += W) {
        if (ahead != NULL) prefetch_ahead(ahead, SCORE_PREFETCH);
        const float *k_rows[W] = {0};
        const uint16_t *k_bf16[W] = {0};
        for (int j = 0; j < W; ++j) {
            const int64_t off = offsets[t0 + j < nk ? t0 + j : t0]; /* past the last key: a real, finite row */
            if (a->is_bf16) k_bf16[j] = (const uint16_t *)a->k_cache + off;
            else k_rows[j] = (const float *)a->k_cache + off;
        }
        int visible = 0;
        for (int64_t qi = 0; qi < it->num_queries; ++qi) visible |= lo[qi] < min64(hi[qi], t0 + W) && hi[qi] > t0;
#ifdef NATIVE_BF16_DOT
        if (visible && a->is_bf16 && it->num_queries * group >= TRANSPOSE_ROWS) {
            const uint16_t *k_next[W]; /* the next tile too, when there is one: scored in the same pass */
            const int pair = t0 + W < t_end;
            for (int j = 0; pair && j < W; ++j)
                k_next[j] = (const uint16_t *)a->k_cache + offsets[t0 + W + j < nk ? t0 + W + j : t0 + W];
            score_tiles_transposed(a, it, s, t0, nk, k_bf16, pair ? k_next : NULL, lo, hi);
            if (pair) {
                t0 += W;
                if (ahead != NULL) prefetch_ahead(ahead, SCORE_PREFETCH);
            }
            continue;
        }
#endif
        int converted = 0;
        for (int64_t qi = 0; qi < it->num_queries; ++qi) {
            float *p = s->p + qi * group * KEY_BLOCK + t0;
            if (lo[qi] >= min64(hi[qi], t0 + W) || hi[qi] <= t0) {
                for (int64_t g = 0; g < group; ++g) vstore(p + g * KEY_BLOCK, vset1(-INFINITY), W);
                continue;
            }
#ifndef NATIVE_BF16_DOT
            if (a->is_bf16 && !converted) rows_to_f32(s->k_tile, k_bf16, k_rows, d); /* once per tile for all rows */
#endif
            converted = 1;
#ifdef NATIVE_BF16_DOT
            if (a->is_bf16 && s->qt != NULL) { /* a group of at most 4 rows (see paged_attention) */
                const __m512i *qt = (const __m512i *)s->qt + qi * group * quad_stride(d);
                vf x[4];
                switch (group) {
                case 4: qk_bf16_quads(qt, quad_stride(d), 4, k_bf16, d, x); break;
                case 3: qk_bf16_quads(qt, quad_stride(d), 3, k_bf16, d, x); break;
                case 2: qk_bf16_quads(qt, quad_stride(d), 2, k_bf16, d, x); break;
                default: qk_bf16_quads(qt, quad_stride(d), 1, k_bf16, d, x);
                }
                for (int64_t g = 0; g < group; ++g)
                    store_scores(a, x[g], lo[qi] - t0, min64(hi[qi], nk) - t0, p + g * KEY_BLOCK);
                continue;
            }
#endif
            for (int64_t g = 0; g < group; ++g)
                store_scores(a, row_scores(a, s, qi * group + g, k_bf16, k_rows), lo[qi] - t0, min64(hi[qi], nk) - t0,
                             p + g * KEY_BLOCK);
        }
        (void)converted, (void)visible, (void)d;
    }
}

/* Rows r < nr of acc (d floats apart) += sum over keys j0 <= j < j1 of p[r * KEY_BLOCK + j] * v[j]:
 * 2W columns at a time, held in registers across all the keys, so each V row is loaded (and widened,
 * even and odd bf16 elements apart with one instruction each) once per nr rows. Callers pass constants
 * for nr and is_bf16 so the unused accumulators and the other dtype's loads vanish. */
__attribute__((always_inline)) static inline void pv_rows(float *acc, int64_t d, const float *p, int nr,
                                                          const void *v_cache, const int64_t *offsets,
                                                          int64_t j0, int64_t j1, int is_bf16) {
    for (int64_t i = 0; i < d; i += PV_COLS) {
        const int64_t n = d - i;
        vf sum[4][PV_COLS / W];
#pragma GCC unroll 16
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 16
            for (int c = 0; c < PV_COLS / W; ++c) sum[r][c] = vzero();
        for (int64_t j = j0; j < j1; ++j) {
            vf x[PV_COLS / W];
#pragma GCC unroll 16
            for (int c = 0; c < PV_COLS / W; c += 2) {
                if (is_bf16) {
                    vload_pair_bf16((const uint16_t *)v_cache + offsets[j] + i + c * W, n - c * W, &x[c], &x[c + 1]);
                } else {
                    const float *v = (const float *)v_cache + offsets[j] + i + c * W;
                    x[c] = vload(v, n - c * W);
                    x[c + 1] = vload(v + W, n - (c + 1) * W);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < nr; ++r) {
                const vf pr = vset1(p[r * KEY_BLOCK + j]);
#pragma GCC unroll 16
                for (int c = 0; c < PV_COLS / W; ++c) sum[r][c] = vfma(pr, x[c], sum[r][c]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < nr; ++r)
#pragma GCC unroll 16
            for (int c = 0; c < PV_COLS / W; c += 2) {
                if (is_bf16) vinterleave(&sum[r][c], &sum[r][c + 1]);
                float *row = acc + r * d + i + c * W;
                vstore(row, vadd(vload(row, n - c * W), sum[r][c]), n - c * W);
                vstore(row + W, vadd(vload(row + W, n - (c + 1) * W), sum[r][c + 1]), n - (c + 1) * W);
            }
    }
}

#ifdef NATIVE_BF16_DOT
/* The bf16 route of pv_rows: the probabilities rounded to bf16 (as the twin's probs.to(v.dtype) are),
 * paired by key (pb dword j / 2 = keys j, j + 1; rows KEY_BLOCK / 2 apart), the V rows of two keys
 * interleaved by 16-bit unpacks, and one pair dot product per 16 lanes: no widening, half the
 * multiply-adds. Keys from j0 rounded down to even to j1 (a key past nk reads key j's row, with
 * probability 0). The unpacks leave each 32-column chunk as columns 8k..8k+3 then 8k+4..8k+7 per
 * 128-bit lane; two permutes per chunk and row put them back. */
__attribute__((always_inline)) static inline void pv_rows_dot(float *acc, int64_t d, const uint32_t *pb, int nr,
                                                              const uint16_t *v_cache, const int64_t *offsets,
                                                              int64_t nk, int64_t j0, int64_t j1) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < d; i += 64) {
        const int64_t n = d - i;
        vf sum[4][4];
#pragma GCC unroll 16
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) sum[r][c] = vzero();
        for (int64_t j = j0 & ~(int64_t)1; j < j1; j += 2) {
            const uint16_t *va = v_cache + offsets[j] + i, *vb = v_cache + offsets[j + 1 < nk ? j + 1 : j] + i;
            __m512bh x[4];
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                const int64_t left = n - 32 * c;
                const __mmask32 m = mask32_first(left);
                const __m512i ka = _mm512_maskz_loadu_epi16(m, va + 32 * c), kb = _mm512_maskz_loadu_epi16(m, vb + 32 * c);
                x[2 * c] = (__m512bh)_mm512_unpacklo_epi16(ka, kb), x[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(ka, kb);
            }
#pragma GCC unroll 4
            for (int r = 0; r < nr; ++r) {
                const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pb[r * (KEY_BLOCK / 2) + j / 2]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], x[c], pr);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r)
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                float *row = acc + r * d + i + 32 * c;
                const int64_t left = n - 32 * c;
                const vf lo = _mm512_permutex2var_ps(sum[r][2 * c], first, sum[r][2 * c + 1]);
                const vf hi = _mm512_permutex2var_ps(sum[r][2 * c], second, sum[r][2 * c + 1]);
                vstore(row, vadd(vload(row, left), lo), left);
                vstore(row + W, vadd(vload(row + W, left - W), hi), left - W);
            }
    }
}

/* pb row r = row r of p (n lanes, a multiple of W) rounded to bf16, in key pairs. */
static void pair_probabilities(const float *p, int64_t rows, int64_t n, uint32_t *pb) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; j += 2 * W) {
            const float *pr = p + r * KEY_BLOCK + j;
            uint32_t *dst = pb + r * (KEY_BLOCK / 2) + j / 2;
            if (n - j >= 2 * W) _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(vload(pr + W, W), vload(pr, W)));
            else _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(vload(pr, W)));
        }
}
#endif

#define PV_KEYS 32 /* keys per slice of a block's values: between slices, the next block is requested */

/* pv_rows over `rows` rows (probabilities p, KEY_BLOCK apart; with bf16 dot products pb, p paired by
 * pair_probabilities) for the keys [k0, min(k0 + PV_KEYS, nk)), four rows at a time; each pass reads
 * only the keys its rows see ([lo, hi) per row). */
static void pv_slice(const Args *a, float *acc, const float *p, int64_t rows, const int64_t *lo, const int64_t *hi,
                     int64_t nk, const int64_t *offsets, int64_t k0, const uint32_t *pb) {
    const int64_t d = a->head_dim;
#ifndef NATIVE_BF16_DOT
    (void)pb, (void)nk;
#endif
    for (int64_t r = 0; r < rows; r += 4) {
        const int nr = (int)min64(4, rows - r);
        int64_t j0 = lo[r], j1 = hi[r];
        for (int k = 1; k < nr; ++k) j0 = min64(j0, lo[r + k]), j1 = max64(j1, hi[r + k]);
        j0 = max64(j0, k0), j1 = min64(j1, k0 + PV_KEYS);
        if (j0 >= j1) continue;
        float *ar = acc + r * d;
        const float *pr = p + r * KEY_BLOCK;
#ifdef NATIVE_BF16_DOT
#define PV_BF16(NR) pv_rows_dot(ar, d, pb + r * (KEY_BLOCK / 2), NR, (const uint16_t *)a->v_cache, offsets, nk, j0, j1)
#else
#define PV_BF16(NR) pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, 1)
#endif
#define PV_CASE(NR) \
        if (a->is_bf16) PV_BF16(NR); \
        else pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, 0); \
        break;
        switch (nr) {
        case 4: PV_CASE(4)
        case 3: PV_CASE(3)
        case 2: PV_CASE(2)
        default: PV_CASE(1)
        }
#undef PV_CASE
#undef PV_BF16
    }
}

/* Online softmax for one row over a block of n scores (a multiple of W): the scores become
 * probabilities (0 where -inf), the row's max and sum move on, and its accumulator is rescaled. */
static void softmax_block(float *p, int64_t n, float *m, float *l, float *acc, int64_t d) {
    vf mx = vset1(-INFINITY);
    for (int64_t j = 0; j < n; j += W) mx = vmax(mx, vload(p + j, W));
    const float block_max = vhmax(mx);
    if (block_max == -INFINITY) { /* the row sees none of the block's keys */
        for (int64_t j = 0; j < n; j += W) vstore(p + j, vzero(), W);
        return;
    }
    const float m_new = block_max > *m ? block_max : *m;
    if (m_new > *m && *l > 0.0f) {
        const vf c = vset1(expf(*m - m_new));
        for (int64_t i = 0; i < d; i += W) vstore(acc + i, vmul(vload(acc + i, d - i), c), d - i);
        *l *= expf(*m - m_new);
    }
    vf sum = vzero();
    const vf neg_inf = vset1(-INFINITY), shift = vset1(m_new);
    for (int64_t j = 0; j < n; j += W) {
        const vf x = vload(p + j, W);
        const vf e = vselect(vless(neg_inf, x), vexp(vsub(x, shift)), vzero());
        sum = vadd(sum, e);
        vstore(p + j, e, W);
    }
    *l += vhsum(sum);
    *m = m_new;
}

/* The views of KV head h of the item (rows rows each): its K/V (`offsets` point at the item's first
 * head) and its rows of the scratch. */
static inline void head_views(const Args *a, const Scratch *s, int64_t h, int64_t rows, Args *ah, Scratch *sh) {
    const int64_t d = a->head_dim, esize = a->is_bf16 ? 2 : 4;
    *ah = *a, *sh = *s;
    ah->k_cache = (const char *)a->k_cache + h * d * esize, ah->v_cache = (const char *)a->v_cache + h * d * esize;
    sh->q += h * rows * d, sh->q_bf16 += h * rows * q_stride_bf16(d), sh->acc += h * rows * d;
    sh->m += h * rows, sh->l += h * rows, sh->p += h * rows * KEY_BLOCK, sh->pb += h * rows * (KEY_BLOCK / 2);
#ifdef NATIVE_BF16_DOT
    if (s->qt != NULL) sh->qt = (__m512i *)s->qt + h * rows * quad_stride(d);
#endif
}

/* attend_block for an item of one KV head: its whole block scored, then its values summed slice by
 * slice, the next block requested a share per tile and per slice. */
static void attend_block_head(const Args *a, Scratch *s, const Item *it, int64_t rows, int64_t nk,
                              const int64_t *offsets, const int64_t *lo, const int64_t *hi, const int64_t *row_lo,
                              const int64_t *row_hi, Ahead *ahead) {
    const int64_t d = a->head_dim, n = (nk + W - 1) / W * W, slices = (nk + PV_KEYS - 1) / PV_KEYS;
    const int64_t units = ahead->n * ahead->heads; /* the next item may be one of several heads */
    score_block(a, it, s, nk, offsets, lo, hi, 0, nk, ahead);
    for (int64_t r = 0; r < rows; ++r) softmax_block(s->p + r * KEY_BLOCK, n, &s->m[r], &s->l[r], s->acc + r * d, d);
#ifdef NATIVE_BF16_DOT
    if (a->is_bf16) pair_probabilities(s->p, rows, n, s->pb);
#endif
    for (int64_t j = 0; j < nk; j += PV_KEYS) {
        prefetch_ahead(ahead, (units - ahead->done + slices - 1) / slices);
        pv_slice(a, s->acc, s->p, rows, row_lo, row_hi, nk, offsets, j, s->pb);
    }
    prefetch_ahead(ahead, units);
}

/* attend_block for an item of several KV heads: they take turns every two tiles of scores and every
 * slice of values, so the pieces of a token's K/V row (all the item's heads: one contiguous run of
 * the cache) are read close together; meanwhile the next block's rows are requested, a share per turn. */
static void attend_block_heads(const Args *a, Scratch *s, const Item *it, int64_t rows, int64_t nk,
                               const int64_t *offsets, const int64_t *lo, const int64_t *hi, const int64_t *row_lo,
                               const int64_t *row_hi, Ahead *ahead) {
    const int64_t d = a->head_dim, heads = it->num_kv, n = (nk + W - 1) / W * W;
    Args ah[MAX_ROWS];
    Scratch sh[MAX_ROWS];
    for (int64_t h = 0; h < heads; ++h) head_views(a, s, h, rows, &ah[h], &sh[h]);
    for (int64_t t = 0; t < nk; t += 2 * W) {
        for (int64_t h = 0; h < heads; ++h) {
            prefetch_ahead(ahead, 2 * SCORE_PREFETCH);
            score_block(&ah[h], it, &sh[h], nk, offsets, lo, hi, t, min64(t + 2 * W, nk), NULL);
        }
    }
    for (int64_t r = 0; r < heads * rows; ++r)
        softmax_block(s->p + r * KEY_BLOCK, n, &s->m[r], &s->l[r], s->acc + r * d, d);
#ifdef NATIVE_BF16_DOT
    if (a->is_bf16) pair_probabilities(s->p, heads * rows, n, s->pb);
#endif
    const int64_t slices = (nk + PV_KEYS - 1) / PV_KEYS;
    for (int64_t j = 0, i = 0; j < nk; j += PV_KEYS, ++i) {
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t calls = (slices - i) * heads - h;
            prefetch_ahead(ahead, (ahead->n * ahead->heads - ahead->done + calls - 1) / calls);
            pv_slice(&ah[h], sh[h].acc, sh[h].p, rows, row_lo, row_hi, nk, offsets, j, sh[h].pb);
        }
    }
    prefetch_ahead(ahead, ahead->n * ahead->heads);
}

/* The item's rows against the block of keys [k0, k0 + nk) at `offsets`. */
static void attend_block(const Args *a, const Item *it, Scratch *s, int64_t k0, int64_t nk, const int64_t *offsets,
                         Ahead *ahead) {
    const int64_t group = a->num_heads / a->num_kv_heads, rows = it->num_queries * group;
    /* Per query at most MAX_ROWS queries; per row in scratch, since a group wider than MAX_ROWS
     * (multi-query models: 48 or 71 heads on one KV head) makes an item of one query and `group` rows. */
    int64_t lo[MAX_ROWS], hi[MAX_ROWS], *row_lo = s->row_range, *row_hi = s->row_range + rows;
    for (int64_t qi = 0; qi < it->num_queries; ++qi) {
        key_range(a, it, qi, &lo[qi], &hi[qi]);
        lo[qi] = max64(lo[qi], k0) - k0, hi[qi] = min64(hi[qi], k0 + nk) - k0;
        for (int64_t g = 0; g < group; ++g) row_lo[qi * group + g] = lo[qi], row_hi[qi * group + g] = hi[qi];
    }
    if (it->num_kv == 1) attend_block_head(a, s, it, rows, nk, offsets, lo, hi, row_lo, row_hi, ahead);
    else attend_block_heads(a, s, it, rows, nk, offsets, lo, hi, row_lo, row_hi, ahead);
}

#ifdef NATIVE_BF16_DOT
/* attend_lanes' working set, one row of the item per lane of LANE_VECS vectors: the queries transposed
 * into dword pairs (qt, [ceil(d / 2)][LANE_ROWS]), the accumulator transposed (acc, [d][LANE_ROWS]),
 * the running max and sum (m, l), a block's scores (sc, [KEY_BLOCK][LANE_ROWS]), its probabilities
 * rounded to bf16 in key pairs (pp, [KEY_BLOCK / 2][LANE_ROWS] dwords), its V rows paired by key (vp,
 * [KEY_BLOCK / 2][lane_cols(d)] dwords: column i of keys 2p, 2p + 1) and its key rows (kr). */
#define LANE_VECS 3 /* 8 keys (or columns) x 3 vectors of accumulators: 24 of the 32 registers */
#define LANE_ROWS (LANE_VECS * W)
#define LANE_KEY_STRIDE 128 /* dwords per copied key row: head dims up to 256 */
typedef struct {
    uint32_t *qt, *pp, *vp, *kr;
    float *acc, *m, *l, *sc;
} Lanes;

/* Columns of a paired V row: d rounded up to the 32 that a pair of 512-bit loads covers. */
static inline int64_t lane_cols(int64_t d) { return (d + 31) / 32 * 32; }

/* Floats of attend_lanes' scratch for head dim d. */
static inline int64_t lanes_floats(int64_t d) {
    return (d + 1) / 2 * LANE_ROWS + d * LANE_ROWS + 2 * LANE_ROWS + KEY_BLOCK * LANE_ROWS +
           KEY_BLOCK / 2 * LANE_ROWS + KEY_BLOCK / 2 * lane_cols(d) + (KEY_BLOCK + 8) * LANE_KEY_STRIDE + W;
}

static inline Lanes lanes_view(float *buf, int64_t d) {
    Lanes v;
    v.qt = (uint32_t *)buf, v.acc = buf + (d + 1) / 2 * LANE_ROWS, v.m = v.acc + d * LANE_ROWS, v.l = v.m + LANE_ROWS;
    v.sc = v.l + LANE_ROWS, v.pp = (uint32_t *)(v.sc + KEY_BLOCK * LANE_ROWS), v.vp = v.pp + KEY_BLOCK / 2 * LANE_ROWS;
    v.kr = v.vp + KEY_BLOCK / 2 * lane_cols(d);
    return v;
}

/* Whether the item runs on attend_lanes: a bf16 chunk of several queries of one KV head (prefill),
 * whose rows fit the lanes and fill at least half of one vector. Decode never does. */
static inline int lanes_item(const Args *a, const Item *it) {
    const int64_t rows = item_rows(a, it);
    return a->is_bf16 && it->num_kv == 1 && it->num_queries > 1 && rows >= W / 2 && rows <= LANE_ROWS &&
           a->head_dim <= 2 * LANE_KEY_STRIDE;
}

/* lanes_item, and the thread has attend_lanes' scratch (allocated when a step has such items). */
static inline int lanes_apply(const Args *a, const Scratch *s, const Item *it) {
    return s->lanes != NULL && lanes_item(a, it);
}

/* The item's state in lanes: its query rows (bf16, read from q) transposed into dword pairs (qt[p][r] =
 * elements 2p, 2p + 1 of row r; 0 past d and past the rows), accumulators 0, max -inf. */
static void lanes_begin(const Args *a, const Item *it, Scratch *s) {
    const int64_t d = a->head_dim, pairs = (d + 1) / 2, rows = item_rows(a, it);
    const Lanes v = lanes_view(s->lanes, d);
    const uint16_t *src[LANE_ROWS];
    RowAt at = first_row(a, it);
    for (int64_t r = 0; r < rows; ++r, next_row(it, &at))
        src[r] = (const uint16_t *)a->q + at.token * a->q_stride + at.head * d;
    for (int64_t c = 0; c < pairs; c += W)
        for (int g = 0; g < LANE_VECS; ++g) {
            __m512i r[16];
            const int64_t n = d - 2 * c; /* the row's elements from 2c: past d nothing is read */
            const __mmask32 m = mask32_first(n);
            for (int j = 0; j < 16; ++j)
                r[j] = g * W + j < rows ? _mm512_maskz_loadu_epi16(m, src[g * W + j] + 2 * c) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t p = 0; p < min64(16, pairs - c); ++p) _mm512_storeu_si512(v.qt + (c + p) * LANE_ROWS + g * W, r[p]);
        }
    memset(v.acc, 0, sizeof(float) * (size_t)(d * LANE_ROWS));
    for (int64_t r = 0; r < LANE_ROWS; ++r) v.m[r] = -INFINITY, v.l[r] = 0.0f;
}

/* Lane j = the bf16 bits of x's lane j (in the low half), rounded as vstore_bf16 rounds. */
static inline __m512i bf16_bits(vf x) { return vi_srli(vbf16_round_hi(x), 16); }

/* Back from lanes to rows: an item of one partition writes its output (each row times 1 / its sum,
 * rounded as store_row rounds), one of several leaves s->acc, s->m, s->l for finish_item. */
static void lanes_end(const Args *a, const Item *it, Scratch *s) {
    const int64_t d = a->head_dim, rows = item_rows(a, it), offset0 = a->num_heads * d;
    const Lanes v = lanes_view(s->lanes, d);
    const int direct = it->partial < 0;
    vf inv[LANE_VECS];
    int64_t dst[LANE_ROWS];
    RowAt at = first_row(a, it);
    for (int64_t r = 0; r < rows; ++r, next_row(it, &at)) dst[r] = at.token * offset0 + at.head * d;
    for (int g = 0; g < LANE_VECS; ++g) /* rows past the item's hold l = 0: their lanes are never stored */
        inv[g] = vdiv(vset1(1.0f), _mm512_loadu_ps(v.l + g * W));
    if (direct) { /* rounded to bf16 in lanes, columns 2p and 2p + 1 in one dword: a transpose per 32 */
        for (int64_t i = 0; i < d; i += 2 * W)
            for (int g = 0; g < LANE_VECS && g * W < rows; ++g) {
                __m512i r[16];
                for (int j = 0; j < 16; ++j) {
                    const int64_t c = i + 2 * j;
                    const __m512i e = c < d ? bf16_bits(vmul(_mm512_loadu_ps(v.acc + c * LANE_ROWS + g * W), inv[g]))
                                            : _mm512_setzero_si512();
                    const __m512i o = c + 1 < d ? bf16_bits(vmul(_mm512_loadu_ps(v.acc + (c + 1) * LANE_ROWS + g * W), inv[g]))
                                                : _mm512_setzero_si512();
                    r[j] = _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
                }
                transpose16(r);
                const int64_t n = min64(32, d - i);
                const __mmask32 m = mask32_first(n);
                for (int64_t j = 0; j < min64(16, rows - g * W); ++j)
                    _mm512_mask_storeu_epi16((uint16_t *)a->out + dst[g * W + j] + i, m, r[j]);
            }
        return;
    }
    for (int64_t i = 0; i < d; i += W)
        for (int g = 0; g < LANE_VECS && g * W < rows; ++g) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = i + j < d ? _mm512_loadu_si512(v.acc + (i + j) * LANE_ROWS + g * W) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t j = 0; j < min64(16, rows - g * W); ++j)
                vstore(s->acc + (g * W + j) * d + i, _mm512_castsi512_ps(r[j]), d - i);
        }
    memcpy(s->m, v.m, sizeof(float) * (size_t)rows);
    memcpy(s->l, v.l, sizeof(float) * (size_t)rows);
}

/* The item's rows (one per lane) against the block of keys [k0, k0 + nk) at `offsets`, rows in lanes:
 * the scores of eight keys at a time are dot products of each key's broadcast element pairs with the
 * transposed queries (no key transposes, no horizontal sums), the softmax runs down the lanes (the
 * block's max, one rescale and the exps for all the rows at once), and each V column pair of two keys
 * is broadcast against the rows' paired probabilities. Keys no row sees are skipped. */
static void attend_lanes(const Args *a, const Item *it, Scratch *s, int64_t k0, int64_t nk, const int64_t *offsets,
                         Ahead *ahead) {
    const int64_t d = a->head_dim, pairs = (d + 1) / 2, group = a->num_heads / a->num_kv_heads;
    const int64_t rows = item_rows(a, it), cols = lane_cols(d);
    const Lanes v = lanes_view(s->lanes, d);
    const uint16_t *kc = (const uint16_t *)a->k_cache, *vc = (const uint16_t *)a->v_cache;
    int32_t lo_r[LANE_ROWS], hi_r[LANE_ROWS];
    int64_t k_lo = nk, k_hi = 0; /* keys some row sees, block-relative */
    for (int64_t qi = 0, r = 0; qi < it->num_queries; ++qi) {
        int64_t lo, hi;
        key_range(a, it, qi, &lo, &hi);
        lo = max64(lo, k0) - k0, hi = min64(hi, k0 + nk) - k0;
        if (lo >= hi) lo = hi = 0;
        else k_lo = min64(k_lo, lo), k_hi = max64(k_hi, hi);
        for (int64_t g = 0; g < group; ++g, ++r) lo_r[r] = (int32_t)lo, hi_r[r] = (int32_t)hi;
    }
    for (int64_t r = rows; r < LANE_ROWS; ++r) lo_r[r] = hi_r[r] = 0;
    const int64_t units = ahead->n * ahead->heads;
    if (k_lo >= k_hi) {
        prefetch_ahead(ahead, units);
        return;
    }
    __m512i lov[LANE_VECS], hiv[LANE_VECS];
    vf mx[LANE_VECS];
    for (int g = 0; g < LANE_VECS; ++g) {
        lov[g] = _mm512_loadu_si512(lo_r + g * W), hiv[g] = _mm512_loadu_si512(hi_r + g * W);
        mx[g] = vset1(-INFINITY);
    }
    /* The keys' rows copied LANE_KEY_STRIDE dwords apart (zero past d), all the block's misses in flight
     * at once: one base register and constant offsets then address eight keys, where eight pointers
     * would crowd the registers. Up to 7 keys past k_hi repeat key k_lo (scored, not stored). */
    for (int64_t j = k_lo; j < k_lo + (k_hi - k_lo + 7) / 8 * 8; ++j) {
        const uint16_t *k = kc + offsets[j < k_hi ? j : k_lo];
        for (int64_t i = 0; i < 2 * pairs; i += 32) {
            const __mmask32 m = mask32_first(d - i);
            _mm512_storeu_si512(v.kr + (j - k_lo) * LANE_KEY_STRIDE + i / 2, _mm512_maskz_loadu_epi16(m, k + i));
        }
    }
    /* Scores, eight keys at a time. */
    const int64_t groups = (k_hi - k_lo + 7) / 8;
    for (int64_t j0 = k_lo, n = 0; j0 < k_hi; j0 += 8, ++n) {
        prefetch_ahead(ahead, (units / 2 - ahead->done + groups - n - 1) / (groups - n));
        const uint32_t *kr = v.kr + (j0 - k_lo) * LANE_KEY_STRIDE;
        vf acc[8][LANE_VECS];
        for (int j = 0; j < 8; ++j)
            for (int g = 0; g < LANE_VECS; ++g) acc[j][g] = vzero();
        for (int64_t p = 0; p < pairs; ++p) {
            __m512bh q[LANE_VECS];
#pragma GCC unroll 4
            for (int g = 0; g < LANE_VECS; ++g) q[g] = (__m512bh)_mm512_loadu_si512(v.qt + p * LANE_ROWS + g * W);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)kr[j * LANE_KEY_STRIDE + p]);
#pragma GCC unroll 4
                for (int g = 0; g < LANE_VECS; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], b, q[g]);
            }
        }
        for (int j = 0; j < 8 && j0 + j < k_hi; ++j)
            for (int g = 0; g < LANE_VECS; ++g) {
                vf x = vmul(acc[j][g], vset1(a->scale));
                if (a->softcap > 0.0f) x = vmul(vset1(a->softcap), vtanh(vmul(x, vset1(1.0f / a->softcap))));
                const __m512i jv = _mm512_set1_epi32((int)(j0 + j));
                const vmask seen = _mm512_cmple_epi32_mask(lov[g], jv) & _mm512_cmplt_epi32_mask(jv, hiv[g]);
                x = vselect(seen, x, vset1(-INFINITY));
                mx[g] = vmax(mx[g], x);
                _mm512_storeu_ps(v.sc + (j0 + j) * LANE_ROWS + g * W, x);
            }
    }
    /* Online softmax down the lanes: one rescale per row and block. */
    vf shift[LANE_VECS];
    for (int g = 0; g < LANE_VECS; ++g) {
        const vf m_old = _mm512_loadu_ps(v.m + g * W), m_new = vmax(m_old, mx[g]);
        const vf c = vselect(vless(vset1(-INFINITY), m_old), vexp(vsub(m_old, m_new)), vzero());
        _mm512_storeu_ps(v.m + g * W, m_new);
        /* Only a row whose max moves has a sum and accumulator to rescale (a row without a max yet has
         * neither): the first block of a chunk, all of a short prompt's, skips this. */
        if (_mm512_cmp_ps_mask(m_new, m_old, _CMP_GT_OQ) & vless(vset1(-INFINITY), m_old)) {
            _mm512_storeu_ps(v.l + g * W, vmul(_mm512_loadu_ps(v.l + g * W), c));
            for (int64_t i = 0; i < d; ++i)
                _mm512_storeu_ps(v.acc + i * LANE_ROWS + g * W, vmul(_mm512_loadu_ps(v.acc + i * LANE_ROWS + g * W), c));
        }
        shift[g] = m_new;
    }
    /* Probabilities in key pairs (0 for keys outside [k_lo, k_hi)), rounded to bf16, and the V rows paired. */
    const int64_t p_lo = k_lo / 2, p_hi = (k_hi + 1) / 2;
    /* Word indices of a two-row permute: dword i = word i of the first row, then word i of the second. */
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i first = _mm512_add_epi32(_mm512_mullo_epi32(iota, _mm512_set1_epi32(0x10001)), _mm512_set1_epi32(32 << 16));
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(0x100010));
    vf sum[LANE_VECS];
    for (int g = 0; g < LANE_VECS; ++g) sum[g] = vzero();
    for (int64_t p = p_lo; p < p_hi; ++p) {
        for (int g = 0; g < LANE_VECS; ++g) {
            vf e[2];
            for (int t = 0; t < 2; ++t) {
                const int64_t j = 2 * p + t;
                if (j < k_lo || j >= k_hi) { e[t] = vzero(); continue; }
                const vf x = _mm512_loadu_ps(v.sc + j * LANE_ROWS + g * W);
                e[t] = vselect(vless(vset1(-INFINITY), x), vexp(vsub(x, shift[g])), vzero());
                sum[g] = vadd(sum[g], e[t]);
            }
            const __m512i lo16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[0]));
            const __m512i hi16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[1]));
            _mm512_storeu_si512(v.pp + p * LANE_ROWS + g * W, _mm512_or_si512(lo16, _mm512_slli_epi32(hi16, 16)));
        }
        const uint16_t *va = vc + offsets[2 * p], *vb = vc + offsets[2 * p + 1 < nk ? 2 * p + 1 : 2 * p];
        for (int64_t c = 0; c < cols; c += 32) {
            const int64_t left = d - c;
            const __mmask32 m = mask32_first(left);
            const __m512i x = _mm512_maskz_loadu_epi16(m, va + c), y = _mm512_maskz_loadu_epi16(m, vb + c);
            _mm512_storeu_si512(v.vp + p * cols + c, _mm512_permutex2var_epi16(x, first, y));
            _mm512_storeu_si512(v.vp + p * cols + c + W, _mm512_permutex2var_epi16(x, second, y));
        }
    }
    for (int g = 0; g < LANE_VECS; ++g) _mm512_storeu_ps(v.l + g * W, vadd(_mm512_loadu_ps(v.l + g * W), sum[g]));
    prefetch_ahead(ahead, units - (units - ahead->done) / 2);
    /* Values: eight columns by the lanes' rows, the pairs in registers across the block's keys. */
    for (int64_t i0 = 0; i0 < d; i0 += 8) {
        vf acc[8][LANE_VECS];
        for (int c = 0; c < 8; ++c)
            for (int g = 0; g < LANE_VECS; ++g) acc[c][g] = vzero();
        for (int64_t p = p_lo; p < p_hi; ++p) {
            __m512bh e[LANE_VECS];
#pragma GCC unroll 4
            for (int g = 0; g < LANE_VECS; ++g) e[g] = (__m512bh)_mm512_loadu_si512(v.pp + p * LANE_ROWS + g * W);
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)v.vp[p * cols + i0 + c]);
#pragma GCC unroll 4
                for (int g = 0; g < LANE_VECS; ++g) acc[c][g] = _mm512_dpbf16_ps(acc[c][g], b, e[g]);
            }
        }
        for (int c = 0; c < 8 && i0 + c < d; ++c)
            for (int g = 0; g < LANE_VECS; ++g) {
                float *dst = v.acc + (i0 + c) * LANE_ROWS + g * W;
                _mm512_storeu_ps(dst, vadd(_mm512_loadu_ps(dst), acc[c][g]));
            }
    }
    prefetch_ahead(ahead, units);
}
#endif

/* Cache element offsets of the keys [k0, k0 + n) of the item's sequence and first KV head. */
static inline void block_offsets(const Args *a, const Item *it, int64_t k0, int64_t n, int64_t *offsets) {
    const int64_t bs = a->block_size, slot_stride = a->num_kv_heads * a->head_dim, head_offset = it->kv_head * a->head_dim;
    const int32_t *table = a->block_tables + it->seq * a->max_blocks;
    for (int64_t j = 0, block = k0 / bs, at = k0 % bs; j < n; ++block, at = 0) { /* a run of slots per cache block */
        const int64_t run = min64(bs - at, n - j), base = ((int64_t)table[block] * bs + at) * slot_stride + head_offset;
        for (int64_t i = 0; i < run; ++i) offsets[j + i] = base + i * slot_stride;
        j += run;
    }
}

/* Keys [begin, end) that some row of the item sees. */
static inline void item_keys(const Args *a, const Item *it, int64_t *begin, int64_t *end) {
    int64_t unused;
    key_range(a, it, 0, begin, &unused);
    key_range(a, it, it->num_queries - 1, &unused, end);
}

/* Keys per block for the keys [begin, end): equal blocks (a multiple of W, at most KEY_BLOCK), so that
 * each block's work spreads the next block's requests evenly. From DRAM, 192 keys as 128 + 64 left
 * memory half idle in the first block and the second twice the rows to request in half the time. */
static inline int64_t block_len(int64_t begin, int64_t end) {
    const int64_t n = end - begin, blocks = (n + KEY_BLOCK - 1) / KEY_BLOCK;
    return n <= 0 ? KEY_BLOCK : min64(KEY_BLOCK, ((n + blocks - 1) / blocks + W - 1) / W * W);
}

/* The prefetch plan for the block after [k0, k0 + len) of `it` (whose keys end at `end`): the item's
 * next block, else the first block of the `next` item (or nothing); its key offsets go to `offsets`. */
static inline Ahead plan_ahead(const Args *a, const Item *it, const Item *next, int64_t k0, int64_t len, int64_t end,
                               int64_t esize, int64_t *offsets) {
    Ahead ahead = {offsets, (const char *)a->k_cache, (const char *)a->v_cache, 0, it->num_kv, 0,
                   a->head_dim * esize, esize};
    if (k0 + len < end) {
        ahead.n = min64(len, end - k0 - len);
        block_offsets(a, it, k0 + len, ahead.n, offsets);
    } else if (next != NULL) {
        int64_t next_begin, next_end;
        item_keys(a, next, &next_begin, &next_end);
        ahead.n = max64(0, min64(block_len(next_begin, next_end), next_end - next_begin));
        ahead.heads = next->num_kv;
        if (ahead.n > 0) block_offsets(a, next, next_begin, ahead.n, offsets);
    }
    return ahead;
}

/* The item's rows through every block of keys they see: s->acc, s->m, s->l hold the unnormalized
 * result. While a block is scored the next one's K/V rows are requested: the item's next block, or
 * after its last the first block of `next`, the item this thread runs next (NULL: none). */
static void attend(const Args *a, const Item *it, const Item *next, Scratch *s) {
    int64_t begin, end, buf[2][KEY_BLOCK];
    item_keys(a, it, &begin, &end);
    const int64_t len = block_len(begin, end), esize = a->is_bf16 ? 2 : 4;
    int64_t *cur = buf[0], *next_offsets = buf[1];
    if (begin < end) block_offsets(a, it, begin, min64(len, end - begin), cur);
    for (int64_t k0 = begin; k0 < end; k0 += len) {
        Ahead ahead = plan_ahead(a, it, next, k0, len, end, esize, next_offsets);
        attend_block(a, it, s, k0, min64(len, end - k0), cur, &ahead);
        int64_t *t = cur;
        cur = next_offsets, next_offsets = t;
    }
}

#ifdef NATIVE_BF16_DOT
/* attend for an item of lanes_apply, which reads its queries and (unless it is one of several key
 * partitions) writes its output itself. Apart from attend, not inlined: folding this path into attend
 * made decode, which never takes it, measurably slower. */
__attribute__((noinline)) static void attend_item_lanes(const Args *a, const Item *it, const Item *next, Scratch *s) {
    int64_t begin, end, buf[2][KEY_BLOCK];
    item_keys(a, it, &begin, &end);
    const int64_t len = block_len(begin, end);
    int64_t *cur = buf[0], *next_offsets = buf[1];
    if (begin < end) block_offsets(a, it, begin, min64(len, end - begin), cur);
    lanes_begin(a, it, s);
    for (int64_t k0 = begin; k0 < end; k0 += len) {
        Ahead ahead = plan_ahead(a, it, next, k0, len, end, 2, next_offsets);
        attend_lanes(a, it, s, k0, min64(len, end - k0), cur, &ahead);
        int64_t *t = cur;
        cur = next_offsets, next_offsets = t;
    }
    lanes_end(a, it, s);
}
#endif

/* out[token, head, :] = row * inv, rounded to the output dtype. */
static void store_row(const Args *a, int64_t token, int64_t head, const float *row, float inv) {
    const int64_t d = a->head_dim, offset = (token * a->num_heads + head) * d;
    for (int64_t i = 0; i < d; i += W) {
        const vf x = vmul(vload(row + i, d - i), vset1(inv));
        if (a->is_bf16) vstore_bf16((uint16_t *)a->out + offset + i, x, d - i);
        else vstore((float *)a->out + offset + i, x, d - i);
    }
}

static void finish_item(const Args *a, const Item *it, const Scratch *s, float *partials, int64_t rows_cap) {
    const int64_t d = a->head_dim, rows = item_rows(a, it);
    if (it->partial < 0) {
        RowAt at = first_row(a, it);
        for (int64_t r = 0; r < rows; ++r, next_row(it, &at))
            store_row(a, at.token, at.head, s->acc + r * d, 1.0f / s->l[r]);
        return;
    }
    float *dst = partials + it->partial * rows_cap * (d + 2); /* [rows_cap] m, [rows_cap] l, [rows_cap, d] acc */
    memcpy(dst, s->m, (size_t)rows * sizeof(float));
    memcpy(dst + rows_cap, s->l, (size_t)rows * sizeof(float));
    memcpy(dst + 2 * rows_cap, s->acc, (size_t)(rows * d) * sizeof(float));
}

/* Combines the partitions items[0 .. num_parts) of one (sequence, chunk, head) and writes the output. */
static void merge_parts(const Args *a, const Item *items, int64_t num_parts, const float *partials,
                        int64_t rows_cap, float *row) {
    const int64_t d = a->head_dim, rows = item_rows(a, &items[0]), part_size = rows_cap * (d + 2);
    RowAt at = first_row(a, &items[0]);
    for (int64_t r = 0; r < rows; ++r, next_row(&items[0], &at)) {
        float m = -INFINITY, l = 0.0f;
        for (int64_t p = 0; p < num_parts; ++p) {
            const float *part = partials + items[p].partial * part_size;
            if (part[rows_cap + r] > 0.0f) m = fmaxf(m, part[r]);
        }
        memset(row, 0, (size_t)d * sizeof(float));
        for (int64_t p = 0; p < num_parts; ++p) {
            const float *part = partials + items[p].partial * part_size;
            if (!(part[rows_cap + r] > 0.0f)) continue; /* this partition held no key of the row */
            const float weight = expf(part[r] - m), *acc = part + 2 * rows_cap + r * d;
            l += part[rows_cap + r] * weight;
            for (int64_t i = 0; i < d; ++i) row[i] += acc[i] * weight;
        }
        store_row(a, at.token, at.head, row, 1.0f / l);
    }
}

/* Cache row slot_mapping[t] of each KV cache = new row t (all KV heads). */
static void write_kv(const Args *a, int64_t num_tokens, const void *k_new, int64_t k_stride, const void *v_new,
                     int64_t v_stride, const int64_t *slot_mapping) {
    const int64_t esize = a->is_bf16 ? 2 : 4, row = a->num_kv_heads * a->head_dim;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t] * row * esize;
        memcpy((char *)a->k_cache + slot, (const char *)k_new + t * k_stride * esize, (size_t)(row * esize));
        memcpy((char *)a->v_cache + slot, (const char *)v_new + t * v_stride * esize, (size_t)(row * esize));
    }
}

/* 0 when the step's metadata only points inside the buffers, else 2 (nothing is read then). */
static int check_metadata(const Args *a, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks) {
    if (a->query_starts[0] != 0 || a->query_starts[num_seqs] != num_tokens) return 2;
    if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0 || a->head_dim <= 0 || a->block_size <= 0)
        return 2;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t q_len = a->query_starts[b + 1] - a->query_starts[b], ctx = a->context_lens[b];
        const int64_t used = (ctx + a->block_size - 1) / a->block_size;
        if (q_len < 0 || ctx < q_len || used > a->max_blocks) return 2;
        for (int64_t i = 0; i < used; ++i) {
            const int32_t block = a->block_tables[b * a->max_blocks + i];
            if (block < 0 || block >= num_blocks) return 2;
        }
    }
    return 0;
}

/* Queries per chunk and KV heads per item for a sequence with q_len new tokens: short queries (decode)
 * take up to max_heads KV heads, as many as MAX_ROWS rows allow, so that an item reads each token's
 * K/V row in one piece (the cache interleaves the heads of a token: one head's keys are short pieces
 * a row apart, which one core reads at well under half its sequential bandwidth). */
/* Rows per item of a long query: LANE_ROWS where attend_lanes runs the chunks (bf16 with pair dot
 * products; every thread then has its scratch, or the call fails), else MAX_ROWS. A chunk of more than
 * MAX_ROWS queries (a group of 1) always qualifies for attend_lanes, so attend_block never sees one. */
static inline int64_t chunk_rows(const Args *a) {
#ifdef NATIVE_BF16_DOT
    if (a->is_bf16 && a->head_dim <= 2 * LANE_KEY_STRIDE) return LANE_ROWS;
#endif
    (void)a;
    return MAX_ROWS;
}

static inline void item_shape(const Args *a, int64_t q_len, int64_t max_heads, int64_t *chunk, int64_t *heads) {
    const int64_t group = a->num_heads / a->num_kv_heads, rows = q_len * group;
    if (q_len > 0 && rows <= MAX_ROWS) {
        *chunk = q_len, *heads = max64(1, min64(max_heads, min64(a->num_kv_heads, MAX_ROWS / rows)));
    } else {
        *chunk = max64(1, chunk_rows(a) / group), *heads = 1;
    }
}

/* The step's items in order (sequence, query chunk, KV heads, key partition); fills `items` when not
 * NULL and returns how many there are. A chunk's keys are split every part_len keys. */
static int64_t plan_items(const Args *a, int64_t num_seqs, int64_t part_len, int64_t max_heads, Item *items,
                          int64_t *num_partials) {
    int64_t count = 0, partials = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t q_len = a->query_starts[b + 1] - a->query_starts[b], first_pos = a->context_lens[b] - q_len;
        int64_t chunk, heads;
        item_shape(a, q_len, max_heads, &chunk, &heads);
        for (int64_t first = 0; first < q_len; first += chunk) {
            const int64_t num_queries = min64(chunk, q_len - first);
            const int64_t lo = a->window > 0 ? max64(0, first_pos + first - a->window + 1) : 0;
            const int64_t hi = first_pos + first + num_queries, span = hi - lo;
            const int64_t parts = part_len >= span ? 1 : (span + part_len - 1) / part_len;
            for (int64_t h = 0; h < a->num_kv_heads; h += heads) {
                for (int64_t p = 0; p < parts; ++p, ++count) {
                    if (items == NULL) continue;
                    const Item it = {b, first, num_queries, h, min64(heads, a->num_kv_heads - h), lo + p * part_len,
                                     p + 1 == parts ? hi : lo + (p + 1) * part_len,
                                     parts > 1 ? partials + p : -1, p == 0 && parts > 1 ? parts : 0};
                    items[count] = it;
                }
                if (parts > 1) partials += parts;
            }
        }
    }
    if (num_partials != NULL) *num_partials = partials;
    return count;
}

/* Key partition length: none (INT64_MAX) when the unsplit items give every thread 4; else an even
 * share of all the items' keys, at least MIN_PART. */
static int64_t partition_len(const Args *a, int64_t num_seqs, int num_threads, int64_t max_heads) {
    int64_t items = 0, keys = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t q_len = a->query_starts[b + 1] - a->query_starts[b], ctx = a->context_lens[b];
        int64_t chunk, heads;
        item_shape(a, q_len, max_heads, &chunk, &heads);
        const int64_t per_chunk = (q_len + chunk - 1) / chunk * ((a->num_kv_heads + heads - 1) / heads);
        const int64_t span = a->window > 0 ? min64(ctx, a->window + q_len - 1) : ctx;
        items += per_chunk;
        keys += per_chunk * span;
    }
    const int64_t target = 4 * (int64_t)num_threads;
    if (num_threads <= 1 || items >= target) return INT64_MAX;
    return max64(MIN_PART, (keys / target + W - 1) / W * W);
}

/* KV heads per item (at most) and the key partition length: items of all the heads of a short query
 * unless that leaves threads without two items each (a few short contexts), then one head each. */
static void plan_shape(const Args *a, int64_t num_seqs, int num_threads, int64_t *max_heads, int64_t *part_len) {
    *max_heads = a->num_kv_heads;
    *part_len = partition_len(a, num_seqs, num_threads, *max_heads);
    if (num_threads > 1 && *max_heads > 1
            && plan_items(a, num_seqs, *part_len, *max_heads, NULL, NULL) < 2 * (int64_t)num_threads) {
        *max_heads = 1;
        *part_len = partition_len(a, num_seqs, num_threads, 1);
    }
}

/* Returns 0 on success, 1 when scratch memory cannot be allocated, 2 for metadata that points outside
 * the buffers (block ids >= num_blocks, lengths that do not add up): the output is then incomplete.
 * q: [T, H, D] rows q_stride elements apart; k_cache, v_cache: [num_blocks * block_size, KVH, D];
 * out: [T, H, D] contiguous; block_tables [B, max_blocks], context_lens [B], query_starts [B + 1]
 * int32; q, caches and out share the dtype (float32, or bf16 when is_bf16). With slot_mapping (int64
 * [T]) the step's new K/V rows (k_new, v_new: [T, KVH * D], rows k_stride / v_stride elements apart)
 * are first written to their cache slots, as the layer's index_copy_ would: one call instead of three
 * per layer and step. Slots past the cache are refused (2) before anything is written. */
int paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                    const int32_t *query_starts, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    float scale, float softcap, int64_t window, int is_bf16, int num_threads,
                    const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                    const int64_t *slot_mapping) {
    const Args a = {q, k_cache, v_cache, out, block_tables, context_lens, query_starts, q_stride, max_blocks,
                    num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, is_bf16};
    if (check_metadata(&a, num_seqs, num_tokens, num_blocks)) return 2;
    if (slot_mapping != NULL) {
        for (int64_t t = 0; t < num_tokens; ++t)
            if (slot_mapping[t] < 0 || slot_mapping[t] >= num_blocks * block_size) return 2;
        write_kv(&a, num_tokens, k_new, k_stride, v_new, v_stride, slot_mapping);
    }
    const int64_t d = head_dim;
    int64_t max_heads, part_len;
    plan_shape(&a, num_seqs, num_threads, &max_heads, &part_len);
    int64_t rows_cap = max64(1, MAX_ROWS / (num_heads / num_kv_heads)) * (num_heads / num_kv_heads);
    int64_t num_partials = 0;
    const int64_t num_items = plan_items(&a, num_seqs, part_len, max_heads, NULL, NULL);
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    float *partials = NULL;
    if (items != NULL) plan_items(&a, num_seqs, part_len, max_heads, items, &num_partials);
    int lanes = 0; /* whether an item runs on attend_lanes */
    for (int64_t i = 0; items != NULL && i < num_items; ++i) { /* chunks of chunk_rows rows may hold more */
        rows_cap = max64(rows_cap, item_rows(&a, &items[i]));
#ifdef NATIVE_BF16_DOT
        lanes |= lanes_item(&a, &items[i]);
#endif
    }
    (void)lanes;
    if (num_partials > 0) partials = (float *)malloc(sizeof(float) * (size_t)(num_partials * rows_cap * (d + 2)));
    int failed = items == NULL || (num_partials > 0 && partials == NULL);
    int64_t next_item = 0;
#pragma omp parallel num_threads(num_threads) if (!failed && num_items > 1)
    {
        Scratch s = {0};
        float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * rows_cap * d + 2 * rows_cap + W * d + rows_cap * KEY_BLOCK +
                                                              2 * ((d + 1) / 2 * W) + rows_cap * KEY_BLOCK / 2));
        s.q_bf16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(rows_cap * q_stride_bf16(d)));
        s.row_range = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * rows_cap));
        int quads_ok = 1;
#ifdef NATIVE_BF16_DOT
        /* qk_bf16_quads' rows: a small GQA group's. Each row's quads take 8 * d bytes; beyond d = 128 an
         * item's quads crowd its accumulators out of L1 (slower at d = 256 than without them). */
        if (is_bf16 && num_heads / num_kv_heads <= 4 && d <= 128)
            quads_ok = (s.qt = aligned_alloc(64, (size_t)(rows_cap * quad_stride(d)) * sizeof(__m512i))) != NULL;
        if (lanes && quads_ok) /* attend_lanes' working set (prefill chunks) */
            quads_ok = (s.lanes = aligned_alloc(64, (size_t)lanes_floats(d) * sizeof(float))) != NULL;
#endif
        const int ok = !failed && buf != NULL && s.q_bf16 != NULL && s.row_range != NULL && quads_ok;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            s.q = buf, s.acc = buf + rows_cap * d, s.m = s.acc + rows_cap * d, s.l = s.m + rows_cap;
            s.k_tile = s.l + rows_cap, s.p = s.k_tile + W * d;
            s.kt = (uint32_t *)(s.p + rows_cap * KEY_BLOCK);
            s.pb = s.kt + 2 * ((d + 1) / 2 * W);
        }
        /* Dynamic schedule, one item claimed ahead: the thread knows the item it runs next and requests
         * that item's first keys while it finishes the current one. */
        for (int64_t i = ok ? __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED) : num_items; i < num_items;) {
            const int64_t next = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
#ifdef NATIVE_BF16_DOT
            if (lanes_apply(&a, &s, &items[i])) {
                attend_item_lanes(&a, &items[i], next < num_items ? &items[next] : NULL, &s);
                if (items[i].partial >= 0) finish_item(&a, &items[i], &s, partials, rows_cap);
                i = next;
                continue;
            }
#endif
            load_queries(&a, &items[i], &s);
            attend(&a, &items[i], next < num_items ? &items[next] : NULL, &s);
            finish_item(&a, &items[i], &s, partials, rows_cap);
            i = next;
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i)
            if (ok && items[i].num_parts > 0) merge_parts(&a, &items[i], items[i].num_parts, partials, rows_cap, s.acc);
        free(buf);
        free(s.q_bf16);
        free(s.row_range);
        free(s.qt);
        free(s.lanes);
    }
    free(items);
    free(partials);
    return failed ? 1 : 0;
}
