/* y = x @ W.T on the CPU, with W kept in the GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0 here; the K-quants
 * Q4_K, Q5_K, Q6_K in gguf_kquant_tiles.h, through the same tiles, threads and entry points).
 *
 * Contract: kernel_lab/ops/gguf_linear.py. Plain C with no torch headers, built on first use with the system
 * compiler by kernel_lab/ops/cpu_kernels.py (-march=native) and called through ctypes.
 *
 * Why: a decode step reads every weight once. Dequantized to float32 the bundled model's weights are about
 * 540 MB; in their GGUF blocks about 100 MB (Q4_1: 20 bytes per 32 weights, Q8_0: 34). Computing on the blocks
 * directly cuts the bytes per step about five-fold.
 *
 * How:
 *   - each row of x is quantized per block of 32 to int8: d = amax / 127, q = round(x / d), with s = d * sum(q)
 *     beside d (the Q4_1 minimum, and the Q4_0 and Q8_0 offsets below, multiply the block's sum of x);
 *   - block dot products are integer: u8 x s8 products summed in int32 (VNNI's vpdpbusd, or AVX2's vpmaddubsw
 *     + vpmaddwd), converted to float once per block and scaled by d_w d_x:
 *       Q4_1  sum_j (d_w q_j + m) x_j        ~= d_w d_x idot + m s_x
 *       Q4_0  sum_j d_w (q_j - 8) x_j        ~= d_w d_x idot - 8 d_w s_x
 *       Q8_0  sum_j d_w q_j x_j, with the weight bytes read as q + 128 (unsigned, as vpdpbusd wants):
 *                                            ~= d_w d_x idot' - 128 d_w s_x;
 *   - the weight is regrouped at load into tiles of 8 rows (same bytes, same values: `pack` in gguf_linear.py).
 *     Within a tile each block's 32-byte vectors hold 4 consecutive quants of each of the 8 rows, so one
 *     vpdpbusd against 4 activations broadcast to all lanes advances 8 rows' dot products at once, and a whole
 *     block ends as one vector of 8 int32 dots: one conversion and two FMAs per 8 rows and block, no
 *     horizontal sums, and 8 outputs stored together;
 *   - a weight tile is unpacked once per TILE_M rows of x, so a batch reads the weights from memory once
 *     (the point of batching), and TILE_M independent dependency chains keep the units busy;
 *   - with AVX-512 (VNNI, BW), steps take two tiles at once in 512-bit vectors
 *     (tile_pair_rows): one broadcast of 4 activations feeds 16 rows, where many-row steps were bound by
 *     the broadcasts and loop work; same per-lane operations, same bits;
 *   - tiles are split among a small pthread pool (not OpenMP: torch brings its own runtime), which
 *     kl_parallel_for lends to the paged attention library.
 *
 * Tile layout, per tile of 8 rows and per block b (tiles are contiguous, blocks in order within a tile):
 *   Q4_0  d[8] fp16 | quants 128 B      Q4_1  d[8] fp16 | m[8] fp16 | quants 128 B      Q8_0  d[8] fp16 | quants 256 B
 *   Q4 quants: 4 vectors of 32 B; vector v, lane i (row i) = bytes 4v..4v+3 of row i's GGUF qs, whose low nibbles
 *   are weights 4v..4v+3 and high nibbles weights 16+4v..16+4v+3 (GGUF packs weight j and j + 16 in byte j).
 *   Q8 quants: 8 vectors of 32 B; vector g, lane i = row i's quants 4g..4g+3.
 *   A last partial tile is padded with zero rows (d = 0).
 *
 * The int32 block sums are exact, so every ISA path gives the same products; only float summation order
 * differs between builds, which the tests bound.
 */

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KL_SIMD 1
#else
#define KL_SIMD 0
#endif

#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define QK 32     /* weights per block in all three formats */
#define TILE_N 8  /* weight rows per tile: one int32 lane each in a 256-bit vector */
#define TILE_M 4  /* rows of x per pass over a weight tile */

/* Bytes of one block of one tile (8 rows), and where its parts start. */
static int64_t tile_block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return TILE_N * 18;
    case GGML_Q4_1: return TILE_N * 20;
    case GGML_Q8_0: return TILE_N * 34;
    default: return 0;
    }
}
static inline int quants_offset(int type) { return type == GGML_Q4_1 ? 32 : 16; }

