/* int8 and fp8 E4M3 KV pages for paged_decode_attention.c.
 *
 * int8 pages (issue 35): one float32 scale per token, KV head and group of KV_I8_GROUP channels
 * (`[num_blocks, block_size, num_kv_heads, groups]` beside the cache), as llama.cpp's q8_0 keeps one per 32
 * weights. A token's row of one KV head is written once, each group with its own scale s = amax / 127 over the
 * group's finite elements (one IEEE division; at least 2^-126; 0 for a group with none) and codes round(x / s)
 * to nearest even, clamped to [-127, 127]; the code
 * -128 (outside the symmetric range) means NaN, +-inf saturates to +-127. An element means code * s, so
 * |x - code * s| <= s / 2 (plus float32's rounding of the division and the product). Nothing is ever
 * requantised: a later token (or a rejected draft's) cannot move another token's codes, and a token that
 * holds little (the first, attention-sink token of SmolLM2 has a row amax a third of its page's) keeps
 * 8 bits of its own range, not of its page's largest row. K and V rows are rotated by a Hadamard matrix
 * first (hadamard_rotate below): a query that reads K is rotated the same way, and the attention output
 * (a sum of rotated V rows) is rotated back once per head. This is
 * kernel_lab/ops/kv_cache.py's int8 write (`write_kv_reference`), bit for bit.
 *
 * fp8 pages keep project 05's format, shared with the CUDA kernels: one float32 scale per page and KV head
 * (`[num_blocks, num_kv_heads]`), the smallest power of two >= amax / 448 (at least 2^-126) over the finite
 * elements the page and head has received; a token whose amax needs a larger scale first requantises the
 * page's codes to it (E4M3 of code * old / new, nearest even; a page whose old scale is 0 holds no data and is
 * zero-filled). Codes are E4M3 of x / scale clamped to +-448, rounded to nearest even as torch's cast
 * (kv_half.h); NaN is E4M3's own NaN, kept through requantisation with its sign. Power-of-two scales make
 * x / scale and code * ratio exact, so the only roundings are the ones to E4M3. */
#ifndef KL_KV_INT8_H
#define KL_KV_INT8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_half.h"

#define KV_I8_MAX 127.0f
#define KV_F8_MAX 448.0f

/* The smallest power of two >= amax / code_max, at least 2^-126; 0 for amax 0 (kv_cache.pow2_scale). */
static inline float pow2_page_scale(float amax, float code_max) {
    if (!(amax > 0.0f)) return 0.0f;
    const uint32_t bits = float_bits(amax / code_max), exponent = bits >> 23;
    if (exponent == 0) return bits_float(1u << 23); /* below the normal range: 2^-126 */
    return bits_float(((bits & 0x7fffffu) ? exponent + 1 : exponent) << 23);
}

/* x / scale rounded to nearest even into [-127, 127] (NaN -> the NaN code; scale 0 stores 0). */
static inline int8_t int8_code(float x, float scale) {
    if (isnan(x)) return KV_I8_NAN;
    if (!(scale > 0.0f)) return 0;
    const float c = x / scale;
    return (int8_t)nearbyintf(c > KV_I8_MAX ? KV_I8_MAX : c < -KV_I8_MAX ? -KV_I8_MAX : c);
}

/* E4M3 of x / scale clamped to +-448 (NaN stays NaN whatever the scale; scale 0 stores +0). */
static inline uint8_t fp8_code(float x, float scale) {
    if (isnan(x)) return float_to_e4m3(x);
    if (!(scale > 0.0f)) return 0;
    const float c = x / scale;
    return float_to_e4m3(c > KV_F8_MAX ? KV_F8_MAX : c < -KV_F8_MAX ? -KV_F8_MAX : c);
}

/* A stored fp8 code rescaled by `ratio` (old / new scale, a power of two below 1): the page's requantisation. */
static inline uint8_t requantised_fp8_code(uint8_t code, float ratio) {
    return (code & 0x7f) == 0x7f ? code : float_to_e4m3(e4m3_to_float(code) * ratio);
}

