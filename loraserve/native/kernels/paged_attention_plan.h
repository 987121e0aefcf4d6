/* The step's plan: metadata checks, the shape of each sequence's work items, key partitions for long
 * contexts that give the threads too few items.
 *
 * Part of paged_attention.c's one translation unit (see its header): included there once, in order
 * (dots, formats, items, scores, pairs, values, lanes, write, then plan), so each part may use what the earlier ones define. */
#ifndef PAGED_ATTENTION_PLAN_H
#define PAGED_ATTENTION_PLAN_H

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
    if (a->bf16_dot && a->head_dim <= 2 * LANE_KEY_STRIDE) return LANE_ROWS;
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

/* KV heads per item (at most) and the key partition length: items of all the heads of a short query
 * unless that leaves threads without two items each (a few short contexts), then one head each.
 * Keys are split (on more than one thread) into MIN_PART pieces whatever else the step holds: a split
 * query sums its keys in pieces that are merged, in another order than one pass, so the pieces must not
 * depend on the step. When the length was an even share of the step's keys (none when the step had
 * items enough), a sequence's row got other bits in a 9-row speculative verification than in its 1-row
 * decode step, and a greedy output changed after a near tie (SmolLM2 JSON, 2 threads). */
static void plan_shape(const Args *a, int64_t num_seqs, int num_threads, int64_t *max_heads, int64_t *part_len) {
    *max_heads = a->num_kv_heads;
    *part_len = num_threads <= 1 ? INT64_MAX : MIN_PART;
    if (num_threads > 1 && *max_heads > 1
            && plan_items(a, num_seqs, *part_len, *max_heads, NULL, NULL) < 2 * (int64_t)num_threads)
        *max_heads = 1;
}

#endif /* PAGED_ATTENTION_PLAN_H */
