/* lora_kernel.c's work items: how a step's segments, slices and column chunks become items, how
 * threads walk them (cursors, segment-major order, prefetching the item ahead) and their scratch.
 * Included once, by lora_kernel.c, after lora_kernel_vec.h. */

/* A slot's rank for one slice, clamped to [0, max_rank] so no value can index past the buffers. */
static inline int64_t slice_rank(const int32_t *ranks, int64_t index, int64_t max_rank) {
    const int64_t rank = ranks[index];
    return rank < 0 ? 0 : (rank > max_rank ? max_rank : rank);
}

/* A segment's tokens are cut into groups of TOKEN_GROUP; every work item serves one group, so the
 * threads share a long segment (one adapter) mostly by its tokens: apart from the items at the edge of
 * a thread's range, each writes its own rows of t and y (splitting by rows of A had both threads
 * writing every cache line of t). A shrink item is a block of ROW_BLOCK rows of one slice; an expand
 * item a chunk of columns of one slice. */
#define TOKEN_GROUP 8
#define SEG_MAJOR_MIN 2 /* segments per thread, at least, for the segment-major order (run_segments) */
#define PREFETCH_AHEAD 4 /* items: the blocks of A and Bt a thread needs next are fetched while it computes */

typedef struct {
    int64_t q, col, width;
} SliceChunk;

/* Cut each slice into chunks of `chunk` columns (the last one narrower); returns the count. */
static int64_t slice_chunks(const int64_t *offsets, int64_t num_slices, int64_t chunk, SliceChunk *out) {
    int64_t count = 0;
    for (int64_t q = 0; q < num_slices; ++q) {
        const int64_t width = offsets[q + 1] - offsets[q];
        for (int64_t col = 0; col < width; col += chunk) {
            if (out) out[count] = (SliceChunk){q, offsets[q] + col, width - col < chunk ? width - col : chunk};
            ++count;
        }
    }
    return count;
}

/* Into L2 (T1): four items ahead outgrow L1, and a non-temporal hint (NTA) read 16 adapters' decode
 * weights at 29 GB/s where T1 reads 33 of the machine's 35 (Zen 4, 2 threads, benchmarks/lora_kernel). */
static inline void prefetch_rows(const char *p, int64_t row_bytes, int64_t ld_bytes, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + r * ld_bytes + off, 0, 2);
}

static inline void thread_range(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
    const int64_t tid = 0, nth = 1;
#endif
    *lo = n * tid / nth;
    *hi = n * (tid + 1) / nth;
}

#define SHRINK_CALL(fn, type, R_, T_) fn((const type *)a_rows, in, R_, (const type *const *)xs, T_, sc, out, ld)
#define SHRINK_BY_SIZE(fn, type)                                                                  \
    do {                                                                                          \
        if (R == ROW_BLOCK && T == TOKEN_BLOCK) SHRINK_CALL(fn, type, ROW_BLOCK, TOKEN_BLOCK);   \
        else if (R == ROW_BLOCK && T == 1) SHRINK_CALL(fn, type, ROW_BLOCK, 1);                   \
        else if (R == ROW_BLOCK && T == 2) SHRINK_CALL(fn, type, ROW_BLOCK, 2);                   \
        else SHRINK_CALL(fn, type, R, T);                                                         \
    } while (0)

/* t[p * ld + row] for the R rows of A at a_rows and the tokens p of one segment (t of float, or of
 * tbf16 for bf16 layers), each token's row times scales[p] (scales NULL: unscaled). */
static void shrink_item(int elem, const char *a_rows, int64_t in, int R, const void *x, int64_t x_stride,
                        const int64_t *token_ids, const float *scales, int64_t start, int64_t len, void *t,
                        int64_t ld) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4;
    for (int64_t m = 0; m < len; m += TOKEN_BLOCK) {
        const int T = len - m < TOKEN_BLOCK ? (int)(len - m) : TOKEN_BLOCK;
        const void *xs[TOKEN_BLOCK];
        for (int tk = 0; tk < T; ++tk) xs[tk] = (const char *)x + size * token_ids[start + m + tk] * x_stride;
        void *out = (char *)t + t_elem_size(elem) * (start + m) * ld;
        const float *sc = scales ? scales + start + m : NULL;
        if (elem == LORA_BF16) SHRINK_BY_SIZE(shrink_block_bf16, bf16);
        else SHRINK_BY_SIZE(shrink_block_f32, float);
    }
}

