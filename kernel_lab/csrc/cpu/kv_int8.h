/* int8 and fp8 E4M3 KV pages for paged_decode_attention.c: project 05's page-scale write policy.
 *
 * A page of one KV head holds int8 codes and one float32 scale (`[num_blocks, num_kv_heads]` beside the
 * cache); an element means code * scale, the code -128 (outside the symmetric range) means NaN. The scale
 * is the smallest power of two >= amax / 127 (at least 2^-126) over the finite elements the page and head
 * has received; a token whose amax needs a larger scale first requantises the page's codes to it
 * (round(code * old / new), nearest even; a page whose old scale is 0 holds no data and is zero-filled).
 * This is kernel_lab/ops/kv_cache.py's policy (`write_kv_reference`) applied one token at a time, bit for bit:
 * power-of-two scales make x / scale and code * ratio exact, so the only roundings are the two to an integer.
 * +-inf saturates to +-127 codes; NaN takes no part in a scale and is stored as -128.
 *
 * fp8 pages are project 05's format under the same policy with 448 for 127: codes are E4M3 (x / scale
 * clamped to +-448, rounded to nearest even as torch's cast, kv_half.h), requantisation rounds
 * code * old / new to E4M3, and NaN is E4M3's own NaN, kept through requantisation with its sign. */
#ifndef KL_KV_INT8_H
#define KL_KV_INT8_H

#include <math.h>
#include <stdint.h>

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

/* A stored code rescaled by `ratio` (old / new scale, a power of two below 1): the page's requantisation. */
static inline uint8_t requantised_code(int format, uint8_t code, float ratio) {
    if (format == KV_I8) {
        const int8_t c = (int8_t)code;
        return (uint8_t)(c == KV_I8_NAN ? KV_I8_NAN : (int8_t)nearbyintf((float)c * ratio));
    }
    return (code & 0x7f) == 0x7f ? code : float_to_e4m3(e4m3_to_float(code) * ratio);
}

/* One token's row of one KV head into its int8 or fp8 page: `page` is the page's row 0 for this head, rows
 * `stride_token` bytes apart, the token at row `offset`; `scale` the page and head's scale, raised (and the
 * page requantised) when the row needs more range. */
static inline void write_scaled_row(int format, const float *restrict x, int head_dim, uint8_t *page,
                                    int64_t stride_token, int block_size, int offset, float *scale) {
    float amax = 0.0f;
    for (int d = 0; d < head_dim; ++d) {
        const float a = fabsf(x[d]);
        if (a <= 3.40282347e38f && a > amax) amax = a; /* finite only: false for NaN and inf */
    }
    const float old = *scale, grown = pow2_page_scale(amax, format == KV_I8 ? KV_I8_MAX : KV_F8_MAX);
    if (grown > old) {
        const float ratio = old > 0.0f ? old / grown : 0.0f;
        for (int t = 0; t < block_size; ++t) {
            uint8_t *r = page + t * stride_token;
            for (int d = 0; d < head_dim; ++d) r[d] = old > 0.0f ? requantised_code(format, r[d], ratio) : 0;
        }
        *scale = grown;
    }
    uint8_t *dst = page + offset * stride_token;
    const float s = *scale;
    if (format == KV_I8)
        for (int d = 0; d < head_dim; ++d) dst[d] = (uint8_t)int8_code(x[d], s);
    else
        for (int d = 0; d < head_dim; ++d) dst[d] = fp8_code(x[d], s);
}

#endif
