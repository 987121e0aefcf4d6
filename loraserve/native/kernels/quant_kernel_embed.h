/* quant_embed: a quantized embedding's lookup (layers/quant/embedding.py), the rows of the tokens a
 * step gathers dequantized in C. A tied LM head's table lies in panels of 8 rows (types 9-14), so a row
 * is first gathered block by block back into its source's row layout (formats.panel_rows' bytes), then
 * dequantized as quant_dequantize does: the values of the torch twin (formats.dequantize), which took
 * ~0.5 ms of Python and torch calls a decode step for one row of a Q6_K table.
 * Part of quant_kernel.c (included at its end, after quant_kernel_dequantize.h). */
#ifndef LORASERVE_QUANT_KERNEL_EMBED_H
#define LORASERVE_QUANT_KERNEL_EMBED_H

/* Tokens times row length from which the lookup splits its rows over threads (a prompt); a decode
 * step's few rows cost a few microseconds, less than a fork. */
#define EMBED_PARALLEL (1 << 16)

/* n bytes of a panel field (its 4-byte steps interleaved over the panel's 8 rows) of row `lane`. */
static inline void field_steps(const uint8_t *p, int64_t lane, int n, uint8_t *dst) {
    for (int t = 0; t < n / 4; t++) memcpy(dst + 4 * t, p + 32 * t + 4 * lane, 4);
}

/* Q4_K / Q5_K: the panel's spread scale and min bytes ([scale][row], 64 each) of row `lane` packed
 * back into the file's 12 bytes (kpanels.k_scale_bytes). */
static inline void pack_k_scales(const uint8_t *p, int64_t lane, uint8_t *dst) {
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; j++) sc[j] = p[8 * j + lane], mn[j] = p[64 + 8 * j + lane];
    for (int j = 0; j < 4; j++) {
        dst[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        dst[4 + j] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        dst[8 + j] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
}

/* Block b (a super-block for the K-quants) of row r of a panel weight of `type` (9-14) with k inputs,
 * as a one-block row of its row type at dst: the file's block (for Q8_0 / Q4_0 / Q4_1 a one-block row
 * of the row layout is the file's block too). Panel layouts: formats.repack_panels, kpanels.py. */
static void panel_block(int type, const uint8_t *wp, int64_t k, int64_t r, int64_t b, uint8_t *dst) {
    const int64_t size = TYPE_SIZE[type], blocks = k / BLOCK_SIZE[type], lane = r % 8;
    const uint8_t *p = wp + ((r / 8) * blocks + b) * 8 * size;
    if (type <= 11) { /* the quants' steps, then 8 float16 scales, then Q4_1's 8 mins */
        const int fields = type == 11 ? 4 : 2, qbytes = (int)size - fields;
        for (int f = 0; f < fields; f += 2) memcpy(dst + f, p + 8 * qbytes + 8 * f + 2 * lane, 2);
        field_steps(p, lane, qbytes, dst + fields);
        return;
    }
    if (type == 14) { /* Q6_K: low nibbles, two-bit parts, 16 int8 scales [scale][row], d */
        field_steps(p, lane, 128, dst);
        field_steps(p + 1024, lane, 64, dst + 128);
        for (int j = 0; j < 16; j++) dst[192 + j] = p[1536 + 8 * j + lane];
        memcpy(dst + 208, p + 1664 + 2 * lane, 2);
        return;
    }
    /* Q4_K / Q5_K: nibbles (Q5_K: then its high bits), scales and mins, d, dmin */
    const int64_t quants = type == 12 ? 1024 : 1280;
    field_steps(p, lane, 128, dst + (type == 12 ? 16 : 48));
    if (type == 13) field_steps(p + 1024, lane, 32, dst + 16);
    pack_k_scales(p + quants, lane, dst + 4);
    memcpy(dst, p + quants + 128 + 2 * lane, 2);
    memcpy(dst + 2, p + quants + 144 + 2 * lane, 2);
}

/* Where row `type`'s blocks are read whole (the file's per-32 layouts 0-2, the panels 9-14), the row
 * type (quant_kernel_blocks.h) a block of it is as a one-block row; else -1. */
static inline int block_row_type(int type) {
    return type <= 2 ? type + 6 : type >= 12 ? type - 9 : type >= 9 ? type - 3 : -1;
}

/* out[i] = row ids[i] of w = {address, n, k, type} (types 0-14), float32 (out_bf16 = 0) or bf16, [count, k]
 * dense: formats.dequantize's values. Returns 0, 1 for a weight quant_linear refuses (or a file layout
 * whose k is not a multiple of 32), 3 for an id outside [0, n) (nothing written). */
int quant_embed(const int64_t *w, const int64_t *ids, int64_t count, void *out, int out_bf16, int num_threads) {
    const int type = (int)w[3];
    if (type < 0 || type > 14 || count < 0) return 1;
    if (type <= 2 ? w[1] < 0 || w[2] <= 0 || w[2] % 32 : !weight_ok(w)) return 1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= w[1]) return 3;
    const uint8_t *wp = (const uint8_t *)(intptr_t)w[0];
    const int64_t k = w[2], block = BLOCK_SIZE[type], row_bytes = k / block * TYPE_SIZE[type];
    const int row_type = block_row_type(type);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * k >= EMBED_PARALLEL)
    for (int64_t i = 0; i < count; i++) {
        if (row_type < 0) { /* the K-quants' file blocks and the row layouts: rows as they lie */
            dequantize_row(type, wp + ids[i] * row_bytes, k / 32, out, i * k, out_bf16);
            continue;
        }
        uint8_t bytes[256]; /* a panel's block in its source format (at most Q6_K's 210 bytes) */
        for (int64_t b = 0; b < k / block; b++) {
            const uint8_t *src = bytes; /* a file block (types 0-2) is read where it lies */
            if (type <= 2) src = wp + ids[i] * row_bytes + b * TYPE_SIZE[type];
            else panel_block(type, wp, k, ids[i], b, bytes);
            dequantize_row(row_type, src, block / 32, out, i * k + b * block, out_bf16);
        }
    }
    return 0;
}

#endif
