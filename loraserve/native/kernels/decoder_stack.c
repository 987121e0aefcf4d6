/* One step of a Llama-family decoder stack in one call, through the same kernels as the Python path.
 *
 * Per layer, with x the previous layer's output and r the residual stream:
 *   h = rms_norm(x + r) (r updated; layer 0: h = rms_norm(r), r = the embeddings)
 *   qkv = h Wqkv^T + b (+ LoRA)   rope(q, k)   a = attention(q, K/V cache after writing k, v)
 *   o = a Wo^T + b (+ LoRA)       h = rms_norm(o + r) (r updated)
 *   g = h Wgu^T + b (+ LoRA)      s = silu(gate) * up      x = s Wd^T + b (+ LoRA)
 * Every op is the kernel the Python path (models/llama.py) calls, with the same arguments, in the same
 * order and into buffers of the same layout, so the result is bit for bit the same: this file only
 * removes the Python, ctypes and allocations between ~10 kernel calls per layer (about 2 ms of a
 * 30-layer decode step). The kernels come in as function pointers from their own libraries.
 *
 * Gemma-family layers (M_EXT not 0: see gemma_layer) run the same linears, rope and attention with
 * Gemma's norms, GeGLU (bound as the activation), per-head q/k norms, softcap and per-layer rope tables.
 *
 * Returns 0, or an error code: (layer << 8) | (op << 4) | status, op being one of the OP_ values and
 * status the kernel's own nonzero return (the caller raises the error that kernel's wrapper raises).
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*gemm_fn)(const int64_t *, const void *, int64_t, const void *, void *, int64_t, int, const int64_t *);
typedef void (*norm_fn)(const void *, int64_t, void *, int64_t, void *, int64_t, const void *, int64_t, int64_t,
                        float, int, int);
typedef void (*silu_fn)(const void *, int64_t, void *, int64_t, int64_t, int64_t, int, int);
typedef int (*rope_fn)(void *, int64_t, const int64_t *, const float *, const float *, int64_t, int64_t, int64_t,
                       int64_t, int, int);
typedef int (*attn_fn)(const void *, int64_t, const void *, const void *, void *, const int32_t *, int64_t,
                       const int32_t *, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float, float, int64_t, int, int, const void *, int64_t, const void *, int64_t,
                       const int64_t *, const void *);
typedef int (*lora_fn)(const int64_t *, const int64_t *, const void *, int64_t, void *, int64_t, int);
typedef int64_t (*ranges_fn)(const int64_t *, const int64_t *, int64_t *, int64_t, int);
#define MAX_SIDE_RUNS 128 /* of lora_weight_ranges: two per slice and adapter of a step (16 adapters x qkv: 96) */

enum { OP_GEMM = 1, OP_ROPE = 2, OP_ATTENTION = 3, OP_LORA = 4 };

/* The model's fixed half, built once: kernels, sizes and each layer's weights. */
enum {
    M_GEMM, M_NORM, M_SILU, M_ROPE, M_ATTN, M_LORA, M_LORA_RANGES, /* function pointers */
    M_LAYERS, M_HIDDEN, M_Q, M_KV, M_INTER, M_HEADS, M_KV_HEADS, M_HEAD_DIM, M_DTYPE,
    M_COS, M_SIN, M_POSITIONS, /* rope tables [M_POSITIONS, head_dim] float32 */
    M_EXT,                     /* Gemma's fields (X_ below), or 0 for a Llama-family stack */
    M_FIELDS
};
/* Per layer: norm weights, each linear's kernel arguments and bias (0: none), caches, then each
 * linear's kernel (a gemm_fn: gemm_linear_prefetch for a dense packed weight, quant_gemm for a
 * block-quantized one; M_GEMM is the dense one, kept for the caller's checks), then the caches'
 * format (paged_attention.c's KVFormat: element code and scales). */
enum {
    L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS, L_O, L_O_BIAS, L_GU, L_GU_BIAS, L_DOWN, L_DOWN_BIAS,
    L_K_CACHE, L_V_CACHE, L_SLIDING, L_QKV_FN, L_O_FN, L_GU_FN, L_DOWN_FN, L_KV_FORMAT, L_FIELDS
};
/* The step's half. Buffers: r [T, hidden] holds the embeddings and is the residual stream; x, h
 * [T, hidden]; qkv [T, q + 2 kv]; a [T, q]; g [T, 2 inter]; s [T, inter]. */
