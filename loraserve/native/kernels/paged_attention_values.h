/* A block's softmax and values: the online softmax per row, the probability-weighted V rows summed into
 * the accumulators (float32 here, pair dot products in _pairs.h), and a block attended by an item of
 * one or of several KV heads.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_VALUES_H
#define PAGED_ATTENTION_VALUES_H

/* Rows r < nr of acc (d floats apart) += sum over keys j0 <= j < j1 of p[r * KEY_BLOCK + j] * v[j]:
 * 2W columns at a time, held in registers across all the keys, so each V row is loaded (and widened,
 * even and odd bf16 elements apart with one instruction each; 8-bit elements decoded) once per nr
 * rows. Callers pass constants for nr and the cache format kv so the unused accumulators and the other
 * formats' loads vanish; an 8-bit row's scale is already in p. */
__attribute__((always_inline)) static inline void pv_rows(float *acc, int64_t d, const float *p, int nr,
                                                          const void *v_cache, const int64_t *offsets,
                                                          int64_t j0, int64_t j1, int kv) {
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
                if (kv == KV_BF16) {
                    vload_pair_bf16((const uint16_t *)v_cache + offsets[j] + i + c * W, n - c * W, &x[c], &x[c + 1]);
                } else if (kv == KV_F32) {
                    const float *v = (const float *)v_cache + offsets[j] + i + c * W;
                    x[c] = vload(v, n - c * W);
                    x[c + 1] = vload(v + W, n - (c + 1) * W);
                } else {
                    vload_kv8_pair((const uint8_t *)v_cache + offsets[j] + i + c * W, n - c * W, kv, &x[c], &x[c + 1]);
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
                if (kv == KV_BF16) vinterleave(&sum[r][c], &sum[r][c + 1]);
                float *row = acc + r * d + i + c * W;
                vstore(row, vadd(vload(row, n - c * W), sum[r][c]), n - c * W);
                vstore(row + W, vadd(vload(row + W, n - (c + 1) * W), sum[r][c + 1]), n - (c + 1) * W);
            }
    }
}

#define PV_KEYS 32 /* keys per slice of a block's values: between slices, the next block is requested */

/* pv_rows (or pairs.h's pv_rows_dot) over `rows` rows (probabilities p, KEY_BLOCK apart; pb: p paired
 * by pair_for_dots, at the scales ps for int16) for the keys [k0, min(k0 + PV_KEYS, nk)), four rows at
 * a time; each pass reads only the keys its rows see ([lo, hi) per row). */
static void pv_slice(const Args *a, float *acc, const float *p, int64_t rows, const int64_t *lo, const int64_t *hi,
                     int64_t nk, const int64_t *offsets, int64_t k0, const uint32_t *pb, const float *ps) {
    const int64_t d = a->head_dim;
#ifndef NATIVE_BF16_DOT
    (void)pb, (void)nk;
#endif
#ifndef NATIVE_I16_DOT
    (void)ps;
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
#define PV_BF16(NR) \
        if (a->bf16_dot) pv_rows_dot(ar, d, pb + r * (KEY_BLOCK / 2), NR, a->v_cache, offsets, nk, j0, j1, 0, NULL, NULL); \
        else pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV_BF16)
#define PV_FP8(NR, KV) \
        if (a->fp8_tab != NULL) \
            pv_rows_dot(ar, d, pb + r * (KEY_BLOCK / 2), NR, a->v_cache, offsets, nk, j0, j1, 0, NULL, (const __m512i *)a->fp8_tab); \
        else pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV)
#else
#define PV_BF16(NR) pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV_BF16)
#define PV_FP8(NR, KV) pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV)
#endif
#ifdef NATIVE_I16_DOT
#define PV_INT8(NR) \
        if (a->i16_dot) pv_rows_dot(ar, d, pb + r * (KEY_BLOCK / 2), NR, a->v_cache, offsets, nk, j0, j1, 1, ps + r, NULL); \
        else pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV_INT8)
#else
#define PV_INT8(NR) pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV_INT8)
#endif
#define PV_KIND(NR, KV) pv_rows(ar, d, pr, NR, a->v_cache, offsets, j0, j1, KV)
#define PV_CASE(NR) \
        switch (a->kv) { \
        case KV_BF16: PV_BF16(NR); break; \
        case KV_E4M3: PV_FP8(NR, KV_E4M3); break; \
        case KV_E5M2: PV_FP8(NR, KV_E5M2); break; \
        case KV_INT8: PV_INT8(NR); break; \
        default: PV_KIND(NR, KV_F32); \
        } \
        break;
        switch (nr) {
        case 4: PV_CASE(4)
        case 3: PV_CASE(3)
        case 2: PV_CASE(2)
        default: PV_CASE(1)
        }
