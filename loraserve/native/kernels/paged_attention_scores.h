/* A block's scores: each row's q.k against the block's keys (row by row, or tiles transposed once for
 * many rows), scaled, softcapped and masked to the keys the row sees.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_SCORES_H
#define PAGED_ATTENTION_SCORES_H

/* Lane j = the scores of row r against the tile's keys (bf16 keys read in place where the CPU has
 * bf16 dot products, else from their float32 copy). */
static inline vf row_scores(const Args *a, const Scratch *s, int64_t r, const uint16_t *const *k_bf16,
                            const float *const *k_rows) {
#ifdef NATIVE_BF16_DOT
    if (a->bf16_dot) return qk_bf16(s->q_bf16 + r * q_stride_bf16(a->head_dim), k_bf16, a->head_dim);
#else
    (void)k_bf16;
#endif
    return qk_f32(s->q + r * a->head_dim, k_rows, a->head_dim);
}

/* Row scores x against the tile's keys: times each key's scale (ks: 8-bit caches, else NULL), then
 * scale, softcap, -inf outside the lanes [lo, hi) the row sees. */
static inline void store_scores(const Args *a, vf x, int64_t lo, int64_t hi, float *p, const float *ks) {
    if (ks != NULL) x = vmul(x, vload(ks, W));
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
                store_scores(a, x[2 * r + t], lo[qi] - base, min64(hi[qi], nk) - base, s->p + (r0 + r) * KEY_BLOCK + base,
                             NULL);
            }
        }
    }
}
#endif

/* tile[j] = offsets[t0 + j] for the W keys of a tile, a key past the last (nk) reading the tile's first
 * row (real and finite, its scores masked): a plain copy for a full tile, which the compiler otherwise
 * made a gather (slow: ~5% of a decode's samples, Zen 4). */
static inline void tile_offsets(const int64_t *offsets, int64_t t0, int64_t nk, int64_t *tile) {
    if (t0 + W <= nk) {
        memcpy(tile, offsets + t0, W * sizeof(int64_t));
        return;
    }
    for (int j = 0; j < W; ++j) tile[j] = offsets[t0 + j < nk ? t0 + j : t0];
}

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
        const uint8_t *k8[W] = {0};
        int64_t tile[W];
        tile_offsets(offsets, t0, nk, tile);
        for (int j = 0; j < W; ++j) {
            const int64_t off = tile[j];
            if (a->kv == KV_F32) k_rows[j] = (const float *)a->k_cache + off;
            else if (a->kv == KV_BF16) k_bf16[j] = (const uint16_t *)a->k_cache + off;
            else k8[j] = (const uint8_t *)a->k_cache + off;
        }
        const float *ks = s->ks != NULL ? s->ks + t0 : NULL;
        int visible = 0;
        for (int64_t qi = 0; qi < it->num_queries; ++qi) visible |= lo[qi] < min64(hi[qi], t0 + W) && hi[qi] > t0;
#ifdef NATIVE_BF16_DOT
        if (visible && a->bf16_dot && it->num_queries * group >= TRANSPOSE_ROWS) {
            const uint16_t *k_next[W]; /* the next tile too, when there is one: scored in the same pass */
            const int pair = t0 + W < t_end;
            if (pair) tile_offsets(offsets, t0 + W, nk, tile);
            for (int j = 0; pair && j < W; ++j) k_next[j] = (const uint16_t *)a->k_cache + tile[j];
            score_tiles_transposed(a, it, s, t0, nk, k_bf16, pair ? k_next : NULL, lo, hi);
            if (pair) {
                t0 += W;
                if (ahead != NULL) prefetch_ahead(ahead, SCORE_PREFETCH);
            }
            continue;
        }
#endif
        /* 8-bit keys of the quads' rows (load_queries made them: fewer than TRANSPOSE_ROWS rows) are read
         * as they lie: int8 widened (i16_dot), fp8 through its table; else decoded to bf16 per tile */
        const int q8_quads = a->q8_dot && s->qt != NULL && it->num_queries * group < TRANSPOSE_ROWS;
        const int q8_tab = q8_quads && a->fp8_tab != NULL;
        int converted = q8_quads && (a->i16_dot || q8_tab);
        for (int64_t qi = 0; qi < it->num_queries; ++qi) {
            float *p = s->p + qi * group * KEY_BLOCK + t0;
            if (lo[qi] >= min64(hi[qi], t0 + W) || hi[qi] <= t0) {
                for (int64_t g = 0; g < group; ++g) vstore(p + g * KEY_BLOCK, vset1(-INFINITY), W);
                continue;
            }
            if (!converted && a->kv != KV_F32 && !a->bf16_dot) { /* once per tile for all rows */
#ifdef NATIVE_BF16_DOT
                if (q8_quads) rows8_to_bf16((uint16_t *)s->k_tile, k8, k_bf16, d); /* int8 without i16_dot */
                else
#endif
                if (a->kv == KV_BF16) rows_to_f32(s->k_tile, k_bf16, k_rows, d);
                else rows8_to_f32(s->k_tile, k8, k_rows, d, a->kv);
            }
            converted = 1;
#ifdef NATIVE_BF16_DOT
            if ((a->bf16_dot || q8_quads) && s->qt != NULL) { /* a group of at most 4 rows (see paged_attention) */
                const int64_t qs = quad_stride(d);
                const __m512i *qt = (const __m512i *)s->qt + qi * group * qs;
                vf x[4];
#define QUADS(NR) \
                if (a->i16_dot) qk_quads(qt, qs, NR, NULL, k8, d, 1, NULL, x); \
                else if (q8_tab) qk_quads(qt, qs, NR, NULL, k8, d, 0, (const __m512i *)a->fp8_tab, x); \
                else qk_quads(qt, qs, NR, k_bf16, NULL, d, 0, NULL, x); \
                break;
                switch (group) {
                case 4: QUADS(4)
                case 3: QUADS(3)
                case 2: QUADS(2)
                default: QUADS(1)
                }
#undef QUADS
                for (int64_t g = 0; g < group; ++g) {
                    if (a->i16_dot) x[g] = vmul(x[g], _mm512_castsi512_ps(qt[g * qs + qs - 1])); /* the row's q scale */
                    store_scores(a, x[g], lo[qi] - t0, min64(hi[qi], nk) - t0, p + g * KEY_BLOCK, ks);
                }
                continue;
            }
#endif
            for (int64_t g = 0; g < group; ++g)
                store_scores(a, row_scores(a, s, qi * group + g, k_bf16, k_rows), lo[qi] - t0, min64(hi[qi], nk) - t0,
                             p + g * KEY_BLOCK, ks);
        }
        (void)converted, (void)visible, (void)d;
    }
}

#endif /* PAGED_ATTENTION_SCORES_H */
