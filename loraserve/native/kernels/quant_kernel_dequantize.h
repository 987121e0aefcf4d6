/* quant_dequantize, the prefill path's half of quant_kernel.c (included at its end): rows of a
 * block-quantized weight as float32 or bf16, for a tile product. The vector builds unpack each block in
 * registers (unpack_vec); the portable one through unpack_scalar. */
#ifndef LORASERVE_QUANT_KERNEL_DEQUANTIZE_H
#define LORASERVE_QUANT_KERNEL_DEQUANTIZE_H

#if QK_PATH > 0
/* 8 floats at p as float32 or bf16 (to nearest even: weights are finite). */
static inline __attribute__((always_inline)) void store8(void *out, int64_t at, __m256 v, int out_bf16) {
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* One block of row r dequantized with the vector unpacking; s * q + add unfused (see below). */
static inline __attribute__((always_inline)) void dequantize_block(int type, const uint8_t *row, int64_t nb, int64_t b,
                                                                   void *out, int64_t at, int out_bf16) {
    const int is_signed = is_signed_type(type);
    blockinfo bi;
    block_info(type, row, nb, b, &bi);
    const __m256i q = unpack_vec(type, row, nb, b);
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    /* 16 weights a vector and one vcvtne2ps2bf16 (round to nearest even, as store8; no weight is a
     * float32 denormal, which it would flush) for the block: a quarter of the 256-bit form's work */
    __m512 v[2];
    for (int g = 0; g < 2; g++) {
        const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(halves[g]) : _mm512_cvtepu8_epi32(halves[g]);
        v[g] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(g == 0 ? bi.s0 : bi.s1)),
                             _mm512_set1_ps(bi.add));
    }
    if (out_bf16) {
        _mm512_storeu_si512((uint16_t *)out + at, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    } else {
        _mm512_storeu_ps((float *)out + at, v[0]);
        _mm512_storeu_ps((float *)out + at + 16, v[1]);
    }
#else
    for (int g = 0; g < 4; g++) {
        const __m128i eight = g & 1 ? _mm_srli_si128(halves[g / 2], 8) : halves[g / 2];
        const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(g < 2 ? bi.s0 : bi.s1)),
                                       _mm256_set1_ps(bi.add));
        store8(out, at + 8 * g, v, out_bf16);
    }
#endif
}
#endif

/* A row of nb 32-blocks of type (3-8) at `row` as float32 (out_bf16 = 0) or bf16 at out + at. */
static void dequantize_row(int type, const uint8_t *row, int64_t nb, void *out, int64_t at, int out_bf16) {
#if QK_PATH > 0
    switch (type) {
#define DEQUANTIZE_ROW(T) for (int64_t b = 0; b < nb; b++) dequantize_block(T, row, nb, b, out, at + b * 32, out_bf16)
    case 3: DEQUANTIZE_ROW(3); break;
    case 4: DEQUANTIZE_ROW(4); break;
    case 5: DEQUANTIZE_ROW(5); break;
    case 6: DEQUANTIZE_ROW(6); break;
    case 7: DEQUANTIZE_ROW(7); break;
    default: DEQUANTIZE_ROW(8); break;
#undef DEQUANTIZE_ROW
    }
#else
    const int is_signed = is_signed_type(type);
    for (int64_t b = 0; b < nb; b++) {
        blockinfo bi;
        int8_t q[32];
        block_info(type, row, nb, b, &bi);
        unpack_scalar(type, row, nb, b, q);
        for (int i = 0; i < 32; i++) {
            const float qi = is_signed ? (float)q[i] : (float)(uint8_t)q[i];
            const float v = (i < 16 ? bi.s0 : bi.s1) * qi + bi.add;
            if (out_bf16) ((uint16_t *)out)[at + b * 32 + i] = f32_to_bf16(v);
            else ((float *)out)[at + b * 32 + i] = v;
        }
    }
#endif
}

/* Rows [n0, n1) of w = {address, n, k, type} as float32 (out_bf16 = 0) or bf16, [n1 - n0, k] dense at
 * out. Returns 0, or 1 as quant_linear does (and for packed types: quant_embed gathers their rows). */
int quant_dequantize(const int64_t *w, int64_t n0, int64_t n1, void *out, int out_bf16, int num_threads) {
    const uint8_t *wp = (const uint8_t *)(intptr_t)w[0];
    const int64_t k = w[2];
    const int type = (int)w[3];
    if (!weight_ok(w) || is_packed_type(type) || n0 < 0 || n1 > w[1]) return 1;
    const int64_t row_bytes = k / BLOCK_SIZE[type] * TYPE_SIZE[type];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = n0; r < n1; r++) dequantize_row(type, wp + r * row_bytes, k / 32, out, (r - n0) * k, out_bf16);
    return 0;
}

#endif
