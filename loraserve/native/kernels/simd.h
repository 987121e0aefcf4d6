/* The SIMD vocabulary the package's C kernels share: bf16 <-> float32 conversions, lane masks, and one
 * vector type `vf` of W float32 lanes with the operations on it (loads and stores of n lanes, bf16
 * widening and rounding, horizontal sums, e^x). Included by every kernel; build.py compiles each one
 * next to a copy of this file and puts its bytes into every kernel's cache key.
 *
 * The vector width is the build's, from the compiler's feature macros (-march=native makes that the
 * runtime dispatch on CPU flags): W = 16 with AVX-512 F + BW + VL, 8 with AVX2 + FMA, else 1 (portable
 * C, where vf is a float). The width-specific primitives below (masks, bf16 widening of one register)
 * need only the features they use, so a kernel whose own paths need less (gemm's float32 AVX-512) can
 * call them.
 *
 * bf16 rounding is to nearest even everywhere. Where a NaN may carry non-zero low bits, the rounding
 * keeps it a quiet NaN (the `vbf16_round_hi` / `f32_to_bf16` forms); `vbf16_round_hi_finite` skips that
 * fix for lanes whose NaNs have zero low bits (read from bf16, or made by arithmetic on such values:
 * x86 keeps the input's payload and its default NaN is 0xffc00000), which is what fused_kernel.c
 * rounds and why it may.
 */
