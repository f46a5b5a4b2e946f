/* Narrow KV pages for paged_decode_attention.c: 16-bit (IEEE fp16 and bfloat16), int8 and fp8 E4M3 codes
 * (kv_int8.h holds the page scales and write policy of the two scaled formats). The conversions, and the dot product and V accumulation of
 * TOKENS-token groups read straight from narrow rows.
 *
 * Reads widen in registers (AVX-512F: _mm512_cvtph_ps, 16 lanes; AVX2 with F16C and FMA: _mm256_cvtph_ps,
 * 8 lanes; bfloat16 is the top half of a float32, so it widens by a 16-bit shift; int8 sign-extends and
 * converts, its code -128 reading as NaN; an E4M3 byte moved into an fp16's bit positions is its value
 * times 2^-8, widened as fp16 and scaled back exactly, NaN patched) and accumulate in float32. An int8 row is
 * scaled per 16 channels as it is widened; an fp8 row is read as its codes, its page scale applied by the
 * caller once per score and per probability. Every build also has the scalar path (the remainder of a row, and the whole row without AVX);
 * `kv_half_isa()` names the widest path the build took, so the tests can check each narrowed build really
 * ran its own. Writes round to nearest even, as torch's `.to(float16 / bfloat16)` does, bit for bit
 * (subnormals kept, overflow to infinity, NaN stays NaN). */
#ifndef KL_KV_HALF_H
#define KL_KV_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3, KV_F8 = 4 };

/* a * b + c for the scalar tails, fused wherever the target has FMA. Left to -ffp-contract=fast, whether a
 * tail is fused is the compiler's choice per copy of the loop, and the copies for two formats may choose
 * differently: the AVX2 build on a Zen 4 machine (-march=native -mno-avx512f) gave a row of fp8 codes and the
 * same row widened to bf16 different bits, where Sapphire Rapids' build did not. Without FMA nothing can be
 * fused, so the plain expression is as fixed. */
static inline float kv_fma(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* The int8 code outside the symmetric range [-127, 127]: a NaN stored into an int8 page. */
#define KV_I8_NAN (-128)
/* Channels per int8 scale (kv_cache.INT8_GROUP); a multiple of every ISA's float lanes (16, 8). */
#define KV_I8_GROUP 16

static inline int int8_groups(int head_dim) { return (head_dim + KV_I8_GROUP - 1) / KV_I8_GROUP; }

static inline int64_t kv_element_bytes(int format) {
    return format == KV_F32 ? 4 : format == KV_I8 || format == KV_F8 ? 1 : 2;
}

/* int8 and fp8 pages hold codes with one float32 scale per page and KV head. */
static inline int kv_scaled(int format) { return format == KV_I8 || format == KV_F8; }

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 is exact in float32 */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return bits_float(sign | 0x7f800000 | mantissa << 13); /* inf, NaN */
    return bits_float(sign | (exponent + 112) << 23 | mantissa << 13);        /* rebias 15 -> 127 */
}

static inline uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)(u >> 16 | 0x40); /* NaN: keep it a (quiet) NaN */
    return (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16);                /* ties to the even neighbour */
}