static inline float half_to_float(uint16_t h) {
#if KL_SIMD
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ------------------------------------------------------------------------------------------- activations */

/* Row-wise int8 quantization of x [m, k] (row stride ldx) into q [m, k], d [m, k/32], s [m, k/32]. Plain
 * loops, the same on every ISA, so the rounding is too (ties to even, as torch.round). */
void kl_gguf_quantize_activations(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                                  float *s) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float scale = amax / 127.0f;
            const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            int8_t *qb = q + r * k + b * QK;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(xb[j] * inv);
                qb[j] = (int8_t)v;
                sum += v;
            }
            d[r * nb + b] = scale;
            s[r * nb + b] = scale * (float)sum;
        }
    }
}

typedef struct {
    const int8_t *q;   /* [m, k] */
    const float *d;    /* [m, nb] */
    const float *s;    /* [m, nb] */
    const int32_t *sum16; /* [m, 2 nb]: int sums of q per 16 (Q6_K only, else NULL) */
    int64_t k, nb;
} QuantizedRows;

/* Per row of the tile: the factor of s_x (Q4_1: m; Q4_0: -8 d; Q8_0: -128 d, for the +128 bias). */
/* Software prefetch, for the tile pairs only. A pair reads its two tiles (t, t + 1) side by side: two streams
 * a tile apart. Where the weights do not fit in the last-level cache, the hardware prefetchers fed those two
 * streams poorly: on a Zen 4 VM (32 MiB L3) a one-row step's projections over the bundled model's weights ran
 * at 10 GB/s in pairs, against 17 GB/s for the AVX2 build's single tiles (one stream) on the same machine.
 * The single-tile path has no software prefetch: there it cost 13%. */