/* The largest magnitude among a row's finite elements (0 if none: NaN and inf never set a scale). */
static inline float finite_amax(const float *restrict x, int n) {
    float amax = 0.0f;
    for (int d = 0; d < n; ++d) {
        const float a = fabsf(x[d]);
        if (a <= 3.40282347e38f && a > amax) amax = a; /* finite only: false for NaN and inf */
    }
    return amax;
}

/* An int8 row's own scale: amax / 127, at least 2^-126; 0 for amax 0 (kv_cache.int8_token_scale). */
static inline float int8_token_scale(float amax) {
    if (!(amax > 0.0f)) return 0.0f;
    const float s = amax / KV_I8_MAX;
    return s < 1.17549435e-38f ? 1.17549435e-38f : s;
}

/* int8 K and V rows are stored Walsh-Hadamard-rotated (kernel_lab/ops/kv_cache.py's docstring says why): Sylvester's
 * unnormalised Hadamard matrix H (entries +-1, H H = n I) on blocks of `hadamard_block(head_dim)` channels,
 * the largest power of two dividing head_dim (all 64 of a 64-wide head). */
static inline int hadamard_block(int head_dim) { return head_dim & -head_dim; }

/* x <- H x in place, block by block: log2(block) butterfly passes, in the order kv_cache.hadamard_rotate
 * takes them (the same float32 additions, so the same bits). */
static inline void hadamard_rotate(float *x, int n) {
    const int block = hadamard_block(n);
    for (int base = 0; base < n; base += block)
        for (int h = 1; h < block; h *= 2)
            for (int i = base; i < base + block; i += 2 * h)
                for (int j = i; j < i + h; ++j) {
                    const float a = x[j], b = x[j + h];
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
}

/* One token's row of one KV head (K or V) into int8 pages with its own scales (`scales`, the token and head's
 * int8_groups(head_dim)): `rotated`, head_dim floats of scratch, is where H x is formed and quantised. */
static inline void write_int8_row(const float *restrict x, int head_dim, int8_t *restrict dst, float *scales,
                                  float *restrict rotated) {
    memcpy(rotated, x, (size_t)head_dim * sizeof(float));
    hadamard_rotate(rotated, head_dim);
    x = rotated;
    for (int lo = 0, g = 0; lo < head_dim; lo += KV_I8_GROUP, ++g) {
        const int n = head_dim - lo < KV_I8_GROUP ? head_dim - lo : KV_I8_GROUP;
        const float s = int8_token_scale(finite_amax(x + lo, n));
        scales[g] = s;
        for (int d = lo; d < lo + n; ++d) dst[d] = int8_code(x[d], s);
    }
}

/* One token's row of one KV head into its fp8 page: `page` is the page's row 0 for this head, rows
 * `stride_token` bytes apart, the token at row `offset`; `scale` the page and head's scale, raised (and the
 * page requantised) when the row needs more range. */
static inline void write_fp8_row(const float *restrict x, int head_dim, uint8_t *page, int64_t stride_token,
                                 int block_size, int offset, float *scale) {
    const float old = *scale, grown = pow2_page_scale(finite_amax(x, head_dim), KV_F8_MAX);
    if (grown > old) {
        const float ratio = old > 0.0f ? old / grown : 0.0f;
        for (int t = 0; t < block_size; ++t) {
            uint8_t *r = page + t * stride_token;
            for (int d = 0; d < head_dim; ++d) r[d] = old > 0.0f ? requantised_fp8_code(r[d], ratio) : 0;
        }
        *scale = grown;
    }
    uint8_t *dst = page + offset * stride_token;
    const float s = *scale;
    for (int d = 0; d < head_dim; ++d) dst[d] = fp8_code(x[d], s);
}

#endif