enum {
    S_TOKENS, S_THREADS, S_POSITIONS, S_BLOCK_TABLES, S_MAX_BLOCKS, S_CONTEXT_LENS, S_QUERY_STARTS, S_SEQS,
    S_NUM_BLOCKS, S_BLOCK_SIZE, S_WINDOW, S_SLOTS, S_LORA_STEP, S_LORA_LAYERS,
    S_R, S_X, S_H, S_QKV, S_A, S_G, S_S, S_FIELDS
};

/* The three arrays' field counts, M | L << 8 | S << 16: the caller checks its copy of the layout. */
int decoder_stack_layout(void) { return M_FIELDS | L_FIELDS << 8 | S_FIELDS << 16; }

#define PTR(type, v) ((type)(intptr_t)(v))
#define FAIL(layer, op, status) return (int)(((layer) << 8) | ((op) << 4) | ((status) & 0xF))

/* y = x W^T + b through the linear's kernel `fn`, then the layer's LoRA term when `lora` is not 0; the
 * product fetches that term's adapter weights meanwhile (see gemm_kernel.c), so the LoRA kernel finds
 * them in cache instead of waiting on memory at its start. */
static int linear(const int64_t *m, const int64_t *s, int64_t fn, int64_t weight, int64_t bias, int64_t lora, const void *x,
                  int64_t ldx, void *y, int64_t ldy) {
    int64_t side[2 + 4 * MAX_SIDE_RUNS]; /* the LoRA term's weights, fetched during the base product */
    const int64_t *sp = NULL;
    if (lora != 0 && m[M_LORA_RANGES] != 0 &&
        PTR(ranges_fn, m[M_LORA_RANGES])(PTR(const int64_t *, lora), PTR(const int64_t *, s[S_LORA_STEP]), side,
                                         MAX_SIDE_RUNS, (int)s[S_THREADS]) > 0)
        sp = side;
    int status = PTR(gemm_fn, fn)(PTR(const int64_t *, weight), x, ldx, PTR(const void *, bias), y,
                                         s[S_TOKENS], (int)s[S_THREADS], sp);
    if (status != 0) return (OP_GEMM << 4) | (status & 0xF);
    if (lora != 0) {
        status = PTR(lora_fn, m[M_LORA])(PTR(const int64_t *, lora), PTR(const int64_t *, s[S_LORA_STEP]), x, ldx,
                                         y, ldy, (int)s[S_THREADS]);
        if (status != 0) return (OP_LORA << 4) | (status & 0xF);
    }
    return 0;
}

/* Attention of one layer: q, k, v are column ranges of qkv; the kernel writes k, v into the caches. */
static int attention(const int64_t *m, const int64_t *s, const int64_t *l, char *qkv, int64_t ld, int64_t elem,
                     float scale, float softcap) {
    const int64_t q = m[M_Q], kv = m[M_KV];
    return PTR(attn_fn, m[M_ATTN])(
        qkv, ld, PTR(const void *, l[L_K_CACHE]), PTR(const void *, l[L_V_CACHE]), PTR(void *, s[S_A]),
        PTR(const int32_t *, s[S_BLOCK_TABLES]), s[S_MAX_BLOCKS], PTR(const int32_t *, s[S_CONTEXT_LENS]),
        PTR(const int32_t *, s[S_QUERY_STARTS]), s[S_SEQS], s[S_TOKENS], s[S_NUM_BLOCKS], m[M_HEADS],
        m[M_KV_HEADS], m[M_HEAD_DIM], s[S_BLOCK_SIZE], scale, softcap, l[L_SLIDING] ? s[S_WINDOW] : 0,
        (int)m[M_DTYPE], (int)s[S_THREADS], qkv + q * elem, ld, qkv + (q + kv) * elem, ld,
        PTR(const int64_t *, s[S_SLOTS]), PTR(const void *, l[L_KV_FORMAT]));
}

/* Gemma's part, M_EXT: the (1 + w) norm kernel (offset_rms_norm), whether the layers have Gemma-2's
 * sandwich norms, whether they have per-head q/k norms (Gemma-3), the attention softcap (float bits,
 * 0: none) and the per-layer fields (XL_ below). L_IN_NORM and L_POST_NORM hold the float32 (1 + w)
 * scales of input_layernorm and post_attention_layernorm. */
enum { X_NORM, X_SANDWICH, X_QK_NORM, X_SOFTCAP, X_LAYERS, X_FIELDS };
/* Per layer: the pre- and post-feedforward norms' scales (sandwich), q/k norms' scales, rope tables. */
enum { XL_PRE_FF, XL_POST_FF, XL_Q_NORM, XL_K_NORM, XL_COS, XL_SIN, XL_POSITIONS, XL_FIELDS };
int decoder_stack_gemma_layout(void) { return X_FIELDS | XL_FIELDS << 8; }
typedef void (*onorm_fn)(const void *, int64_t, void *, int64_t, void *, int64_t, const float *, int64_t, int64_t,
                         float, int, int, int);
