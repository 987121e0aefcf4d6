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
 * over tiles of W keys), and the output is rounded to the input dtype.
 *
 * Why a kernel: the torch path copies every sequence's whole context out of the cache in every layer
 * and builds a [B, max_q, max_ctx] mask; here each K/V row is read once from where it lies and shared
 * by the query heads of its group (GQA), and requested two tiles ahead (blocks lie anywhere in the
 * cache, so no hardware prefetcher follows them). Work items are (sequence, query chunk, KV head, key
 * partition) over OpenMP threads (torch's libgomp: the library is loaded after torch); a long context
 * with too few items for the threads is split into key partitions that a second pass merges.
 * The vector width W is the build's: 16 (AVX-512; bf16 pair dot products with AVX512-BF16),
 * 8 (AVX2 + FMA) or 1 (portable C); -march=native makes that the runtime dispatch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define W 16
typedef __m512 vf;
typedef __mmask16 vmask;
/* Lanes a <= j < b. */
static inline vmask vrange(int64_t a, int64_t b) { return (vmask)(((1u << b) - 1u) & ~((1u << a) - 1u)); }
static inline vf vload(const float *p, int64_t n) {
    return n >= W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(vrange(0, n), p);
}
static inline vf vload_bf16(const uint16_t *p, int64_t n) {
    const __m256i h = n >= W ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(vrange(0, n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vstore(float *p, vf x, int64_t n) {
    if (n >= W) _mm512_storeu_ps(p, x); else _mm512_mask_storeu_ps(p, vrange(0, n), x);
}
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfma _mm512_fmadd_ps
#define vhsum _mm512_reduce_add_ps
#define vhmax _mm512_reduce_max_ps
static inline vf vselect(vmask m, vf x, vf other) { return _mm512_mask_blend_ps(m, other, x); }
static inline vmask vless(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
#define vabs _mm512_abs_ps
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf y, vf n) { return _mm512_scalef_ps(y, n); } /* y * 2^n */
/* Lane j = the sum of a[j]'s lanes: a transposing tree, ~3 instructions per key instead of ~8. */
static inline vf vsum_keys(const vf *a) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        c[i] = vadd(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)
        d[i] = vadd(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                    _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return vadd(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
#if defined(__AVX512BF16__)
#define NATIVE_BF16_DOT 1
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
typedef __m256i vmask;
static inline vmask vrange(int64_t a, int64_t b) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_si256(_mm256_cmpgt_epi32(iota, _mm256_set1_epi32((int)a - 1)),
                            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)b), iota));
}
static inline vf vload(const float *p, int64_t n) {
    return n >= W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, vrange(0, n));
}
static inline vf vload_bf16(const uint16_t *p, int64_t n) {
    uint16_t tail[W] = {0};
    if (n < W) memcpy(tail, p, (size_t)n * sizeof(uint16_t));
    const __m128i h = _mm_loadu_si128((const __m128i *)(n >= W ? p : tail));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float *p, vf x, int64_t n) {
    if (n >= W) _mm256_storeu_ps(p, x); else _mm256_maskstore_ps(p, vrange(0, n), x);
}
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfma _mm256_fmadd_ps
static inline float vhsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vselect(vmask m, vf x, vf other) { return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(m)); }
static inline vmask vless(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf y, vf n) { /* n in [-126, 127] (vexp clamps) */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return vmul(y, _mm256_castsi256_ps(e));
}
static inline vf vsum_keys(const vf *a) {
    vf b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = vadd(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        c[i] = vadd(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return vadd(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

#else /* portable C: one key per tile */
#define W 1
typedef float vf;
typedef int vmask;
static inline vmask vrange(int64_t a, int64_t b) { return a <= 0 && 0 < b; }
static inline vf vload(const float *p, int64_t n) { return n > 0 ? *p : 0.0f; }
static inline vf vload_bf16(const uint16_t *p, int64_t n) {
    const uint32_t u = n > 0 ? (uint32_t)*p << 16 : 0u;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline void vstore(float *p, vf x, int64_t n) { if (n > 0) *p = x; }
static inline vf vset1(float x) { return x; }
static inline vf vzero(void) { return 0.0f; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vfma(vf a, vf b, vf c) { return fmaf(a, b, c); }
#define vmax fmaxf
#define vmin fminf
static inline float vhsum(vf x) { return x; }
static inline float vhmax(vf x) { return x; }
static inline vf vselect(vmask m, vf x, vf other) { return m ? x : other; }
static inline vmask vless(vf a, vf b) { return a < b; }
#define vabs fabsf
static inline vf vround(vf x) { return nearbyintf(x); }
static inline vf vpow2(vf y, vf n) { return ldexpf(y, (int)n); }
static inline vf vsum_keys(const vf *a) { return a[0]; }
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#define MAX_ROWS 32   /* query rows (queries x heads of a group) per work item: their accumulators stay in L1 */
#define MIN_PART 256  /* shortest key partition worth a merge */

/* e^x in float32 (Cephes' polynomial, ~1 ulp), inputs clamped to the normal range. */
static inline vf vexp(vf x) {
    x = vmax(vmin(x, vset1(88.0f)), vset1(-87.3f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf y = vset1(1.9875691500e-4f);
    y = vfma(y, r, vset1(1.3981999507e-3f));
    y = vfma(y, r, vset1(8.3334519073e-3f));
    y = vfma(y, r, vset1(4.1665795894e-2f));
    y = vfma(y, r, vset1(1.6666665459e-1f));
    y = vfma(y, r, vset1(5.0000001201e-1f));
    return vpow2(vfma(y, vmul(r, r), vadd(r, vset1(1.0f))), n);
}

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

static inline uint16_t to_bf16(float x) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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
        const __mmask32 m = d - i >= 32 ? 0xffffffffu : (1u << (d - i)) - 1u;
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + i);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + i));
    }
    return vsum_keys(acc);
}
#endif

/* Rows r < nr of acc (d floats apart) += sum_j p[r * W + j] * v[j]: each slice of V is loaded (and
 * widened from bf16) once for all the rows, and each slice of acc stays in a register across the tile.
 * Callers pass a constant nr so the unused accumulators vanish. */
static inline void pv_rows(float *acc, int64_t d, const float *p, int nr, const float *const *v,
                           const uint16_t *const *v_bf16, int is_bf16) {
    for (int64_t i = 0; i < d; i += W) {
        const int64_t n = d - i;
        vf a0 = vload(acc + i, n), a1 = vzero(), a2 = vzero(), a3 = vzero();
        if (nr > 1) a1 = vload(acc + d + i, n);
        if (nr > 2) a2 = vload(acc + 2 * d + i, n);
        if (nr > 3) a3 = vload(acc + 3 * d + i, n);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {
            const vf x = is_bf16 ? vload_bf16(v_bf16[j] + i, n) : vload(v[j] + i, n);
            a0 = vfma(vset1(p[j]), x, a0);
            if (nr > 1) a1 = vfma(vset1(p[W + j]), x, a1);
            if (nr > 2) a2 = vfma(vset1(p[2 * W + j]), x, a2);
            if (nr > 3) a3 = vfma(vset1(p[3 * W + j]), x, a3);
        }
        vstore(acc + i, a0, n);
        if (nr > 1) vstore(acc + d + i, a1, n);
        if (nr > 2) vstore(acc + 2 * d + i, a2, n);
        if (nr > 3) vstore(acc + 3 * d + i, a3, n);
    }
}

/* pv_rows over `rows` rows, four at a time. */
static void pv_group(float *acc, int64_t d, const float *p, int64_t rows, const float *const *v,
                     const uint16_t *const *v_bf16, int is_bf16) {
    for (int64_t r = 0; r < rows; r += 4) {
        float *a = acc + r * d;
        const float *pr = p + r * W;
        switch (min64(4, rows - r)) {
        case 4: pv_rows(a, d, pr, 4, v, v_bf16, is_bf16); break;
        case 3: pv_rows(a, d, pr, 3, v, v_bf16, is_bf16); break;
        case 2: pv_rows(a, d, pr, 2, v, v_bf16, is_bf16); break;
        default: pv_rows(a, d, pr, 1, v, v_bf16, is_bf16); break;
        }
    }
}

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

/* Rows [0, num_queries * group) of one item: query qi of the chunk with the group's head g is row qi*group+g. */
typedef struct {
    int64_t seq, first, num_queries, kv_head, key_begin, key_end;
    int64_t partial;   /* index of its partial result, or -1: the item writes the output itself */
    int64_t num_parts; /* on the first partition of a split (sequence, chunk, head): how many follow */
} Item;

typedef struct {
    float *q, *acc, *m, *l, *k_tile, *p; /* p: one query's group of probability rows, [group, W] */
    uint16_t *q_bf16;
} Scratch;

/* Keys [lo, hi) that query qi of the item sees, within the item's partition. */
static inline void key_range(const Args *a, const Item *it, int64_t qi, int64_t *lo, int64_t *hi) {
    const int64_t b = it->seq, q_len = a->query_starts[b + 1] - a->query_starts[b];
    const int64_t pos = a->context_lens[b] - q_len + it->first + qi;
    *lo = max64(it->key_begin, a->window > 0 ? pos - a->window + 1 : 0);
    *hi = min64(it->key_end, pos + 1);
}

static void load_queries(const Args *a, const Item *it, Scratch *s) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t token0 = a->query_starts[it->seq] + it->first;
    for (int64_t r = 0; r < it->num_queries * group; ++r) {
        const int64_t offset = (token0 + r / group) * a->q_stride + (it->kv_head * group + r % group) * d;
        if (a->is_bf16) {
            const uint16_t *src = (const uint16_t *)a->q + offset;
            memcpy(s->q_bf16 + r * d, src, (size_t)d * sizeof(uint16_t));
            for (int64_t i = 0; i < d; i += W) vstore(s->q + r * d + i, vload_bf16(src + i, d - i), d - i);
        } else {
            memcpy(s->q + r * d, (const float *)a->q + offset, (size_t)d * sizeof(float));
        }
        memset(s->acc + r * d, 0, (size_t)d * sizeof(float));
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
}

/* Online softmax for one row over one tile (scores s, lanes `live` visible): s becomes the tile's
 * probabilities in p; returns the factor the row's accumulator must be rescaled by. */
static inline float softmax_step(const Args *a, vf s, vmask live, float *m, float *l, float *p) {
    s = vmul(s, vset1(a->scale));
    if (a->softcap > 0.0f) s = vmul(vset1(a->softcap), vtanh(vmul(s, vset1(1.0f / a->softcap))));
    s = vselect(live, s, vset1(-INFINITY));
    const float tile_max = vhmax(s), m_new = tile_max > *m ? tile_max : *m;
    const float correction = m_new > *m ? expf(*m - m_new) : 1.0f;
    const vf probs = vselect(live, vexp(vsub(s, vset1(m_new))), vzero());
    *l = *l * correction + vhsum(probs);
    *m = m_new;
    vstore(p, probs, W);
    return correction;
}

/* Lane j = the scores of row r against the tile's keys (bf16 keys read in place where the CPU has
 * bf16 dot products, else from their float32 copy). */
static inline vf row_scores(const Args *a, const Scratch *s, int64_t r, const uint16_t *const *k_bf16,
                            const float *const *k_rows) {
#ifdef NATIVE_BF16_DOT
    if (a->is_bf16) return qk_bf16(s->q_bf16 + r * a->head_dim, k_bf16, a->head_dim);
#else
    (void)k_bf16;
#endif
    return qk_f32(s->q + r * a->head_dim, k_rows, a->head_dim);
}

/* Rows of the item against the W keys from k0 (n of them real) at the given cache element offsets. */
static void attend_tile(const Args *a, const Item *it, Scratch *s, int64_t k0, int64_t n, const int64_t *offsets) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const float *k_rows[W] = {0}, *v_rows[W] = {0};
    const uint16_t *k_bf16[W] = {0}, *v_bf16[W] = {0};
    for (int j = 0; j < W; ++j) {
        if (a->is_bf16) {
            k_bf16[j] = (const uint16_t *)a->k_cache + offsets[j];
            v_bf16[j] = (const uint16_t *)a->v_cache + offsets[j];
        } else {
            k_rows[j] = (const float *)a->k_cache + offsets[j];
            v_rows[j] = (const float *)a->v_cache + offsets[j];
        }
    }
#ifndef NATIVE_BF16_DOT
    if (a->is_bf16) rows_to_f32(s->k_tile, k_bf16, k_rows, d); /* once per tile, for every row of the item */
#endif
    for (int64_t qi = 0; qi < it->num_queries; ++qi) {
        int64_t lo, hi;
        key_range(a, it, qi, &lo, &hi);
        lo = max64(lo, k0) - k0;
        hi = min64(hi, k0 + n) - k0;
        if (lo >= hi) continue;
        const vmask live = vrange(lo, hi);
        float *acc = s->acc + qi * group * d;
        for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            const float c = softmax_step(a, row_scores(a, s, r, k_bf16, k_rows), live, &s->m[r], &s->l[r], s->p + g * W);
            if (c != 1.0f)
                for (int64_t i = 0; i < d; ++i) acc[g * d + i] *= c;
        }
        pv_group(acc, d, s->p, group, v_rows, v_bf16, a->is_bf16);
    }
}

/* Cache element offsets of the W keys from k0 (n of them real) for one KV head; lanes past the last
 * key repeat the first one (finite values whose probability is 0). */
static inline void tile_offsets(const Args *a, const int32_t *table, int64_t head_offset, int64_t k0, int64_t n,
                                int64_t *offsets) {
    const int64_t bs = a->block_size, slot_stride = a->num_kv_heads * a->head_dim;
    for (int64_t j = 0, block = k0 / bs, at = k0 % bs; j < W; ++j) {
        offsets[j] = j < n ? ((int64_t)table[block] * bs + at) * slot_stride + head_offset : offsets[0];
        if (++at == bs) at = 0, ++block;
    }
}

/* Asks for the tile's K and V rows ahead of use: blocks lie anywhere, so no hardware prefetcher
 * follows them, and without this the kernel waits on memory latency, not bandwidth. always_inline:
 * GCC deems a function of prefetches alone free of effects and drops calls to it. */
__attribute__((always_inline)) static inline void prefetch_tile(const Args *a, const int64_t *offsets,
                                                                int64_t n) {
    const int64_t esize = a->is_bf16 ? 2 : 4, bytes = a->head_dim * esize;
    for (int64_t j = 0; j < n; ++j) {
        const char *k = (const char *)a->k_cache + offsets[j] * esize, *v = (const char *)a->v_cache + offsets[j] * esize;
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 3);
            __builtin_prefetch(v + b, 0, 3);
        }
    }
}

