/* Prefill chunks with their rows in vector lanes (attend_lanes, bf16 with pair dot products): scores,
 * softmax and value sums across rows, for chunks of several queries of one KV head.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_LANES_H
#define PAGED_ATTENTION_LANES_H

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
    return a->bf16_dot && it->num_kv == 1 && it->num_queries > 1 && rows >= W / 2 && rows <= LANE_ROWS &&
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

#endif /* PAGED_ATTENTION_LANES_H */