enum { NORM_ONLY, ADD_THEN_NORM, NORM_THEN_ADD }; /* offset_rms_norm's modes */

/* One Gemma layer, as models/gemma.py's GemmaDecoderLayer runs it. Sandwich (Gemma-2/3), r the stream:
 *   h = norm_in(r)   qkv = h Wqkv^T (+ LoRA)   q, k = q_norm, k_norm per head   rope   attention (softcap)
 *   x = a Wo^T   r += norm_post_attn(x)   h = norm_pre_ff(r)   g = h Wgu^T   s = gelu(gate) * up
 *   x = s Wd^T   r += norm_post_ff(x)
 * Gemma: Llama's order (each residual add fused into the norm after it) with the (1 + w) norm; the
 * caller adds the last layer's x to r. */
static int gemma_layer(const int64_t *m, const int64_t *s, const int64_t *l, const int64_t *li, int64_t i,
                       float eps, float scale) {
    const int64_t *ext = PTR(const int64_t *, m[M_EXT]), *xl = PTR(const int64_t *, ext[X_LAYERS]) + i * XL_FIELDS;
    const int64_t hidden = m[M_HIDDEN], qkv_ld = m[M_Q] + 2 * m[M_KV], inter = m[M_INTER], rows = s[S_TOKENS];
    const int64_t dim = m[M_HEAD_DIM], elem = m[M_DTYPE] == 1 ? 2 : 4;
    const int dtype = (int)m[M_DTYPE], threads = (int)s[S_THREADS], sandwich = (int)ext[X_SANDWICH];
    const onorm_fn norm = PTR(onorm_fn, ext[X_NORM]);
    char *r = PTR(char *, s[S_R]), *x = PTR(char *, s[S_X]), *h = PTR(char *, s[S_H]), *qkv = PTR(char *, s[S_QKV]);
    union { int32_t bits; float f; } softcap = {.bits = (int32_t)ext[X_SOFTCAP]};
    int status;
#define SCALE(v) PTR(const float *, v)
    if (sandwich || i == 0) norm(r, hidden, NULL, 0, h, hidden, SCALE(l[L_IN_NORM]), rows, hidden, eps, NORM_ONLY, dtype, threads);
    else norm(x, hidden, r, hidden, h, hidden, SCALE(l[L_IN_NORM]), rows, hidden, eps, ADD_THEN_NORM, dtype, threads);
    if ((status = linear(m, s, l[L_QKV_FN], l[L_QKV], l[L_QKV_BIAS], li ? li[0] : 0, h, hidden, qkv, qkv_ld)) != 0) return status;
    if (ext[X_QK_NORM])
        for (int64_t t = 0; t < rows; ++t) { /* each token's heads: rows of head_dim, normalized in place */
            char *q = qkv + t * qkv_ld * elem, *k = q + m[M_Q] * elem;
            norm(q, dim, NULL, 0, q, dim, SCALE(xl[XL_Q_NORM]), m[M_HEADS], dim, eps, NORM_ONLY, dtype, threads);
            norm(k, dim, NULL, 0, k, dim, SCALE(xl[XL_K_NORM]), m[M_KV_HEADS], dim, eps, NORM_ONLY, dtype, threads);
        }
    status = PTR(rope_fn, m[M_ROPE])(qkv, qkv_ld, PTR(const int64_t *, s[S_POSITIONS]), SCALE(xl[XL_COS]),
                                     SCALE(xl[XL_SIN]), xl[XL_POSITIONS], rows, m[M_HEADS] + m[M_KV_HEADS], dim,
                                     dtype, threads);
    if (status != 0) return (OP_ROPE << 4) | (status & 0xF);
    if ((status = attention(m, s, l, qkv, qkv_ld, elem, scale, softcap.f)) != 0) return (OP_ATTENTION << 4) | (status & 0xF);
    if ((status = linear(m, s, l[L_O_FN], l[L_O], l[L_O_BIAS], li ? li[1] : 0, PTR(const void *, s[S_A]), m[M_Q], x, hidden)) != 0)
        return status;
    if (sandwich) {
        norm(x, hidden, r, hidden, r, hidden, SCALE(l[L_POST_NORM]), rows, hidden, eps, NORM_THEN_ADD, dtype, threads);
        norm(r, hidden, NULL, 0, h, hidden, SCALE(xl[XL_PRE_FF]), rows, hidden, eps, NORM_ONLY, dtype, threads);
    } else {
        norm(x, hidden, r, hidden, h, hidden, SCALE(l[L_POST_NORM]), rows, hidden, eps, ADD_THEN_NORM, dtype, threads);
    }
    char *g = PTR(char *, s[S_G]), *act = PTR(char *, s[S_S]);
    if ((status = linear(m, s, l[L_GU_FN], l[L_GU], l[L_GU_BIAS], li ? li[2] : 0, h, hidden, g, 2 * inter)) != 0) return status;
    PTR(silu_fn, m[M_SILU])(g, 2 * inter, act, inter, rows, inter, dtype, threads); /* the bound GeGLU */
    if ((status = linear(m, s, l[L_DOWN_FN], l[L_DOWN], l[L_DOWN_BIAS], li ? li[3] : 0, act, inter, x, hidden)) != 0) return status;
    if (sandwich)
        norm(x, hidden, r, hidden, r, hidden, SCALE(xl[XL_POST_FF]), rows, hidden, eps, NORM_THEN_ADD, dtype, threads);
#undef SCALE
    return 0;
}