#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2 /* tiles ahead (-DPREFETCH_TILES=n to measure others) */
#endif

/* The item's rows through every tile of W keys they see: s->acc, s->m, s->l hold the unnormalized result. */
static void attend(const Args *a, const Item *it, Scratch *s) {
    const int64_t head_offset = it->kv_head * a->head_dim;
    const int32_t *table = a->block_tables + it->seq * a->max_blocks;
    int64_t begin, end, unused, offsets[W];
    key_range(a, it, 0, &begin, &unused);
    key_range(a, it, it->num_queries - 1, &unused, &end);
    for (int64_t k0 = begin; k0 < end && k0 < begin + PREFETCH_TILES * W; k0 += W) {
        tile_offsets(a, table, head_offset, k0, min64(W, end - k0), offsets);
        prefetch_tile(a, offsets, min64(W, end - k0));
    }
    for (int64_t k0 = begin; k0 < end; k0 += W) {
        const int64_t ahead = k0 + PREFETCH_TILES * W;
        if (ahead < end) {
            tile_offsets(a, table, head_offset, ahead, min64(W, end - ahead), offsets);
            prefetch_tile(a, offsets, min64(W, end - ahead));
        }
        tile_offsets(a, table, head_offset, k0, min64(W, end - k0), offsets);
        attend_tile(a, it, s, k0, min64(W, end - k0), offsets);
    }
}

