/* int8 KV pages for paged_decode_attention.c: project 05's page-scale write policy with int8 codes.
 *
 * A page of one KV head holds int8 codes and one float32 scale (`[num_blocks, num_kv_heads]` beside the
 * cache); an element means code * scale, the code -128 (outside the symmetric range) means NaN. The scale
 * is the smallest power of two >= amax / 127 (at least 2^-126) over the finite elements the page and head
 * has received; a token whose amax needs a larger scale first requantises the page's codes to it
 * (round(code * old / new), nearest even; a page whose old scale is 0 holds no data and is zero-filled).
 * This is kernel_lab/ops/kv_cache.py's policy (`write_kv_reference`) applied one token at a time, bit for bit:
 * power-of-two scales make x / scale and code * ratio exact, so the only roundings are the two to an integer.
 * +-inf saturates to +-127 codes; NaN takes no part in a scale and is stored as -128. */
#ifndef KL_KV_INT8_H
#define KL_KV_INT8_H

#include <math.h>
#include <stdint.h>

#include "kv_half.h"

#define KV_I8_MAX 127.0f

/* The smallest power of two >= amax / 127, at least 2^-126; 0 for amax 0 (kv_cache.pow2_scale). */
static inline float int8_page_scale(float amax) {
    if (!(amax > 0.0f)) return 0.0f;
    const uint32_t bits = float_bits(amax / KV_I8_MAX), exponent = bits >> 23;
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

/* One token's row of one KV head into its int8 page: `page` is the page's row 0 for this head, rows
 * `stride_token` bytes apart, the token at row `offset`; `scale` the page and head's scale, raised (and the
 * page requantised) when the row needs more range. */
static inline void write_int8_row(const float *restrict x, int head_dim, int8_t *page, int64_t stride_token,
                                  int block_size, int offset, float *scale) {
    float amax = 0.0f;
    for (int d = 0; d < head_dim; ++d) {
        const float a = fabsf(x[d]);
        if (a <= 3.40282347e38f && a > amax) amax = a; /* finite only: false for NaN and inf */
    }
    const float old = *scale, grown = int8_page_scale(amax);
    if (grown > old) {
        const float ratio = old > 0.0f ? old / grown : 0.0f;
        for (int t = 0; t < block_size; ++t) {
            int8_t *r = page + t * stride_token;
            for (int d = 0; d < head_dim; ++d)
                r[d] = old > 0.0f ? (r[d] == KV_I8_NAN ? KV_I8_NAN : (int8_t)nearbyintf((float)r[d] * ratio)) : 0;
        }
        *scale = grown;
    }
    int8_t *dst = page + offset * stride_token;
    const float s = *scale;
    for (int d = 0; d < head_dim; ++d) dst[d] = int8_code(x[d], s);
}

#endif