int decoder_stack(const int64_t *m, const int64_t *layers, const int64_t *s, float eps, float scale) {
    const int64_t hidden = m[M_HIDDEN], qkv_ld = m[M_Q] + 2 * m[M_KV], inter = m[M_INTER], rows = s[S_TOKENS];
    const int dtype = (int)m[M_DTYPE], threads = (int)s[S_THREADS];
    const int64_t elem = dtype == 1 ? 2 : 4;
    const norm_fn norm = PTR(norm_fn, m[M_NORM]);
    char *r = PTR(char *, s[S_R]), *x = PTR(char *, s[S_X]), *h = PTR(char *, s[S_H]), *qkv = PTR(char *, s[S_QKV]);
    char *a = PTR(char *, s[S_A]), *g = PTR(char *, s[S_G]), *act = PTR(char *, s[S_S]);
    const int64_t *lora = PTR(const int64_t *, s[S_LORA_LAYERS]); /* 4 per layer (0: no LoRA term), or NULL */
    for (int64_t i = 0; i < m[M_LAYERS]; ++i) {
        const int64_t *l = layers + i * L_FIELDS, *li = lora == NULL ? NULL : lora + 4 * i;
        int status;
        if (m[M_EXT] != 0) {
            if ((status = gemma_layer(m, s, l, li, i, eps, scale)) != 0) FAIL(i, status >> 4, status);
            continue;
        }
        if (i == 0) norm(r, hidden, NULL, 0, h, hidden, PTR(const void *, l[L_IN_NORM]), rows, hidden, eps, dtype, threads);
        else norm(x, hidden, r, hidden, h, hidden, PTR(const void *, l[L_IN_NORM]), rows, hidden, eps, dtype, threads);
        if ((status = linear(m, s, l[L_QKV_FN], l[L_QKV], l[L_QKV_BIAS], li ? li[0] : 0, h, hidden, qkv, qkv_ld)) != 0)
            FAIL(i, status >> 4, status);
        status = PTR(rope_fn, m[M_ROPE])(qkv, qkv_ld, PTR(const int64_t *, s[S_POSITIONS]), PTR(const float *, m[M_COS]),
                                         PTR(const float *, m[M_SIN]), m[M_POSITIONS], rows, m[M_HEADS] + m[M_KV_HEADS],
                                         m[M_HEAD_DIM], dtype, threads);
        if (status != 0) FAIL(i, OP_ROPE, status);
        if ((status = attention(m, s, l, qkv, qkv_ld, elem, scale, 0.0f)) != 0) FAIL(i, OP_ATTENTION, status);
        if ((status = linear(m, s, l[L_O_FN], l[L_O], l[L_O_BIAS], li ? li[1] : 0, a, m[M_Q], x, hidden)) != 0)
            FAIL(i, status >> 4, status);
        norm(x, hidden, r, hidden, h, hidden, PTR(const void *, l[L_POST_NORM]), rows, hidden, eps, dtype, threads);
        if ((status = linear(m, s, l[L_GU_FN], l[L_GU], l[L_GU_BIAS], li ? li[2] : 0, h, hidden, g, 2 * inter)) != 0)
            FAIL(i, status >> 4, status);
        PTR(silu_fn, m[M_SILU])(g, 2 * inter, act, inter, rows, inter, dtype, threads);
        if ((status = linear(m, s, l[L_DOWN_FN], l[L_DOWN], l[L_DOWN_BIAS], li ? li[3] : 0, act, inter, x, hidden)) != 0)
            FAIL(i, status >> 4, status);
    }
    return 0;
}