static inline void prefetch_span(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* How far ahead of its reads a tile's stream asks for lines, in bytes, in a large pair. */
#ifndef KL_PREFETCH_AHEAD
#define KL_PREFETCH_AHEAD 4096
#endif
/* The largest tile pair whose successor is prefetched as one sequential stream: 32 KiB takes in Q6_K at
 * k = 2048 (a 26880-byte pair; the 1B's lm_head and attn_v), which on a 2-core Zen 4 with huge-page weights ran
 * a one-row GEMV at ~19.5 GB/s this way against ~16.5 with the per-tile streams (C harness, ad hoc). */
#ifndef KL_PREFETCH_PAIR_MAX
#define KL_PREFETCH_PAIR_MAX 32768
#endif

/* The lines a tile pair asks for while it reads `bytes` at offset `off` of each of its tiles (pairs are
 * contiguous). A small pair asks for the next pair, front to back, at the pace it reads itself: one sequential
 * stream. A large pair (the 1B's wide matrices, tiles of tens of KB) would so fetch lines that far ahead of
 * use that L1 evicted them first (it ran 0.82x the pair without prefetch), so each tile's stream asks
 * KL_PREFETCH_AHEAD ahead instead, running on past its tile's end into the next pair's tile of the same
 * stream (t into t + 2, t + 1 into t + 3). */
static inline void prefetch_pair(const uint8_t *tile, int64_t tile_bytes, int64_t off, int64_t bytes) {
    if (2 * tile_bytes <= KL_PREFETCH_PAIR_MAX) {
        prefetch_span(tile + 2 * tile_bytes + 2 * off, 2 * bytes);
        return;
    }
    int64_t at = off + KL_PREFETCH_AHEAD;
    at += at < tile_bytes ? 0 : tile_bytes;
    prefetch_span(tile + at, bytes);
    prefetch_span(tile + tile_bytes + at, bytes);
}

static inline float offset_factor(int type, const uint16_t *halves, int row, float d) {
    if (type == GGML_Q4_1) return half_to_float(halves[TILE_N + row]);
    return (type == GGML_Q4_0 ? -8.0f : -128.0f) * d;
}

/* --------------------------------------------------------------------------------------- tile kernel (SIMD) */
#if KL_SIMD
/* acc + the int32 sums of 4 u8 x s8 products per lane. */
static inline __m256i dot_accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    /* A pair of products fits int16 for Q4 (2 * 15 * 127); Q8_0 takes the sign route in tile_rows instead. */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
#define KL_Q8_SIGNED_PAIRS 1  /* no VNNI: (q + 128) x could overflow vpmaddubsw's int16 pairs; use |q| and sign */
#endif

static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* acc + the int32 sums of groups 0..n-1, w[g] (u8) against x[4g..4g+3] (s8, |x| <= 127) broadcast to all
 * lanes. With VNNI one vpdpbusd per group. With AVX2 alone, vpmaddubsw's int16 pair sums are added in int16
 * for `per_int16` groups before one vpmaddwd widens them, instead of widening every group: a third fewer
 * instructions per group, and the same int32 sums, exact while per_int16 x 2 x wmax x 127 fits int16
 * (4-bit weights: 8 groups, 30480; 5-bit: 4, 31496; 6-bit: 2, 32004). */
static inline __attribute__((always_inline)) __m256i dot_groups(__m256i acc, const __m256i *w, const int8_t *xq,
                                                                const int n, const int per_int16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    (void)per_int16;
    for (int g = 0; g < n; g++) acc = dot_accumulate(acc, w[g], broadcast4(xq + 4 * g));
#else
    for (int g0 = 0; g0 < n; g0 += per_int16) {
        __m256i pairs = _mm256_maddubs_epi16(w[g0], broadcast4(xq + 4 * g0));
        for (int g = g0 + 1; g < g0 + per_int16 && g < n; g++)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[g], broadcast4(xq + 4 * g)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return acc;
}

/* One tile (8 weight rows) against rows [r0, r0 + MR) of x: out[r * ldo + i] = dot(row i, x row r0 + r).
 * MR is a constant at every call site, so its loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_rows(int type, const uint8_t *tile, const QuantizedRows *x,
                                                             int64_t r0, const int MR, float *out, int64_t ldo) {
    const int64_t nb = x->nb, tbb = tile_block_bytes(type);
    const int nvec = type == GGML_Q8_0 ? 8 : 4;
    __m256 acc[TILE_M];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tbb;
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 off = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                           : _mm256_mul_ps(wd, _mm256_set1_ps(type == GGML_Q4_0 ? -8.0f : -128.0f));
        const uint8_t *quants = blk + quants_offset(type);
        /* w[g]: the u8 operand for activation group g (4 consecutive x values). */
        __m256i w[8];
        if (type == GGML_Q8_0) {
            for (int g = 0; g < 8; g++) w[g] = _mm256_loadu_si256((const __m256i *)(quants + 32 * g));
        } else {
            const __m256i low = _mm256_set1_epi8(0x0f);
            for (int v = 0; v < nvec; v++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(quants + 32 * v));
                w[v] = _mm256_and_si256(raw, low);
                w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
        }
        for (int r = 0; r < MR; r++) {
            const int64_t row = r0 + r;
            const int8_t *xq = x->q + row * x->k + b * QK;
            __m256i idot = _mm256_setzero_si256();
            /* Q4: groups 0-3 are weights 0-15 (low nibbles), groups 4-7 weights 16-31 (high nibbles). */
            if (type != GGML_Q8_0) {
                idot = dot_groups(idot, w, xq, 8, 8);
            } else {
                for (int g = 0; g < 8; g++) {
                    __m256i xs = broadcast4(xq + 4 * g);
#ifdef KL_Q8_SIGNED_PAIRS
                    idot = dot_accumulate(idot, _mm256_sign_epi8(w[g], w[g]), _mm256_sign_epi8(xs, w[g]));
#else
                    idot = dot_accumulate(idot, _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80)), xs);
#endif
                }
            }
            const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(x->d[row * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), scale, acc[r]);
#ifdef KL_Q8_SIGNED_PAIRS
            if (type == GGML_Q8_0) continue;  /* the signed route has no +128 bias to take back */
#endif
            acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(x->s[row * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KL_PAIR_TILES 1
/* Rows of x per pass over a tile pair. Every step takes pairs where two full tiles are left. Measured on a
 * 2-core Sapphire Rapids (two 512-bit FMA ports), a step's projections against the single-tile path: 5-16%
 * faster at 2-8 rows with Q4_0/Q4_1/Q8_0 and 10-40% with the K-quants, 3-14% faster at one row (Q8_0 unchanged),
 * prefill unchanged. 8 rows a pass take a speculative verify's k + 1 <= 8 rows in one pass over the weights
 * rather than 4 + 1. (An earlier Xeon, with the 4-row passes, had measured pairs slower below 5 rows.) */
#define PAIR_M 8
static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 halves_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

/* Two adjacent full tiles (16 weight rows) against rows [r0, r0 + MR) of x, in 512-bit vectors: lanes 0-7
 * are the first tile's rows, 8-15 the second's. Each broadcast group of 4 activations then feeds 16 rows'
 * dot products in one vpdpbusd instead of 8, which halves the broadcasts and the loop's other work per
 * product; on many-row steps (prefill, large batches) the kernel is bound by exactly that work. Every lane
 * does tile_rows' operations in tile_rows' order, so the results are the same bits. */
static inline __attribute__((always_inline)) void tile_pair_rows(int type, const uint8_t *tile, int64_t tile_bytes,
                                                                  const QuantizedRows *x, int64_t r0, const int MR,
                                                                  float *out, int64_t ldo) {
    const int64_t nb = x->nb, tbb = tile_block_bytes(type);
    const uint8_t *next = tile + tile_bytes;
    __m512 acc[PAIR_M];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tbb, *blk2 = next + b * tbb;
        if (r0 == 0) prefetch_pair(tile, tile_bytes, b * tbb, tbb);
        const __m512 wd = halves_pair(blk, blk2);
        const __m512 off = type == GGML_Q4_1 ? halves_pair(blk + 16, blk2 + 16)
                           : _mm512_mul_ps(wd, _mm512_set1_ps(type == GGML_Q4_0 ? -8.0f : -128.0f));
        const uint8_t *quants = blk + quants_offset(type), *quants2 = blk2 + quants_offset(type);
        __m512i w[8];
        if (type == GGML_Q8_0) {
            for (int g = 0; g < 8; g++)
                w[g] = _mm512_xor_si512(load_pair(quants + 32 * g, quants2 + 32 * g), _mm512_set1_epi8((char)0x80));
        } else {
            const __m512i low = _mm512_set1_epi8(0x0f);
            for (int v = 0; v < 4; v++) {
                const __m512i raw = load_pair(quants + 32 * v, quants2 + 32 * v);
                w[v] = _mm512_and_si512(raw, low);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        }
        for (int r = 0; r < MR; r++) {
            const int64_t row = r0 + r;
            const int8_t *xq = x->q + row * x->k + b * QK;
            __m512i idot = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                int32_t v;
                memcpy(&v, xq + 4 * g, sizeof v);
                idot = _mm512_dpbusd_epi32(idot, w[g], _mm512_set1_epi32(v));
            }
            const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(x->d[row * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(x->s[row * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#endif
#else
/* Quant j (0..31) of row i in a tile block, as the unsigned value the SIMD path multiplies. */
static inline int tile_quant(int type, const uint8_t *quants, int i, int j) {
    if (type == GGML_Q8_0) return (int)(int8_t)quants[32 * (j / 4) + 4 * i + j % 4] + 128;
    const int jj = j % 16;
    const uint8_t byte = quants[32 * (jj / 4) + 4 * i + jj % 4];
    return j < 16 ? byte & 0x0f : byte >> 4;
}

static void tile_rows(int type, const uint8_t *tile, const QuantizedRows *x, int64_t r0, const int MR,
                      float *out, int64_t ldo) {
    const int64_t nb = x->nb, tbb = tile_block_bytes(type);
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        for (int i = 0; i < TILE_N; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = tile + b * tbb;
                uint16_t halves[2 * TILE_N];
                memcpy(halves, blk, sizeof halves);
                const int8_t *xq = x->q + row * x->k + b * QK;
                int32_t idot = 0;
                for (int j = 0; j < QK; j++) idot += tile_quant(type, blk + quants_offset(type), i, j) * xq[j];
                const float d = half_to_float(halves[i]);
                acc += (float)idot * (d * x->d[row * nb + b]);
                acc += offset_factor(type, halves, i, d) * x->s[row * nb + b];
            }
            out[r * ldo + i] = acc;
        }
    }
}
#endif

#include "gguf_kquant_tiles.h"

/* Bytes of one tile (8 rows, k = 32 nb weights each). */
static int64_t tile_bytes_for(int type, int64_t nb) {
    return is_kquant(type) ? nb / 8 * kq_tile_block_bytes(type) : nb * tile_block_bytes(type);
}

/* One pass of a tile over MR rows of x, in the tile's format family (kq: a constant at every call site). */
static inline __attribute__((always_inline)) void rows_pass(const int kq, int type, const uint8_t *tile,
                                                             const QuantizedRows *x, int64_t r0, const int MR,
                                                             float *out, int64_t ldo) {
    if (kq)
        kq_tile_rows(type, tile, x, r0, MR, out, ldo);
    else
        tile_rows(type, tile, x, r0, MR, out, ldo);
}

#ifdef KL_PAIR_TILES
static inline __attribute__((always_inline)) void pair_pass(const int kq, int type, const uint8_t *tile,
                                                             int64_t tile_bytes, const QuantizedRows *x, int64_t r0,
                                                             const int MR, float *out, int64_t ldo) {
    if (kq)
        kq_tile_pair_rows(type, tile, tile_bytes, x, r0, MR, out, ldo);
    else
        tile_pair_rows(type, tile, tile_bytes, x, r0, MR, out, ldo);
}
#endif

/* Tiles [t0, t1) against every row of x; y has n valid columns. */
static inline __attribute__((always_inline)) void gemm_tiles_of(const int kq, int type, const uint8_t *w,
                                                                 int64_t tile_bytes, int64_t n, const QuantizedRows *x,
                                                                 int64_t m, int64_t t0, int64_t t1, float *y,
                                                                 int64_t ldy) {
    float out[TILE_M * TILE_N];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = w + t * tile_bytes;
        const int64_t n0 = t * TILE_N;
#ifdef KL_PAIR_TILES
        if (t + 1 < t1 && n0 + 2 * TILE_N <= n) { /* two full tiles: 16 rows at once */
            for (int64_t r = 0; r < m; r += PAIR_M) {
                float *dst = y + r * ldy + n0;
                switch (m - r < PAIR_M ? m - r : PAIR_M) {
                case 8: pair_pass(kq, type, tile, tile_bytes, x, r, 8, dst, ldy); break;
                case 7: pair_pass(kq, type, tile, tile_bytes, x, r, 7, dst, ldy); break;
                case 6: pair_pass(kq, type, tile, tile_bytes, x, r, 6, dst, ldy); break;
                case 5: pair_pass(kq, type, tile, tile_bytes, x, r, 5, dst, ldy); break;
                case 4: pair_pass(kq, type, tile, tile_bytes, x, r, 4, dst, ldy); break;
                case 3: pair_pass(kq, type, tile, tile_bytes, x, r, 3, dst, ldy); break;
                case 2: pair_pass(kq, type, tile, tile_bytes, x, r, 2, dst, ldy); break;
                default: pair_pass(kq, type, tile, tile_bytes, x, r, 1, dst, ldy); break;
                }
            }
            t++;
            continue;
        }
#endif
        const int full = n0 + TILE_N <= n;
        for (int64_t r = 0; r < m; r += TILE_M) {
            const int64_t mr = m - r < TILE_M ? m - r : TILE_M;
            /* A full tile stores straight into y; a partial one goes through `out`. */
            float *dst = full ? y + r * ldy + n0 : out;
            const int64_t ld = full ? ldy : TILE_N;
            switch (mr) {
            case 4: rows_pass(kq, type, tile, x, r, 4, dst, ld); break;
            case 3: rows_pass(kq, type, tile, x, r, 3, dst, ld); break;
            case 2: rows_pass(kq, type, tile, x, r, 2, dst, ld); break;
            default: rows_pass(kq, type, tile, x, r, 1, dst, ld); break;
            }
            if (!full)
                for (int64_t i = 0; i < mr; i++) memcpy(y + (r + i) * ldy + n0, out + i * TILE_N, sizeof(float) * (n - n0));
        }
    }
}

/* The format family is resolved here once, so the 32-weight formats' loop is compiled as if the K-quants did
 * not exist (an A/B found a per-pass branch cost Q4_0 a few percent). */
static void gemm_tiles(int type, const uint8_t *w, int64_t tile_bytes, int64_t n, const QuantizedRows *x, int64_t m,
                       int64_t t0, int64_t t1, float *y, int64_t ldy) {
    /* Each K-quant format gets its own copy of the loop with `type` a constant: its branches fold away and
     * its bit shifts become immediates (one runtime-typed copy ran Q6_K at a third of Q4_K's bytes/s). */
    if (type == GGML_Q4_K)
        gemm_tiles_of(1, GGML_Q4_K, w, tile_bytes, n, x, m, t0, t1, y, ldy);
    else if (type == GGML_Q5_K)
        gemm_tiles_of(1, GGML_Q5_K, w, tile_bytes, n, x, m, t0, t1, y, ldy);
    else if (type == GGML_Q6_K)
        gemm_tiles_of(1, GGML_Q6_K, w, tile_bytes, n, x, m, t0, t1, y, ldy);
    else
        gemm_tiles_of(0, type, w, tile_bytes, n, x, m, t0, t1, y, ldy);
}

/* ------------------------------------------------------------------------------------------- thread pool */
/* Workers spin for the next call (a decode step makes hundreds of calls a few microseconds apart), then
 * sleep on a condition variable. The spin outlasts the gap between two engine steps (about a millisecond of
 * sampling and scheduling at batch 1): a sleeping worker took long enough to wake, measured on a 2-vCPU
 * virtual machine, that spinning 2 ms rather than 0.2 ms cut a batch-1 decode step's projections from 4.1 to
 * 3.1 ms. One call runs at a time (call_lock). */
#define MAX_THREADS 256
#define SPIN_NS 2000000

typedef struct {
    int type;
    const uint8_t *w;
    int64_t tile_bytes, n, tiles, m, ldy;
    const QuantizedRows *x;
    float *y;
    int parts;
    /* Another library's work (kl_parallel_for) when set: its parts 0 .. task_parts - 1, spread over `parts`. */
    void (*task)(void *, int, int);
    void *ctx;
    int task_parts;
} Job;

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;
static atomic_int pending;
static atomic_int job_parts;
static int workers_started;
static Job job;

static void run_part(const Job *j, int part) {
    if (j->task) {
        for (int p = part; p < j->task_parts; p += j->parts) j->task(j->ctx, p, j->task_parts);
        return;
    }
    /* Contiguous ranges of tiles, two at a time so no two threads write one 64-byte line of y. */
    const int64_t chunk = ((j->tiles + j->parts - 1) / j->parts + 1) & ~(int64_t)1;
    const int64_t t0 = part * chunk, t1 = t0 + chunk < j->tiles ? t0 + chunk : j->tiles;
    if (t0 < t1) gemm_tiles(j->type, j->w, j->tile_bytes, j->n, j->x, j->m, t0, t1, j->y, j->ldy);
}

static inline void cpu_relax(void) {
#if KL_SIMD
    _mm_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker(void *arg) {
    const int part = (int)(intptr_t)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        const int64_t spin_until = now_ns() + SPIN_NS;
        int spins = 0;
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() > spin_until) {
                pthread_mutex_lock(&pool_lock);
                while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen)
                    pthread_cond_wait(&pool_wake, &pool_lock);
                pthread_mutex_unlock(&pool_lock);
                break;
            }
        }
        /* A worker that sat out call g may wake only after call g + 1 was published: the part count it
         * reads must belong to the generation it acts on, so re-check and go round again if it moved. */
        const int parts = atomic_load_explicit(&job_parts, memory_order_acquire);
        if (atomic_load_explicit(&generation, memory_order_acquire) != g) continue;
        seen = g;
        if (part < parts) {
            run_part(&job, part);
            atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
        }
    }
    return NULL;
}

/* Starts workers up to `threads - 1` (the caller is part 0); returns how many threads can work. */
static int ensure_workers(int threads) {
    while (workers_started < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, worker, (void *)(intptr_t)(workers_started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        workers_started++;
    }
    return workers_started + 1 < threads ? workers_started + 1 : threads;
}

/* Publishes `j` to the workers, runs its part 0 and waits for the others (call_lock held, j.parts > 1). */
static void run_job(Job j) {
    job = j;
    atomic_store_explicit(&pending, j.parts - 1, memory_order_relaxed);
    atomic_store_explicit(&job_parts, j.parts, memory_order_relaxed);
    pthread_mutex_lock(&pool_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    run_part(&job, 0);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) cpu_relax();
}

/* ------------------------------------------------------------------------------------------------ entry */

static void *scratch;
static size_t scratch_bytes;

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W.T, W [n, k] packed in 8-row tiles of `type`.
 * Returns 0, or -1 for an unsupported type or shape, -2 when scratch memory cannot be had. */
int kl_gguf_linear(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
                   float *y, int64_t ldy, int threads) {
    const int kq = is_kquant(type);
    if ((!kq && tile_block_bytes(type) == 0) || k <= 0 || k % (kq ? QK_K : QK) || n < 0 || m < 0) return -1;
    if (n == 0 || m == 0) return 0;
    const int64_t nb = k / QK, tiles = (n + TILE_N - 1) / TILE_N, tile_bytes = tile_bytes_for(type, nb);
    const int sums = type == GGML_Q6_K;
    pthread_mutex_lock(&call_lock);
    const size_t need = (size_t)(m * k) + (2 + 2 * sums) * sizeof(float) * (size_t)(m * nb) + 64;
    if (need > scratch_bytes) {
        free(scratch);
        scratch = malloc(need);
        scratch_bytes = scratch ? need : 0;
        if (!scratch) { pthread_mutex_unlock(&call_lock); return -2; }
    }
    float *d = (float *)scratch, *s = d + m * nb;
    int32_t *sum16 = sums ? (int32_t *)(s + m * nb) : NULL;
    int8_t *q = (int8_t *)(s + m * nb) + (sums ? 2 * sizeof(int32_t) * m * nb : 0);
    kl_gguf_quantize_activations(x, m, k, ldx, q, d, s);
    for (int64_t h = 0; sums && h < 2 * m * nb; h++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) sum += q[16 * h + j];
        sum16[h] = sum;
    }
    const QuantizedRows rows = {q, d, s, sum16, k, nb};

    /* A thread needs enough work to pay for waking it: at least 8 tiles (64 rows). */
    int parts = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    const int64_t max_parts = tiles / 8 > 1 ? tiles / 8 : 1;
    if (parts > max_parts) parts = (int)max_parts;
    if (parts > 1) parts = ensure_workers(parts);
    if (parts == 1)
        gemm_tiles(type, w, tile_bytes, n, &rows, m, 0, tiles, y, ldy);
    else
        run_job((Job){type, w, tile_bytes, n, tiles, m, ldy, &rows, y, parts, NULL, NULL, 0});
    pthread_mutex_unlock(&call_lock);
    return 0;
}

/* task(ctx, part, parts) for every part in [0, parts), on the pool's threads and the caller's (as many as
 * can be started; the caller takes part 0 and waits for the rest). Why here: one pool per process, so the
 * paged attention library's parts (paged_decode_attention.c) run on the threads the projections keep
 * spinning, with no second set of workers contending for the cores. One call at a time, with the
 * projections' (call_lock). */
void kl_parallel_for(void (*task)(void *, int, int), void *ctx, int parts) {
    if (parts < 1) return;
    pthread_mutex_lock(&call_lock);
    const int threads = parts > 1 ? ensure_workers(parts < MAX_THREADS ? parts : MAX_THREADS) : 1;
    const Job j = {0, NULL, 0, 0, 0, 0, 0, NULL, NULL, threads, task, ctx, parts};
    if (threads == 1)
        run_part(&j, 0);
    else
        run_job(j);
    pthread_mutex_unlock(&call_lock);
}

/* out [count, k] = rows `ids` of the packed W, dequantized (an embedding lookup on a quantized table). */
int kl_gguf_dequantize_rows(int type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                            float *out) {
    const int64_t tbb = tile_block_bytes(type);
    if (is_kquant(type)) {
        if (k <= 0 || k % QK_K) return -1;
        const int64_t nsb = k / QK_K, tsb = kq_tile_block_bytes(type);
        for (int64_t c = 0; c < count; c++)
            for (int64_t sb = 0; sb < nsb; sb++)
                kq_dequantize_block(type, w + (ids[c] / TILE_N) * nsb * tsb + sb * tsb, (int)(ids[c] % TILE_N),
                                    out + c * k + sb * QK_K);
        return 0;
    }
    if (tbb == 0 || k <= 0 || k % QK) return -1;
    const int64_t nb = k / QK;
    for (int64_t c = 0; c < count; c++) {
        const uint8_t *tile = w + (ids[c] / TILE_N) * nb * tbb;
        const int i = (int)(ids[c] % TILE_N);
        float *o = out + c * k;
        for (int64_t b = 0; b < nb; b++, o += QK) {
            const uint8_t *blk = tile + b * tbb, *quants = blk + quants_offset(type);
            uint16_t halves[2 * TILE_N];
            memcpy(halves, blk, sizeof halves);
            const float d = half_to_float(halves[i]);
            for (int j = 0; j < QK; j++) {
                if (type == GGML_Q8_0) {
                    o[j] = d * (float)(int8_t)quants[32 * (j / 4) + 4 * i + j % 4];
                } else {
                    const int jj = j % 16;
                    const uint8_t byte = quants[32 * (jj / 4) + 4 * i + jj % 4];
                    const int qv = j < 16 ? byte & 0x0f : byte >> 4;
                    o[j] = type == GGML_Q4_1 ? d * (float)qv + half_to_float(halves[TILE_N + i])
                                             : d * (float)(qv - 8);
                }
            }
        }
    }
    return 0;
}

/* tiles [ceil(n / 8), tile bytes] = the weight's GGUF rows [n, k / block weights * block bytes] regrouped in
 * 8-row tiles (the layouts above and in gguf_kquant_tiles.h; zero rows pad the last tile). The same bytes as
 * ops/gguf_linear.py's torch `pack`, which the tests compare it with; this one is what a 1B-parameter load
 * can afford (a second, where the torch gathers took tens). Returns 0, or -1 for a bad type or shape. */
int kl_gguf_pack(int type, const uint8_t *rows, int64_t n, int64_t k, uint8_t *tiles) {
    if (n < 0 || k <= 0 || k % (is_kquant(type) ? QK_K : QK) || (!is_kquant(type) && tile_block_bytes(type) == 0))
        return -1;
    if (is_kquant(type)) {
        kq_pack(type, rows, n, k, tiles);
        return 0;
    }
    const int64_t nb = k / QK, tbb = tile_block_bytes(type), bb = tbb / TILE_N;
    const int groups = type == GGML_Q8_0 ? 8 : 4, scales = type == GGML_Q4_1 ? 4 : 2;
    for (int64_t t = 0; t < (n + TILE_N - 1) / TILE_N; t++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = tiles + (t * nb + b) * tbb;
            for (int i = 0; i < TILE_N; i++) {
                const int64_t r = t * TILE_N + i;
                if (r >= n) { /* padding: d = 0, and zero quants */
                    memset(dst + 2 * i, 0, 2);
                    if (type == GGML_Q4_1) memset(dst + 16 + 2 * i, 0, 2);
                    for (int g = 0; g < groups; g++) memset(dst + quants_offset(type) + 32 * g + 4 * i, 0, 4);
                    continue;
                }
                const uint8_t *src = rows + (r * nb + b) * bb;
                memcpy(dst + 2 * i, src, 2);
                if (type == GGML_Q4_1) memcpy(dst + 16 + 2 * i, src + 2, 2);
                for (int g = 0; g < groups; g++) memcpy(dst + quants_offset(type) + 32 * g + 4 * i, src + scales + 4 * g, 4);
            }
        }
    }
    return 0;
}

/* Which dot-product path this build uses (the tests check the instructions it implies). */
const char *kl_gguf_isa(void) {
#if KL_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512vnni";
#elif KL_SIMD && defined(__AVXVNNI__)
    return "avxvnni";
#elif KL_SIMD
    return "avx2";
#else
    return "scalar";
#endif
}