#undef PV_CASE
#undef PV_KIND
#undef PV_INT8
#undef PV_FP8
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

/* p rows (n lanes each, KEY_BLOCK apart) times each key's V scale: an 8-bit V row's scale goes into its
 * probability (after the softmax, whose sum it must not change), once per row and key. */
static void scale_probabilities(float *p, int64_t rows, int64_t n, const float *vs) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; j += W) vstore(p + r * KEY_BLOCK + j, vmul(vload(p + r * KEY_BLOCK + j, W), vload(vs + j, W)), W);
}

/* The views of KV head h of the item (rows rows each): its K/V (`offsets` point at the item's first
 * head) and its rows of the scratch. */
static inline void head_views(const Args *a, const Scratch *s, int64_t h, int64_t rows, Args *ah, Scratch *sh) {
    const int64_t d = a->head_dim, esize = kv_esize(a->kv);
    *ah = *a, *sh = *s;
    ah->k_cache = (const char *)a->k_cache + h * d * esize, ah->v_cache = (const char *)a->v_cache + h * d * esize;
    sh->q += h * rows * d, sh->q_bf16 += h * rows * q_stride_bf16(d), sh->acc += h * rows * d;
    if (s->ks != NULL) sh->ks += h * KEY_BLOCK, sh->vs += h * KEY_BLOCK;
    sh->m += h * rows, sh->l += h * rows, sh->p += h * rows * KEY_BLOCK, sh->pb += h * rows * (KEY_BLOCK / 2);
    if (s->ps != NULL) sh->ps += h * rows;
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
    if (s->vs != NULL) scale_probabilities(s->p, rows, n, s->vs);
    pair_for_dots(a, s->p, rows, n, s->pb, s->ps);
    for (int64_t j = 0; j < nk; j += PV_KEYS) {
        prefetch_ahead(ahead, (units - ahead->done + slices - 1) / slices);
        pv_slice(a, s->acc, s->p, rows, row_lo, row_hi, nk, offsets, j, s->pb, s->ps);
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
    for (int64_t h = 0; h < heads && s->vs != NULL; ++h) scale_probabilities(sh[h].p, rows, n, sh[h].vs);
    pair_for_dots(a, s->p, heads * rows, n, s->pb, s->ps);
    const int64_t slices = (nk + PV_KEYS - 1) / PV_KEYS;
    for (int64_t j = 0, i = 0; j < nk; j += PV_KEYS, ++i) {
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t calls = (slices - i) * heads - h;
            prefetch_ahead(ahead, (ahead->n * ahead->heads - ahead->done + calls - 1) / calls);
            pv_slice(&ah[h], sh[h].acc, sh[h].p, rows, row_lo, row_hi, nk, offsets, j, sh[h].pb, sh[h].ps);
        }
    }
    prefetch_ahead(ahead, ahead->n * ahead->heads);
}

/* s->ks, s->vs for the item's heads and the keys [k0, k0 + nk) (8-bit caches): each key's scale (its
 * block's, int8; the tensor's, fp8) times the format's decode factor, 0 past nk to the tile's end. */
static void block_scales(const Args *a, const Item *it, int64_t k0, int64_t nk, Scratch *s) {
    const float fk = kv_decode_factor(a->kv) * a->k_scale, fv = kv_decode_factor(a->kv) * a->v_scale;
    const int64_t bs = a->block_size, n = (nk + W - 1) / W * W;
    const int32_t *table = a->block_tables + it->seq * a->max_blocks;
    for (int64_t h = 0; h < it->num_kv; ++h) {
        float *ks = s->ks + h * KEY_BLOCK, *vs = s->vs + h * KEY_BLOCK;
        for (int64_t j = 0, block = k0 / bs, at = k0 % bs; j < nk; ++block, at = 0) { /* a run of keys per cache block */
            const int64_t run = min64(bs - at, nk - j), at_scale = (int64_t)table[block] * a->num_kv_heads + it->kv_head + h;
            const float k = a->k_scales != NULL ? a->k_scales[at_scale] * fk : fk;
            const float v = a->v_scales != NULL ? a->v_scales[at_scale] * fv : fv;
            for (int64_t i = 0; i < run; ++i) ks[j + i] = k, vs[j + i] = v;
            j += run;
        }
        for (int64_t j = nk; j < n; ++j) ks[j] = vs[j] = 0.0f;
    }
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
    if (s->ks != NULL) block_scales(a, it, k0, nk, s);
    if (it->num_kv == 1) attend_block_head(a, s, it, rows, nk, offsets, lo, hi, row_lo, row_hi, ahead);
    else attend_block_heads(a, s, it, rows, nk, offsets, lo, hi, row_lo, row_hi, ahead);
}

#endif /* PAGED_ATTENTION_VALUES_H */