/* out[token, head, :] = row * inv, rounded to the output dtype. */
static void store_row(const Args *a, int64_t token, int64_t head, const float *row, float inv) {
    const int64_t d = a->head_dim, offset = (token * a->num_heads + head) * d;
    if (a->is_bf16) {
        uint16_t *dst = (uint16_t *)a->out + offset;
        for (int64_t i = 0; i < d; ++i) dst[i] = to_bf16(row[i] * inv);
    } else {
        float *dst = (float *)a->out + offset;
        for (int64_t i = 0; i < d; ++i) dst[i] = row[i] * inv;
    }
}

static void finish_item(const Args *a, const Item *it, const Scratch *s, float *partials, int64_t rows_cap) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads, rows = it->num_queries * group;
    if (it->partial < 0) {
        const int64_t token0 = a->query_starts[it->seq] + it->first;
        for (int64_t r = 0; r < rows; ++r)
            store_row(a, token0 + r / group, it->kv_head * group + r % group, s->acc + r * d, 1.0f / s->l[r]);
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
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t rows = items[0].num_queries * group, part_size = rows_cap * (d + 2);
    const int64_t token0 = a->query_starts[items[0].seq] + items[0].first;
    for (int64_t r = 0; r < rows; ++r) {
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
        store_row(a, token0 + r / group, items[0].kv_head * group + r % group, row, 1.0f / l);
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

/* The step's items in order (sequence, query chunk, KV head, key partition); fills `items` when not
 * NULL and returns how many there are. A chunk's keys are split every part_len keys. */
static int64_t plan_items(const Args *a, int64_t num_seqs, int64_t part_len, Item *items, int64_t *num_partials) {
    const int64_t group = a->num_heads / a->num_kv_heads, chunk = max64(1, MAX_ROWS / group);
    int64_t count = 0, partials = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t q_len = a->query_starts[b + 1] - a->query_starts[b], first_pos = a->context_lens[b] - q_len;
        for (int64_t first = 0; first < q_len; first += chunk) {
            const int64_t num_queries = min64(chunk, q_len - first);
            const int64_t lo = a->window > 0 ? max64(0, first_pos + first - a->window + 1) : 0;
            const int64_t hi = first_pos + first + num_queries, span = hi - lo;
            const int64_t parts = part_len >= span ? 1 : (span + part_len - 1) / part_len;
            for (int64_t h = 0; h < a->num_kv_heads; ++h) {
                for (int64_t p = 0; p < parts; ++p, ++count) {
                    if (items == NULL) continue;
                    const Item it = {b, first, num_queries, h, lo + p * part_len,
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
 * share of all the step's keys, at least MIN_PART. */
static int64_t partition_len(const Args *a, int64_t num_seqs, int num_threads) {
    const int64_t group = a->num_heads / a->num_kv_heads, chunk = max64(1, MAX_ROWS / group);
    int64_t items = 0, keys = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t q_len = a->query_starts[b + 1] - a->query_starts[b], ctx = a->context_lens[b];
        const int64_t chunks = (q_len + chunk - 1) / chunk;
        const int64_t span = a->window > 0 ? min64(ctx, a->window + q_len - 1) : ctx;
        items += chunks * a->num_kv_heads;
        keys += chunks * a->num_kv_heads * span;
    }
    const int64_t target = 4 * (int64_t)num_threads;
    if (num_threads <= 1 || items >= target) return INT64_MAX;
    return max64(MIN_PART, (keys / target + W - 1) / W * W);
}

/* Returns 0 on success, 1 when scratch memory cannot be allocated, 2 for metadata that points outside
 * the buffers (block ids >= num_blocks, lengths that do not add up): the output is then incomplete.
 * q: [T, H, D] rows q_stride elements apart; k_cache, v_cache: [num_blocks * block_size, KVH, D];
 * out: [T, H, D] contiguous; block_tables [B, max_blocks], context_lens [B], query_starts [B + 1]
 * int32; q, caches and out share the dtype (float32, or bf16 when is_bf16). */
int paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                    const int32_t *query_starts, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    float scale, float softcap, int64_t window, int is_bf16, int num_threads) {
    const Args a = {q, k_cache, v_cache, out, block_tables, context_lens, query_starts, q_stride, max_blocks,
                    num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, is_bf16};
    if (check_metadata(&a, num_seqs, num_tokens, num_blocks)) return 2;
    const int64_t part_len = partition_len(&a, num_seqs, num_threads), d = head_dim;
    const int64_t rows_cap = max64(1, MAX_ROWS / (num_heads / num_kv_heads)) * (num_heads / num_kv_heads);
    int64_t num_partials = 0;
    const int64_t num_items = plan_items(&a, num_seqs, part_len, NULL, NULL);
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    float *partials = NULL;
    if (items != NULL) plan_items(&a, num_seqs, part_len, items, &num_partials);
    if (num_partials > 0) partials = (float *)malloc(sizeof(float) * (size_t)(num_partials * rows_cap * (d + 2)));
    int failed = items == NULL || (num_partials > 0 && partials == NULL);
#pragma omp parallel num_threads(num_threads) if (!failed && num_items > 1)
    {
        Scratch s = {0};
        float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * rows_cap * d + 2 * rows_cap + W * d + rows_cap * W));
        s.q_bf16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(rows_cap * d));
        const int ok = !failed && buf != NULL && s.q_bf16 != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            s.q = buf, s.acc = buf + rows_cap * d, s.m = s.acc + rows_cap * d, s.l = s.m + rows_cap;
            s.k_tile = s.l + rows_cap, s.p = s.k_tile + W * d;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            if (!ok) continue;
            load_queries(&a, &items[i], &s);
            attend(&a, &items[i], &s);
            finish_item(&a, &items[i], &s, partials, rows_cap);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i)
            if (ok && items[i].num_parts > 0) merge_parts(&a, &items[i], items[i].num_parts, partials, rows_cap, s.acc);
        free(buf);
        free(s.q_bf16);
    }
    free(items);
    free(partials);
    return failed ? 1 : 0;
}