#define EXPAND_CALL(fn, type, ttype, T_) \
    fn((type *const *)ys, (const ttype *const *)ts, T_, (const type *)b, ld, rank, width)
#define EXPAND_BY_SIZE(fn, type, ttype)                                 \
    do {                                                                \
        if (T == TOKEN_BLOCK) EXPAND_CALL(fn, type, ttype, TOKEN_BLOCK); \
        else if (T == 1) EXPAND_CALL(fn, type, ttype, 1);               \
        else if (T == 2) EXPAND_CALL(fn, type, ttype, 2);               \
        else EXPAND_CALL(fn, type, ttype, T);                           \
    } while (0)

/* y[token p, col : col + width] += t[p * t_ld : + rank] @ b (rank rows of ld elements) for the tokens
 * p in [first, last) of token_ids. */
static void expand_item(int elem, void *y, int64_t y_stride, const char *b, int64_t ld, int64_t rank,
                        int64_t col, int64_t width, const void *t, int64_t t_ld, const int64_t *token_ids,
                        int64_t first, int64_t last) {
    const int64_t size = elem == LORA_BF16 ? 2 : 4, t_size = t_elem_size(elem);
    for (int64_t p = first; p < last; p += TOKEN_BLOCK) {
        const int T = last - p < TOKEN_BLOCK ? (int)(last - p) : TOKEN_BLOCK;
        void *ys[TOKEN_BLOCK];
        const void *ts[TOKEN_BLOCK];
        for (int tk = 0; tk < T; ++tk) {
            ys[tk] = (char *)y + size * (token_ids[p + tk] * y_stride + col);
            ts[tk] = (const char *)t + t_size * (p + tk) * t_ld;
        }
        if (elem == LORA_BF16) EXPAND_BY_SIZE(expand_block_bf16, bf16, tbf16);
        else EXPAND_BY_SIZE(expand_block_f32, float, float);
    }
}

/* The layer's buffers and the step's segments, as lora_fused receives them. */
typedef struct {
    int elem;
    int64_t size, t_size, in, out, max_rank, num_slices, stacked_rank, row_blocks, num_chunks; /* bytes per element */
    int64_t num_segs;
    const char *a, *bt;
    const int32_t *ranks;
    const int64_t *token_ids, *seg_slots, *seg_starts, *seg_lens, *shrink_first, *expand_first;
    const SliceChunk *chunks;
    const float *scales; /* per active token, in token_ids order; NULL: every scale is 1 */
} Step;

/* A thread's walk over its items: item `item` is sub-item `sub` (of per_group) of the token group
 * [first, last) of segment `seg`; with `inner` sub-items per slice, sub = q * inner + r. Stepping it
 * item by item (cursor_next) replaces a search and two 64-bit divisions per item (and as many again
 * for the item prefetched ahead): ~100 cycles of a 64-column expand item's ~300 in a decode step. */
typedef struct {
    int64_t item, seg, first, last, sub, q, r;
} Cursor;

/* The cursor at `item` (< the item count), each token group of a segment having per_group items. */
static Cursor cursor_at(const Step *s, const int64_t *seg_first, int64_t per_group, int64_t inner, int64_t item) {
    Cursor c = {item, 0, 0, 0, 0, 0, 0};
    while (item >= seg_first[c.seg + 1]) ++c.seg;
    const int64_t local = item - seg_first[c.seg], end = s->seg_starts[c.seg] + s->seg_lens[c.seg];
    c.first = s->seg_starts[c.seg] + local / per_group * TOKEN_GROUP;
    c.last = c.first + TOKEN_GROUP < end ? c.first + TOKEN_GROUP : end;
    c.sub = local % per_group, c.q = c.sub / inner, c.r = c.sub % inner;
    return c;
}

/* The next item: the next sub-item of the group, else the group's next token group, else the first
 * group of the next segment that has tokens (after the last item, c->seg is num_segs). */
static inline void cursor_next(const Step *s, int64_t per_group, int64_t inner, Cursor *c) {
    ++c->item;
    if (++c->sub < per_group) {
        if (++c->r == inner) c->r = 0, ++c->q;
        return;
    }
    c->sub = c->q = c->r = 0;
    int64_t end = s->seg_starts[c->seg] + s->seg_lens[c->seg];
    if (c->last < end) c->first = c->last;
    else {
        do ++c->seg;
        while (c->seg < s->num_segs && s->seg_lens[c->seg] <= 0);
        if (c->seg == s->num_segs) return;
        c->first = s->seg_starts[c->seg], end = c->first + s->seg_lens[c->seg];
    }
    c->last = c->first + TOKEN_GROUP < end ? c->first + TOKEN_GROUP : end;
}

