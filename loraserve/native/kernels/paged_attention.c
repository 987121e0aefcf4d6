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
 *
 * The cache may hold other elements than the activations (batch/kv_cache.py: bf16 under float32, or
 * fp8 / int8 read through scales): 8-bit tiles of keys are decoded once per tile for all the rows that
 * score them, 8-bit V rows as the value sums load them, and each key's scale multiplies its scores and,
 * after the softmax, its probabilities (per key: int8's scale is its block's), so no element is
 * rescaled. The bf16 pair-dot paths serve bf16 q over a bf16 cache, and bf16 q over an fp8 cache,
 * whose keys and values are read as bf16 through a 128-word table of the format (exact; probabilities
 * rounded to bf16 as for a bf16 cache; 16 x 1,900 tokens x 30 layers, 1 Zen 4 thread: 71-73 -> 56-58
 * ms against keys widened through float16 and values summed in float32). bf16 q over an int8 cache on
 * CPUs with int16 pair products (AVX512-VNNI) decodes nothing: the decode rows' q and every row's
 * probabilities are rounded to int16 at a power-of-two scale (per row; per row and block), the int8
 * keys and values widen to int16 as they load, and vpdpwssd sums their products exactly in int32 (a
 * row's error: its largest q or probability times 2^-16, where bf16 rounds each value by up to 2^-9
 * of itself; same shape, 1 / 2 threads: 58 -> 43 / 30 -> 25 ms). Everything else takes the float32
 * paths.
 *
 * One translation unit in parts by op family (copied beside this file by native/build.py, which
 * builds every `paged_attention_*.h` into the digest): _dots.h (vector helpers, q.k of a tile),
 * _formats.h (the cache's element formats: decoding, fp8 encoding), _items.h (arguments, work items,
 * scratch, prefetch plan), _scores.h (a block's scores), _pairs.h (value sums through pair dot
 * products), _values.h (online softmax, value sums, a block of one or several KV heads), _lanes.h
 * (prefill rows in lanes), _write.h (the step's new rows into the cache, quantized as its format
 * says), _plan.h (metadata checks, items and key partitions); this file: the walk over an item's
 * blocks, the output, the partition merge and the entry point.
 */
#include <stdlib.h>

#include "simd.h"
#include "paged_attention_dots.h"
#include "paged_attention_formats.h"
#include "paged_attention_items.h"
#include "paged_attention_scores.h"
#include "paged_attention_pairs.h"
#include "paged_attention_values.h"
#include "paged_attention_lanes.h"

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
    const int64_t len = block_len(begin, end), esize = kv_esize(a->kv);
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

#include "paged_attention_write.h"
#include "paged_attention_plan.h"

/* The cache's format, as paged_attention_cpu.KVFormat lays it out (NULL: the activations' dtype). */
typedef struct {
    int64_t kind;               /* a KV_ code */
    float *k_scales, *v_scales; /* int8: [num_blocks, KVH] float32 each; else NULL */
    float k_scale, v_scale;     /* fp8: per tensor */
} KVFormat;

/* Returns 0 on success, 1 when scratch memory cannot be allocated, 2 for metadata that points outside
 * the buffers (block ids >= num_blocks, lengths that do not add up): the output is then incomplete.
 * q: [T, H, D] rows q_stride elements apart; k_cache, v_cache: [num_blocks * block_size, KVH, D];
 * out: [T, H, D] contiguous; block_tables [B, max_blocks], context_lens [B], query_starts [B + 1]
 * int32; q, out and new rows share the dtype (float32, or bf16 when is_bf16), the caches hold `format`'s
 * elements (NULL: that dtype too). With slot_mapping (int64 [T]) the step's new K/V rows (k_new, v_new:
 * [T, KVH * D], rows k_stride / v_stride elements apart) are first written to their cache slots (as
 * the layer's index_copy_ would, converted to the cache's format: paged_attention_write.h): one call
 * instead of three per layer and step. Slots past the cache are refused (2) before anything is written. */
int paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                    const int32_t *query_starts, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    float scale, float softcap, int64_t window, int is_bf16, int num_threads,
                    const void *k_new, int64_t k_stride, const void *v_new, int64_t v_stride,
                    const int64_t *slot_mapping, const KVFormat *format) {
    const int kv = format != NULL ? (int)format->kind : (is_bf16 ? KV_BF16 : KV_F32);
#ifdef NATIVE_BF16_DOT
    const int bf16_dot = is_bf16 && kv == KV_BF16, q8_dot = is_bf16 && kv >= KV_E4M3;
#else
    const int bf16_dot = 0, q8_dot = 0;
#endif
#ifdef NATIVE_I16_DOT
    const int i16_dot = q8_dot && kv == KV_INT8;
#else
    const int i16_dot = 0;
#endif
    _Alignas(64) uint16_t fp8_tab[128];
    const int fp8_dot = q8_dot && (kv == KV_E4M3 || kv == KV_E5M2);
#ifdef NATIVE_BF16_DOT
    if (fp8_dot) fp8_bf16_table(kv, fp8_tab);
#endif
    const Args a = {q, k_cache, v_cache, out, block_tables, context_lens, query_starts, q_stride, max_blocks,
                    num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, is_bf16, kv, bf16_dot, q8_dot, i16_dot,
                    format != NULL ? format->k_scales : NULL, format != NULL ? format->v_scales : NULL,
                    format != NULL ? format->k_scale : 1.0f, format != NULL ? format->v_scale : 1.0f,
                    fp8_dot ? fp8_tab : NULL};
    if (kv < KV_F32 || kv > KV_INT8 || (kv == KV_INT8 && (a.k_scales == NULL || a.v_scales == NULL))) return 2;
    if (check_metadata(&a, num_seqs, num_tokens, num_blocks)) return 2;
    if (slot_mapping != NULL) {
        for (int64_t t = 0; t < num_tokens; ++t)
            if (slot_mapping[t] < 0 || slot_mapping[t] >= num_blocks * block_size) return 2;
        if (write_kv(&a, num_tokens, k_new, k_stride, v_new, v_stride, slot_mapping)) return 1;
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
        if (kv >= KV_E4M3) /* the item's heads' per-key scales (rows_cap >= its heads), the rows' p scales */
            quads_ok = (s.ks = (float *)malloc(sizeof(float) * (size_t)((2 * KEY_BLOCK + 1) * rows_cap))) != NULL;
        if (s.ks != NULL) s.vs = s.ks + rows_cap * KEY_BLOCK, s.ps = s.vs + rows_cap * KEY_BLOCK;
#ifdef NATIVE_BF16_DOT
        /* qk_quads' rows: a small GQA group's. Each row's quads take 8 * d bytes; beyond d = 128 an
         * item's quads crowd its accumulators out of L1 (slower at d = 256 than without them). */
        if (quads_ok && (bf16_dot || q8_dot) && num_heads / num_kv_heads <= 4 && d <= 128)
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
        free(s.ks);
    }
    free(items);
    free(partials);
    return failed ? 1 : 0;
}