#ifndef LORASERVE_SIMD_H
#define LORASERVE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; a NaN stays a (quiet) NaN instead of rounding into inf. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u | 0x400000u) >> 16);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
/* The first min(n, 16) lanes (none when n <= 0). */
static inline __mmask16 mask16_first(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u));
}
/* 16 bf16 values as float32. */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#ifdef __AVX512BW__
/* The first min(n, 32) lanes (none when n <= 0): 32 bf16 values in one register. */
static inline __mmask32 mask32_first(int64_t n) {
    return n >= 32 ? 0xffffffffu : (n <= 0 ? 0u : (__mmask32)((1ull << n) - 1u));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define W 16
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vmask;
/* Lanes a <= j < b. */
static inline vmask vrange(int64_t a, int64_t b) {
    a = a < 0 ? 0 : (a > W ? W : a), b = b < 0 ? 0 : (b > W ? W : b);
    return (vmask)(((1u << b) - 1u) & ~((1u << a) - 1u));
}
/* The first n lanes from p (0 past them); vstore writes the first n lanes only. */
static inline vf vload(const float *p, int64_t n) {
    return n >= W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(vrange(0, n), p);
}
static inline vf vload_bf16(const uint16_t *p, int64_t n) {
    return bf16x16_to_f32(n >= W ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(vrange(0, n), p));
}
static inline void vstore(float *p, vf x, int64_t n) {
    if (n >= W) _mm512_storeu_ps(p, x); else _mm512_mask_storeu_ps(p, vrange(0, n), x);
}
static inline vi vi_loadu(const void *p) { return _mm512_loadu_si512(p); }
static inline void vi_storeu(void *p, vi x) { _mm512_storeu_si512(p, x); }
/* Each lane rounded to bf16 (NaN kept quiet), the bf16 in the lane's high half; the low half is junk. */
static inline vi vbf16_round_hi(vf x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}
/* The first n lanes rounded to bf16 (nearest even, NaN kept quiet) at p. */
static inline void vstore_bf16(uint16_t *p, vf x, int64_t n) {
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(vbf16_round_hi(x), 16));
    if (n >= W) _mm256_storeu_si256((__m256i *)p, h); else _mm256_mask_storeu_epi16(p, (__mmask16)vrange(0, n), h);
}
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfma _mm512_fmadd_ps
#define vhsum _mm512_reduce_add_ps
#define vhmax _mm512_reduce_max_ps
#define vabs _mm512_abs_ps
#define vi_and _mm512_and_si512
#define vi_or _mm512_or_si512
#define vi_set1 _mm512_set1_epi32
#define vi_add _mm512_add_epi32
#define vi_srli _mm512_srli_epi32
#define vi_slli _mm512_slli_epi32
#define vi_as_vf _mm512_castsi512_ps
#define vf_as_vi _mm512_castps_si512
static inline vf vselect(vmask m, vf x, vf other) { return _mm512_mask_blend_ps(m, other, x); }
static inline vmask vless(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf y, vf n) { return _mm512_scalef_ps(y, n); } /* y * 2^n */
/* 2W bf16 values (n real) as float32 without widening shuffles: even elements in *a, odd in *b. */
static inline void vload_pair_bf16(const uint16_t *p, int64_t n, vf *a, vf *b) {
    const __m512i x = _mm512_maskz_loadu_epi16(mask32_first(n), p);
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vf;
typedef __m256i vi;
typedef __m256i vmask;
static inline vmask vrange(int64_t a, int64_t b) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_si256(_mm256_cmpgt_epi32(iota, _mm256_set1_epi32((int)a - 1)),
                            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)b), iota));
}
static inline vf vload(const float *p, int64_t n) {
    return n >= W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, vrange(0, n));
}
static inline vf vload_bf16(const uint16_t *p, int64_t n) {
    uint16_t tail[W] = {0};
    if (n < W) memcpy(tail, p, (size_t)n * sizeof(uint16_t));
    const __m128i h = _mm_loadu_si128((const __m128i *)(n >= W ? p : tail));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float *p, vf x, int64_t n) {
    if (n >= W) _mm256_storeu_ps(p, x); else _mm256_maskstore_ps(p, vrange(0, n), x);
}
static inline vi vi_loadu(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_storeu(void *p, vi x) { _mm256_storeu_si256((__m256i *)p, x); }
static inline vi vbf16_round_hi(vf x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
}
static inline void vstore_bf16(uint16_t *p, vf x, int64_t n) {
    const __m256i bits = _mm256_srli_epi32(vbf16_round_hi(x), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    if (n >= W) { _mm_storeu_si128((__m128i *)p, h); return; }
    uint16_t tail[W];
    _mm_storeu_si128((__m128i *)tail, h);
    memcpy(p, tail, (size_t)n * sizeof(uint16_t));
}
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfma _mm256_fmadd_ps
#define vi_and _mm256_and_si256
#define vi_or _mm256_or_si256
#define vi_set1 _mm256_set1_epi32
#define vi_add _mm256_add_epi32
#define vi_srli _mm256_srli_epi32
#define vi_slli _mm256_slli_epi32
#define vi_as_vf _mm256_castsi256_ps
#define vf_as_vi _mm256_castps_si256
static inline float vhsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vselect(vmask m, vf x, vf other) { return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(m)); }
static inline vmask vless(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf y, vf n) { /* n in [-126, 127] (vexp clamps) */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return vmul(y, _mm256_castsi256_ps(e));
}
static inline void vload_pair_bf16(const uint16_t *p, int64_t n, vf *a, vf *b) {
    uint16_t tail[2 * W] = {0};
    if (n < 2 * W && n > 0) memcpy(tail, p, (size_t)n * sizeof(uint16_t));
    const __m256i x = _mm256_loadu_si256((const __m256i *)(n >= 2 * W ? p : tail));
    *a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

#else /* portable C: one lane */
#define W 1
typedef float vf;
typedef int vmask;
static inline vmask vrange(int64_t a, int64_t b) { return a <= 0 && 0 < b; }
static inline vf vload(const float *p, int64_t n) { return n > 0 ? *p : 0.0f; }
static inline vf vload_bf16(const uint16_t *p, int64_t n) { return n > 0 ? bf16_to_f32(*p) : 0.0f; }
static inline void vstore(float *p, vf x, int64_t n) { if (n > 0) *p = x; }
static inline void vstore_bf16(uint16_t *p, vf x, int64_t n) { if (n > 0) *p = f32_to_bf16(x); }
static inline vf vset1(float x) { return x; }
static inline vf vzero(void) { return 0.0f; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vfma(vf a, vf b, vf c) { return fmaf(a, b, c); }
#define vmax fmaxf
#define vmin fminf
static inline float vhsum(vf x) { return x; }
static inline float vhmax(vf x) { return x; }
static inline vf vselect(vmask m, vf x, vf other) { return m ? x : other; }
static inline vmask vless(vf a, vf b) { return a < b; }
#define vabs fabsf
static inline vf vround(vf x) { return nearbyintf(x); }
static inline vf vpow2(vf y, vf n) { return ldexpf(y, (int)n); }
static inline void vload_pair_bf16(const uint16_t *p, int64_t n, vf *a, vf *b) {
    *a = vload_bf16(p, n), *b = vload_bf16(p + 1, n - 1);
}
#endif

#if W > 1
/* bf16 pairs in 32-bit lanes: value 2i in lane i's low half, 2i + 1 in its high half. Widening each
 * half in place is one shift or one mask, and elementwise ops, sums and axpys do not care about the
 * order; vbf16_pack is the way back. */
static inline vf vbf16_even(vi x) { return vi_as_vf(vi_slli(x, 16)); }
static inline vf vbf16_odd(vi x) { return vi_as_vf(vi_and(x, vi_set1((int)0xffff0000u))); }
/* vbf16_round_hi without the NaN fix (see the top of this file for the lanes it is right for). */
static inline vi vbf16_round_hi_finite(vf x) {
    const vi u = vf_as_vi(x);
    return vi_add(u, vi_add(vi_and(vi_srli(u, 16), vi_set1(1)), vi_set1(0x7fff)));
}
/* Two vectors of rounded bf16s in their lanes' high halves as 2W packed bf16 values (even, odd). */
static inline vi vbf16_pack(vi hi_even, vi hi_odd) {
    return vi_or(vi_srli(hi_even, 16), vi_and(hi_odd, vi_set1((int)0xffff0000u)));
}
/* The inverse of vbf16_even / vbf16_odd: 2W bf16 values, each rounded with its NaN kept quiet. */
static inline vi vbf16_narrow(vf even, vf odd) { return vbf16_pack(vbf16_round_hi(even), vbf16_round_hi(odd)); }
#endif

/* e^x = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts, |r| <= ln 2 / 2), e^r
 * from Cephes' polynomial: e^r ~ 1 + r + r^2 p(r), ~1 ulp. x is clamped to [lo, 88] so 2^n stays a
 * normal float. Returns p(r); the two forms below finish it. */
static inline vf vexp_poly(vf x, float lo, vf *n, vf *r) {
    x = vmax(vmin(x, vset1(88.0f)), vset1(lo));
    *n = vround(vmul(x, vset1(1.44269504088896341f)));
    *r = vfma(*n, vset1(-0.693359375f), x);
    *r = vfma(*n, vset1(2.12194440e-4f), *r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, *r, vset1(1.3981999507e-3f));
    p = vfma(p, *r, vset1(8.3334519073e-3f));
    p = vfma(p, *r, vset1(4.1665795894e-2f));
    p = vfma(p, *r, vset1(1.6666665459e-1f));
    return vfma(p, *r, vset1(5.0000001201e-1f));
}

/* e^x on every lane, inputs clamped to [-87.3, 88], the last step p * (r * r) + (r + 1). */
static inline vf vexp(vf x) {
    vf n, r;
    const vf p = vexp_poly(x, -87.3f, &n, &r);
    return vpow2(vfma(p, vmul(r, r), vadd(r, vset1(1.0f))), n);
}

/* The same e^x with inputs clamped to [-87, 88] and the last step (p * r) * r + (r + 1), closer to
 * the order of a scalar `p * r * r + r + 1`: fused_kernel.c's results depend on exactly this form. */
static inline vf vexp_pr(vf x) {
    vf n, r;
    const vf p = vexp_poly(x, -87.0f, &n, &r);
    return vpow2(vfma(vmul(p, r), r, vadd(r, vset1(1.0f))), n);
}

#endif