/* Whether a thread whose items start at `lo` has read the cursor's block of weights (A or Bt) for the
 * token group before its own in the same segment: that item is c->item - per_group. A prefetch of it
 * then only costs instructions (a long segment's later groups find the block in cache), so it is
 * skipped. */
static inline int read_before(const Step *s, const Cursor *c, int64_t per_group, int64_t lo) {
    return c->first > s->seg_starts[c->seg] && c->item - per_group >= lo;
}

/* The cursor's shrink item: ROW_BLOCK rows of one slice (c->q, block c->r) against one token group;
 * with t NULL, only prefetch its rows of A (unless read_before, `lo` the thread's first item). */
ALWAYS_INLINE void shrink_at(const Step *s, const Cursor *c, int64_t lo, const void *x, int64_t x_stride, void *t) {
    const int64_t row0 = c->r * ROW_BLOCK, slot = s->seg_slots[c->seg];
    const int64_t rank = slice_rank(s->ranks, slot * s->num_slices + c->q, s->max_rank);
    if (row0 >= rank) return;
    const int R = rank - row0 < ROW_BLOCK ? (int)(rank - row0) : ROW_BLOCK;
    const int64_t row = c->q * s->max_rank + row0;
    const char *a_rows = s->a + s->size * (slot * s->stacked_rank + row) * s->in;
    if (t == NULL) {
        if (!read_before(s, c, s->num_slices * s->row_blocks, lo)) prefetch_rows(a_rows, s->size * s->in * R, 0, 1);
    } else shrink_item(s->elem, a_rows, s->in, R, x, x_stride, s->token_ids, s->scales, c->first, c->last - c->first,
                       (char *)t + s->t_size * row, s->stacked_rank);
}

/* The cursor's expand item: one column chunk (c->sub) of one slice for one token group; with y NULL,
 * only prefetch its block of Bt (unless read_before, `lo` the thread's first item). */
ALWAYS_INLINE void expand_at(const Step *s, const Cursor *c, int64_t lo, void *y, int64_t y_stride, const void *t) {
    const SliceChunk ch = s->chunks[c->sub];
    const int64_t slot = s->seg_slots[c->seg], rank = slice_rank(s->ranks, slot * s->num_slices + ch.q, s->max_rank);
    if (rank == 0) return;
    const char *b = s->bt + s->size * ((slot * s->stacked_rank + ch.q * s->max_rank) * s->out + ch.col);
    if (y == NULL) {
        if (!read_before(s, c, s->num_chunks, lo)) prefetch_rows(b, s->size * ch.width, s->size * s->out, rank);
    } else expand_item(s->elem, y, y_stride, b, s->out, rank, ch.col, ch.width,
                       (const char *)t + s->t_size * ch.q * s->max_rank, s->stacked_rank, s->token_ids, c->first,
                       c->last);
}

/* seg_first[g] = the first item of segment g, each token group of a segment having per_group items;
 * seg_first[num_segs] is the item count, seg_first[num_segs + 1] a sentinel for cursor_at's walk. */
static void first_items(const int64_t *seg_lens, int64_t num_segs, int64_t per_group, int64_t *seg_first) {
    seg_first[0] = 0;
    for (int64_t g = 0; g < num_segs; ++g)
        seg_first[g + 1] = seg_first[g] + (seg_lens[g] + TOKEN_GROUP - 1) / TOKEN_GROUP * per_group;
    seg_first[num_segs + 1] = INT64_MAX;
}

/* The calling thread's scratch for calls that need at most SCRATCH_CACHED bytes (t, the chunks and the
 * segments' first items of a decode step need a few KiB): kept between calls (grow-only), where a
 * malloc and a free of each buffer per call was a visible share of a decode call. Larger calls allocate their
 * own. Thread-local, so concurrent callers (the decoder stack, python threads) never share one. */
#define SCRATCH_CACHED (64 * 1024)
static __thread void *cached_scratch;
static __thread size_t cached_bytes;

static void *scratch_get(size_t bytes) {
    if (bytes > SCRATCH_CACHED) return aligned_alloc(64, bytes);
    if (bytes > cached_bytes) {
        free(cached_scratch);
        cached_bytes = bytes < 4096 ? 4096 : SCRATCH_CACHED;
        cached_scratch = aligned_alloc(64, cached_bytes);
        if (cached_scratch == NULL) cached_bytes = 0;
    }
    return cached_scratch;
}