static inline uint16_t float_to_f16(float f) {
    const uint32_t u = float_bits(f), sign = u >> 16 & 0x8000, magnitude = u & 0x7fffffff;
    if (magnitude > 0x7f800000) return (uint16_t)(sign | 0x7e00 | (magnitude >> 13 & 0x3ff)); /* NaN */
    if (magnitude >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and up: ties away from 65504 */
    if (magnitude < 0x38800000) {
        /* Below 2^-14 the result is subnormal, a count of 2^-24 steps: adding 0.5 (whose ulp is 2^-24)
         * rounds |f| to that step by the FPU's own nearest-even rounding, and the count is the difference
         * of the bit patterns. */
        return (uint16_t)(sign | (float_bits(bits_float(magnitude) + 0.5f) - 0x3f000000u));
    }
    /* Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a carry out of the
     * mantissa correctly bumps the exponent. */
    return (uint16_t)(sign | (magnitude + 0xc8000fffu + (magnitude >> 13 & 1)) >> 13);
}

/* An E4M3 (fn: no infinities, S.1111.111 is NaN) byte: its exponent and mantissa fields sit in an fp16's
 * at a bias 8 lower, so the fp16 of those bits is the value times 2^-8, subnormals included. */
static inline uint16_t e4m3_as_f16(uint8_t b) { return (uint16_t)((b & 0x80) << 8 | (b & 0x7f) << 7); }

static inline float e4m3_to_float(uint8_t b) {
    return (b & 0x7f) == 0x7f ? NAN : f16_to_float(e4m3_as_f16(b)) * 256.0f;
}

/* Round to nearest even into E4M3 as torch's `.to(torch.float8_e4m3fn)` does, bit for bit (c10's
 * fp8e4m3fn_from_fp32_value): magnitudes from 480 up and NaN become NaN with the input's sign (the page
 * write clamps to +-448 first), below 2^-6 a count of 2^-9 steps. */
static inline uint8_t float_to_e4m3(float f) {
    uint32_t u = float_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t result;
    if (u >= 0x43f00000u) { /* >= 480, inf, NaN */
        result = 0x7f;
    } else if (u < (121u << 23)) { /* below 2^-6: adding 2^14 (ulp 2^-9) makes the FPU round to the grid */
        result = (uint8_t)(float_bits(bits_float(u) + bits_float(141u << 23)) - (141u << 23));
    } else {
        const uint32_t odd = (u >> 20) & 1;
        result = (uint8_t)((u - (120u << 23) + 0x7ffff + odd) >> 20); /* rebias 127 -> 7 */
    }
    return (uint8_t)(result | sign >> 24);
}

static inline float half_to_float(int format, uint16_t h) {
    return format == KV_F16 ? f16_to_float(h) : bf16_to_float(h);
}

/* Element d of a narrow row (an int8 or fp8 row gives its code, unscaled). */
static inline float kv_to_float(int format, const void *row, int d) {
    if (format == KV_I8) {
        const int8_t c = ((const int8_t *)row)[d];
        return c == KV_I8_NAN ? NAN : (float)c;
    }
    if (format == KV_F8) return e4m3_to_float(((const uint8_t *)row)[d]);
    return half_to_float(format, ((const uint16_t *)row)[d]);
}

/* A row of n floats stored as 16-bit values. */
static inline void store_half_row(int format, const float *restrict src, int n, uint16_t *restrict dst) {
    int d = 0;
#if defined(__F16C__)
    if (format == KV_F16)
        for (; d + 8 <= n; d += 8)
            _mm_storeu_si128((__m128i *)(dst + d),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; d < n; ++d) dst[d] = format == KV_F16 ? float_to_f16(src[d]) : float_to_bf16(src[d]);
}

#if defined(__AVX512F__)
#define KV_LANES 16
typedef __m512 kv_vec;
static inline kv_vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline kv_vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, kv_vec v) { _mm512_storeu_ps(p, v); }
static inline kv_vec vec_set1(float x) { return _mm512_set1_ps(x); }
static inline kv_vec vec_fmadd(kv_vec a, kv_vec b, kv_vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline kv_vec vec_mul(kv_vec a, kv_vec b) { return _mm512_mul_ps(a, b); }
static inline float vec_sum(kv_vec v) { return _mm512_reduce_add_ps(v); }
static inline kv_vec vec_load_kv(int format, const void *row, int d) {
    if (format == KV_I8) {
        const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + d)));
        const __mmask16 nan = _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(KV_I8_NAN));
        return _mm512_mask_blend_ps(nan, _mm512_cvtepi32_ps(c), _mm512_set1_ps(NAN));
    }
    if (format == KV_F8) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)row + d)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
        /* S.1111.111 (NaN) became 1.875 in fp16: raising its exponent field to 31 makes it an fp16 NaN */
        const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
        h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    if (format == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline const char *kv_half_isa(void) { return "avx512"; }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KV_LANES 8
typedef __m256 kv_vec;
static inline kv_vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline kv_vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, kv_vec v) { _mm256_storeu_ps(p, v); }
static inline kv_vec vec_set1(float x) { return _mm256_set1_ps(x); }
static inline kv_vec vec_fmadd(kv_vec a, kv_vec b, kv_vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline kv_vec vec_mul(kv_vec a, kv_vec b) { return _mm256_mul_ps(a, b); }
static inline float vec_sum(kv_vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline kv_vec vec_load_kv(int format, const void *row, int d) {
    if (format == KV_I8) {
        const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + d)));
        const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, _mm256_set1_epi32(KV_I8_NAN)));
        return _mm256_blendv_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(NAN), nan);
    }
    if (format == KV_F8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)row + d)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
        const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
        h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
    if (format == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline const char *kv_half_isa(void) { return "avx2"; }
#else
static inline const char *kv_half_isa(void) { return "scalar"; }
#endif

#if defined(__GNUC__)
#define KV_INLINE inline __attribute__((always_inline))
#else
#define KV_INLINE inline
#endif

/* Rows of one KV head that one pass reads together (the caller's TOKENS), and the query heads of that KV head
 * it serves at once. Each row is widened (and, for int8, scaled) once per pass for all of those heads, not
 * once per head: with GQA the widening cost per head per element was what bounded the narrow formats (the
 * AVX-512 build read int8 pages at under a fifth of the machine's read bandwidth). The KV_HEADS_PER_PASS x
 * KV_ROWS accumulators take 16 of AVX-512's 32 registers, 8 of AVX2's 16. */
#define KV_ROWS 4
#if defined(KV_LANES) && KV_LANES == 8
#define KV_HEADS_PER_PASS 2
#else
#define KV_HEADS_PER_PASS 4
#endif

/* The sums of four vectors, into dst[0..3]: a transposing add tree, 14 shuffles and adds on AVX-512 where four
 * separate reductions take 32 (they were a third of a pass's instructions). */
#if defined(__AVX512F__)
static inline void vec_sum4(const kv_vec a[4], float *dst) {
    /* halves: r01 lanes 0-7 hold a0's 8-lane partial sums, lanes 8-15 a1's */
    const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xee));
    const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xee));
    /* quarters: quarter j holds a_j's 4-lane partial sums */
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88), _mm512_shuffle_f32x4(r01, r23, 0xdd));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e)); /* + the other pair of the quarter */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1)); /* + the neighbour: every lane of quarter j is a_j's sum */
    const __m512 firsts = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v);
    _mm_storeu_ps(dst, _mm512_castps512_ps128(firsts));
}
#elif defined(KV_LANES)
static inline void vec_sum4(const kv_vec a[4], float *dst) {
    /* lanes 0-3 of the 128-bit half h: a_0..a_3's sums over that half's four lanes */
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(dst, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#endif

/* Channel d of a row as the reads use it: widened, times its group's scale for int8 (`scales` the row's, one
 * per KV_I8_GROUP channels; NULL and never read for the other formats, fp8's page scale being the caller's). */
static inline float row_element(int format, const void *row, const float *scales, int d) {
    if (format == KV_F32) return ((const float *)row)[d];
    const float x = kv_to_float(format, row, d);
    return format == KV_I8 ? x * scales[d / KV_I8_GROUP] : x;
}

#ifdef KV_LANES
static inline kv_vec vec_load_row(int format, const void *row, const float *scales, int d) {
    if (format == KV_F32) return vec_load((const float *)row + d);
    const kv_vec x = vec_load_kv(format, row, d);
    /* KV_I8_GROUP is a multiple of the lanes: one scale per vector */
    return format == KV_I8 ? vec_mul(x, vec_set1(scales[d / KV_I8_GROUP])) : x;
}
#endif

/* Scores of nt (KV_ROWS or 1) rows of one KV head, k[i] (int8: with its group scales ks[i], else NULL),
 * against nh (KV_HEADS_PER_PASS or 1) query rows q + h * q_row: s[h * s_row + i]. Called with constant nh and
 * nt, so the accumulators live in registers. */
static KV_INLINE void score_rows(int format, int nh, int nt, const float *restrict q, int64_t q_row,
                                 const void *const *k, const float *const *ks, int head_dim, float *restrict s,
                                 int64_t s_row) {
    int d = 0;
#ifdef KV_LANES
    kv_vec acc[KV_HEADS_PER_PASS][KV_ROWS];
    for (int h = 0; h < nh; ++h)
        for (int i = 0; i < nt; ++i) acc[h][i] = vec_zero();
    for (; d + KV_LANES <= head_dim; d += KV_LANES) {
        kv_vec kv[KV_ROWS];
        for (int i = 0; i < nt; ++i) kv[i] = vec_load_row(format, k[i], ks[i], d);
        for (int h = 0; h < nh; ++h) {
            const kv_vec qv = vec_load(q + h * q_row + d);
            for (int i = 0; i < nt; ++i) acc[h][i] = vec_fmadd(qv, kv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < nh; ++h) {
        if (nt == KV_ROWS)
            vec_sum4(acc[h], s + h * s_row);
        else
            for (int i = 0; i < nt; ++i) s[h * s_row + i] = vec_sum(acc[h][i]);
    }
#else
    for (int h = 0; h < nh; ++h)
        for (int i = 0; i < nt; ++i) s[h * s_row + i] = 0.0f;
#endif
    for (; d < head_dim; ++d)
        for (int i = 0; i < nt; ++i) {
            const float x = row_element(format, k[i], ks[i], d);
            for (int h = 0; h < nh; ++h) s[h * s_row + i] = kv_fma(q[h * q_row + d], x, s[h * s_row + i]);
        }
}

/* acc[h * acc_row + d] += sum_i p[h * p_row + i] * p_scale * v_i[d] over nt rows of one KV head (int8: scaled
 * per group, vs[i]; else NULL) for nh query heads; p_scale is fp8's page scale, 1 otherwise. */
static KV_INLINE void accumulate_rows(int format, int nh, int nt, float *restrict acc, int64_t acc_row,
                                      const float *restrict p, int64_t p_row, float p_scale, const void *const *v,
                                      const float *const *vs, int head_dim) {
    int d = 0;
#ifdef KV_LANES
    kv_vec w[KV_HEADS_PER_PASS][KV_ROWS];
    for (int h = 0; h < nh; ++h)
        for (int i = 0; i < nt; ++i) w[h][i] = vec_set1(p[h * p_row + i] * p_scale);
    for (; d + KV_LANES <= head_dim; d += KV_LANES) {
        kv_vec x[KV_ROWS];
        for (int i = 0; i < nt; ++i) x[i] = vec_load_row(format, v[i], vs[i], d);
        for (int h = 0; h < nh; ++h) {
            kv_vec a = vec_load(acc + h * acc_row + d);
            for (int i = 0; i < nt; ++i) a = vec_fmadd(w[h][i], x[i], a);
            vec_store(acc + h * acc_row + d, a);
        }
    }
#endif
    for (; d < head_dim; ++d)
        for (int h = 0; h < nh; ++h) {
            float a = acc[h * acc_row + d];
            for (int i = 0; i < nt; ++i)
                a = kv_fma(p[h * p_row + i] * p_scale, row_element(format, v[i], vs[i], d), a);
            acc[h * acc_row + d] = a;
        }
}

#endif
