/* The kernel's state: its arguments (Args), work items (Item), scratch (Scratch), the prefetch plan
 * of the next block (Ahead), key ranges and the walk over an item's rows, and the queries' load.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_ITEMS_H
#define PAGED_ATTENTION_ITEMS_H

/* is_bf16: q, out and the new K/V rows are bf16 (else float32); kv: the cache's element format (a KV_
 * code: float32 or bf16, or 8-bit values read through scales: fp8's per tensor, k_scale / v_scale, and
 * int8's per (block, KV head), k_scales / v_scales [num_blocks, KVH]); bf16_dot: q and cache both bf16
 * on a CPU with bf16 pair dot products, the paths that read bf16 keys and values as they lie; q8_dot: bf16
 * q over an 8-bit cache on such a CPU, whose decode rows score its keys as bf16 (fp8 through fp8_tab;
 * int8 decoded per tile by rows8_to_bf16 where the CPU lacks int16 pair products);
 * i16_dot: q8_dot over an int8 cache on a CPU with int16 pair dot products too (AVX512-VNNI): decode
 * rows' q and all rows' probabilities are rounded to int16 and multiply the int8 elements widened;
 * fp8_tab: q8_dot over an fp8 cache: fp8_bf16_table's 128 words (64-byte aligned), through which keys
 * and values are decoded to bf16 for the pair products (else NULL). */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables, *context_lens, *query_starts;
    int64_t q_stride, max_blocks, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap;
    int is_bf16, kv, bf16_dot, q8_dot, i16_dot;
    float *k_scales, *v_scales; /* int8: written as rows arrive, read per key; else NULL */
    float k_scale, v_scale;     /* fp8: x = stored * scale (1.0 by default) */
    const void *fp8_tab;
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
 * follows them, and without this the kernel waits on memory latency, not bandwidth. Into L2 (T1): a
 * block ahead is ~100 KB (128 keys of 3 heads' K and V rows), three times L1; asked into L1 (T0) it
 * evicted the block being summed and held L1's miss buffers, and a 16 x 1,900-token bf16 decode step
 * read 6.8 GB/s a thread (Zen 4, 1 thread: 104 -> 47 ms, 2 threads 54 -> 31; float32 92 -> 65 ms).
 * always_inline: GCC deems a function of prefetches alone free of effects and drops calls to it. */
__attribute__((always_inline)) static inline void prefetch_ahead(Ahead *ahead, int64_t count) {
    const int64_t u1 = min64(ahead->done + count, ahead->n * ahead->heads), bytes = ahead->piece_bytes;
    for (int64_t u = ahead->done, j = u / ahead->heads, h = u % ahead->heads; u < u1; ++u) {
        const int64_t skip = h * bytes + ahead->offsets[j] * ahead->esize;
        const char *k = ahead->k + skip, *v = ahead->v + skip;
        if (++h == ahead->heads) h = 0, ++j;
        const int64_t skew = (int64_t)((uintptr_t)k & 63); /* v's too where the caches align alike (torch's do) */
        for (int64_t b = -skew; b < bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);
            __builtin_prefetch(v + b, 0, 2);
        }
    }
    ahead->done = max64(ahead->done, u1);
}

typedef struct {
    float *q, *acc, *m, *l, *k_tile, *p; /* p: [rows_cap, KEY_BLOCK] scores, then probabilities */
    uint16_t *q_bf16;                    /* rows q_stride_bf16(d) apart */
    uint32_t *kt;                        /* two transposed tiles of bf16 keys, [2, ceil(d / 2), W] */
    uint32_t *pb;                        /* p rounded to bf16 (or int16) in key pairs, [rows_cap, KEY_BLOCK / 2] */
    float *ps;                           /* i16_dot: each row's scale of its int16 probabilities, [rows_cap] */
    void *qt;                            /* quad_queries of each row, quad_stride(d) vectors apart */
    int64_t *row_range;                  /* [2 * rows_cap]: each row's key range in the current block */
    float *lanes;                        /* attend_lanes' state and block buffers (Lanes), or NULL */
    float *ks, *vs; /* 8-bit caches: [item heads][KEY_BLOCK] each key's K and V scale times its decode
                       factor, for the current block (block_scales), or NULL */
} Scratch;

/* Vectors of quad_queries per row: the quads, then the int16 rows' scale (quad_queries_i16). */
static inline int64_t quad_stride(int64_t d) { return 4 * ((d + 31) / 32) + 1; }

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
    (void)quads;
    RowAt at = first_row(a, it);
    for (int64_t r = 0; r < rows; ++r, next_row(it, &at)) {
        const int64_t offset = at.token * a->q_stride + at.head * d;
        if (a->is_bf16) {
            const uint16_t *src = (const uint16_t *)a->q + offset;
            copy_bf16(s->q_bf16 + r * qs, src, d);
            if (qs > d) s->q_bf16[r * qs + d] = 0;
#ifdef NATIVE_BF16_DOT
#ifdef NATIVE_I16_DOT
            if (quads && a->i16_dot) quad_queries_i16(src, d, (__m512i *)s->qt + r * quad_stride(d), quad_stride(d));
            else
#endif
            if (quads) quad_queries(src, d, (__m512i *)s->qt + r * quad_stride(d));
#endif
            if (!a->bf16_dot) /* with bf16 pair dot products over a bf16 cache the bf16 copy is all the scores read */
                for (int64_t i = 0; i < d; i += W) vstore(s->q + r * d + i, vload_bf16(src + i, d - i), d - i);
        } else {
            memcpy(s->q + r * d, (const float *)a->q + offset, (size_t)d * sizeof(float));
        }
        memset(s->acc + r * d, 0, (size_t)d * sizeof(float));
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
}

#endif /* PAGED_ATTENTION_ITEMS_H */