static void scratch_put(void *p) {
    if (p != cached_scratch) free(p);
}

/* Items [lo, hi) of one pass (shrink or expand), each computed after prefetching the item
 * PREFETCH_AHEAD further on: a thread's share of the pass. */
#define RUN_RANGE(at, seg_first, per_group, inner, lo, hi, out, out_stride, in)                        \
    do {                                                                                               \
        if ((lo) < (hi)) {                                                                             \
            Cursor cur = cursor_at(&s, seg_first, per_group, inner, lo), ahead = cur;                  \
            if ((lo) + PREFETCH_AHEAD < (hi)) ahead = cursor_at(&s, seg_first, per_group, inner, (lo) + PREFETCH_AHEAD); \
            for (; cur.item < (hi); cursor_next(&s, per_group, inner, &cur)) {                         \
                if (ahead.item > cur.item && ahead.item < (hi)) {                                      \
                    at(&s, &ahead, lo, NULL, 0, NULL);                                                 \
                    cursor_next(&s, per_group, inner, &ahead);                                         \
                }                                                                                      \
                at(&s, &cur, lo, out, out_stride, in);                                                 \
            }                                                                                          \
        }                                                                                              \
    } while (0)

/* Segment-major order, for steps of many short segments (each one token group or less) on several
 * threads: a thread takes a contiguous range of segments and, for each, runs its shrink items and then
 * its expand items, each pass's items in their usual order. Its segments' rows of t are its own, so
 * no barrier is needed between the passes, and t stays in L1 between them. Each item's arithmetic is
 * that of the two-pass order: results do not change. The walk is (segment g, pass, sub-item as in
 * Cursor). */
typedef struct {
    int64_t g, pass, sub, q, r;
} SegWalk;

static inline void skip_empty(const Step *s, SegWalk *w, int64_t g1) {
    while (w->g < g1 && s->seg_lens[w->g] <= 0) ++w->g;
}

/* The next item of the walk (past segment g1 - 1, w->g is g1). */
static inline void walk_next(const Step *s, SegWalk *w, int64_t g1) {
    if (w->pass == 0) {
        if (++w->sub < s->num_slices * s->row_blocks) {
            if (++w->r == s->row_blocks) w->r = 0, ++w->q;
            return;
        }
        w->pass = 1, w->sub = 0;
        return;
    }
    if (++w->sub < s->num_chunks) return;
    w->pass = w->sub = w->q = w->r = 0;
    ++w->g;
    skip_empty(s, w, g1);
}

/* Segments [g0, g1) in segment-major order, each item after prefetching the item PREFETCH_AHEAD on
 * (a cursor of a single-group segment never has read_before, so its item number is not needed). */
static void run_segments(const Step *s, int64_t g0, int64_t g1, const void *x, int64_t x_stride, void *y,
                         int64_t y_stride, void *t) {
    SegWalk w = {g0, 0, 0, 0, 0};
    skip_empty(s, &w, g1);
    SegWalk ahead = w;
    for (int i = 0; i < PREFETCH_AHEAD && ahead.g < g1; ++i) walk_next(s, &ahead, g1);
    for (; w.g < g1; walk_next(s, &w, g1)) {
        if (ahead.g < g1) {
            const Cursor c = {0, ahead.g, s->seg_starts[ahead.g], s->seg_starts[ahead.g] + s->seg_lens[ahead.g],
                              ahead.sub, ahead.q, ahead.r};
            if (ahead.pass == 0) shrink_at(s, &c, 0, NULL, 0, NULL);
            else expand_at(s, &c, 0, NULL, 0, NULL);
            walk_next(s, &ahead, g1);
        }
        const Cursor c = {0, w.g, s->seg_starts[w.g], s->seg_starts[w.g] + s->seg_lens[w.g], w.sub, w.q, w.r};
        if (w.pass == 0) shrink_at(s, &c, 0, x, x_stride, t);
        else expand_at(s, &c, 0, y, y_stride, t);
    }
}

/* Whether lora_fused runs a step segment-major (see run_segments): many short segments, several threads. */
static inline int segment_major(int64_t max_len, int has_rank, int64_t num_threads, int64_t num_segs) {
    return max_len <= TOKEN_GROUP && has_rank && num_threads > 1 && num_segs >= SEG_MAJOR_MIN * num_threads;
}
