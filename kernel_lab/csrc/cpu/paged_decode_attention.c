/* Paged decode attention on the CPU: float32 queries and outputs, one query token per sequence, over a
 * block-table KV cache of float32, float16, bfloat16, int8 or fp8 E4M3 pages (`kv_format`, kv_half.h: narrow
 * rows widen in registers, every sum is float32; int8 pages carry one float32 scale per token and KV head
 * and hold K rows Hadamard-rotated, fp8 pages one scale per page and KV head, kv_int8.h).
 *
 * Same contract as kernel_lab/ops/paged_attention.py (see its module docstring). Plain C with no torch
 * headers, so it compiles in a second or two; kernel_lab/ops/cpu_kernels.py builds it and calls it through
 * ctypes, and holds the build flags (with the reason for each).
 *
 * Sliding window: with `window` W > 0 the query (the sequence's last token, position len - 1) attends the
 * keys at positions (len - 1 - W, len - 1], the last W tokens, as transformers' sliding-window mask
 * (kv_idx > q_idx - W) and llama.cpp's SWA; pages wholly before the window are never read (their table
 * entries may be anything). W = 0 attends the whole sequence.
 *
 * Why it exists: the PyTorch reference gathers every used page into a copy, zeroes the stale slots, then
 * reads the copy again in SDPA. Here each page is read in place, once, and the softmax is online.
 *
 * Vectorisation without -ffast-math: the `omp simd` pragmas (-fopenmp-simd) allow reassociating just those
 * reductions across SIMD lanes, and nothing else. No OpenMP runtime is linked and the kernel is
 * single-threaded: torch brings its own OpenMP runtime, and two in one process fight over the threads.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"
#include "kv_half.h"
#include "kv_int8.h"

/* Tokens whose scores (and V contributions) are computed together: four dot products in one loop give the
 * FMA units four independent chains instead of one latency-bound chain, and an accumulator row is loaded
 * and stored once per four V rows rather than once per row. (Eight measured no better.) */
#define TOKENS 4

/* Per-head scratch rows are padded to this many floats, so each starts on a 64-byte line. */
#define ROW_ALIGN 16

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define ALWAYS_INLINE inline
#define PREFETCH(p) ((void)(p))
#endif

/* Scores of TOKENS tokens against one query row. */
static inline void dot_tokens(const float *restrict qh, const float *const k[TOKENS], int head_dim,
                              float *restrict s) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int d = 0; d < head_dim; ++d) {
        const float qd = qh[d];
        s0 += qd * k0[d];
        s1 += qd * k1[d];
        s2 += qd * k2[d];
        s3 += qd * k3[d];
    }
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
    s[3] = s3;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* Pages sit at random places in the pool and span only a few 4 KiB pages, where hardware prefetchers stop,
 * so without help most lines of a page arrive at full memory latency. So each pass over a page asks for
 * what the same pass over the next page will read, spread thinly over the pass: a burst would fill the
 * miss buffers and stall the loads this pass needs. Call i of n prefetches the i-th of n equal parts of the
 * next page's rows [lo, min(hi, tokens)), so the lines are requested in address order, which the hardware
 * prefetchers build on (measured: about 20% faster than the same lines in KV-head order). */
static inline void prefetch_part(const char *page, int64_t stride_token, int lo, int hi, int tokens, int i,
                                 int n) { /* stride_token in bytes */
    hi = hi < tokens ? hi : tokens;
    if (lo >= hi) return;
    const int64_t begin = lo * stride_token, size = (hi - lo) * stride_token;
    const int64_t first = begin + size * i / n, end = begin + size * (i + 1) / n;
    const int64_t line = 64;
    for (int64_t f = first / line * line; f < end; f += line) PREFETCH(page + f);
}

/* The first position a query at position len - 1 attends: len - W with a window W > 0, else 0. */
static inline int window_start(int len, int window) { return window > 0 && len > window ? len - window : 0; }

/* Inlined per page format twice (see the entry point): for head_dim 64 with constant trip counts (no
 * remainder code, a 64-wide row's accumulators stay in registers: about 25% less compute), and for any
 * head_dim. Cache strides arrive in elements and are turned into bytes here, once. */
static ALWAYS_INLINE int paged_decode(const float *q, int64_t q_stride_b, int64_t q_stride_h,
                                      const void *k_cache, const void *v_cache, int format,
                                      const float *k_scale, const float *v_scale, int64_t cache_stride_block, int64_t cache_stride_token,
                                      int64_t cache_stride_head,
                                      const int32_t *block_tables, int64_t table_stride,
                                      const int32_t *seq_lens, int batch, int num_q_heads, int num_kv_heads,
                                      int head_dim, int block_size, float scale, int window, float *out,
                                      int64_t out_stride_b, int64_t out_stride_h) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t element = kv_element_bytes(format);
    /* Scale strides in floats: int8 [num_blocks, block_size, num_kv_heads] (a token's own), fp8
     * [num_blocks, num_kv_heads] (every token of a page and head shares one: a token stride of 0). */
    const int64_t scale_token = format == KV_I8 ? num_kv_heads : 0;
    const int64_t scale_block = format == KV_I8 ? (int64_t)block_size * num_kv_heads : num_kv_heads;
    cache_stride_block *= element, cache_stride_token *= element, cache_stride_head *= element;
    const int64_t row = ((int64_t)head_dim + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int64_t score_row = ((int64_t)block_size + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    /* Per query head: scaled query and V accumulator rows, a page of scores, and four scalars. */
    const int64_t floats = (int64_t)num_q_heads * (2 * row + score_row + 4);
    const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64; /* aligned_alloc: a multiple */
    float *scratch = aligned_alloc(64, bytes);
    if (!scratch) return -1;
    float *qs = scratch;
    float *acc = qs + num_q_heads * row;
    float *scores = acc + num_q_heads * row;
    float *run_max = scores + num_q_heads * score_row;
    float *run_sum = run_max + num_q_heads;
    float *page_max = run_sum + num_q_heads;
    float *correction = page_max + num_q_heads;

    for (int b = 0; b < batch; ++b) {
        const int len = seq_lens[b];
        if (len <= 0) {
            for (int h = 0; h < num_q_heads; ++h)
                memset(out + b * out_stride_b + h * out_stride_h, 0, (size_t)head_dim * sizeof(float));
            continue;
        }
        /* The scale folded into q once, rather than a multiply per score. int8 K rows hold H k, so q is
         * rotated too: (H q) . (H k) = block * q . k, and 1 / block (a power of two) joins the scale. */
        const float q_scale = format == KV_I8 ? scale / (float)hadamard_block(head_dim) : scale;
        for (int h = 0; h < num_q_heads; ++h) {
            const float *qh = q + b * q_stride_b + h * q_stride_h;
            float *dst = qs + h * row;
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) dst[d] = qh[d] * q_scale;
            if (format == KV_I8) hadamard_rotate(dst, head_dim);
            memset(acc + h * row, 0, (size_t)head_dim * sizeof(float));
            run_max[h] = -INFINITY;
            run_sum[h] = 0.0f;
        }
        const int32_t *table = block_tables + b * table_stride;
        const int num_pages = (len + block_size - 1) / block_size;
        const int first = window_start(len, window);
        /* Page by page with every KV head inside (not KV head by KV head over the sequence): a token's K
         * (or V) row holds all KV heads side by side, so each pass sweeps one contiguous stretch of the
         * page, front to back, and the page is read from memory once. */
        for (int page_idx = first / block_size; page_idx < num_pages; ++page_idx) {
            /* The page's part of [first, len): slots past the sequence's length (or before the window)
             * may hold anything (even NaN): never read them. Only the window's first page starts inside. */
            const int lo = page_idx * block_size > first ? page_idx * block_size : first;
            const int hi = len < (page_idx + 1) * block_size ? len : (page_idx + 1) * block_size;
            const int tokens = hi - lo;
            const int64_t skip = (int64_t)(lo - page_idx * block_size) * cache_stride_token;
            const char *k_page = (const char *)k_cache + (int64_t)table[page_idx] * cache_stride_block + skip;
            const char *v_page = (const char *)v_cache + (int64_t)table[page_idx] * cache_stride_block + skip;
            /* int8, fp8: the scales of this page's token lo on, token t's for KV head h at t * scale_token + h
             * (unused, and never read, for the other formats). */
            const int64_t scale_at = (int64_t)table[page_idx] * scale_block + (lo - page_idx * block_size) * scale_token;
            const float *k_page_scale = kv_scaled(format) ? k_scale + scale_at : NULL;
            const float *v_page_scale = kv_scaled(format) ? v_scale + scale_at : NULL;
            /* What to prefetch: this sequence's next page, else the next sequence's first page. Table
             * entries past a sequence's last page may be padding, so only used entries are looked up. */
            int64_t next = -1;
            int next_tokens = 0;
            if (page_idx + 1 < num_pages) {
                next = table[page_idx + 1];
                next_tokens = len - (page_idx + 1) * block_size;
            } else if (b + 1 < batch && seq_lens[b + 1] > 0) {
                const int next_first = window_start(seq_lens[b + 1], window) / block_size;
                next = block_tables[(b + 1) * table_stride + next_first];
                next_tokens = seq_lens[b + 1] - next_first * block_size;
            }
            next_tokens = next < 0 ? 0 : next_tokens < block_size ? next_tokens : block_size;
            const char *next_k = (const char *)k_cache + (next < 0 ? 0 : next) * cache_stride_block;
            const char *next_v = (const char *)v_cache + (next < 0 ? 0 : next) * cache_stride_block;

            /* Scores: a K row, once loaded, serves every query head of its KV head. */
            int t = 0;
            for (; t + TOKENS <= tokens; t += TOKENS) {
                for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                    /* Typed pointer arrays for each format: one array read through both would alias. */
                    const float *k[TOKENS];
                    const void *k16[TOKENS];
                    for (int i = 0; i < TOKENS; ++i) {
                        const char *at = k_page + (t + i) * cache_stride_token + kvh * cache_stride_head;
                        k[i] = (const float *)at;
                        k16[i] = at;
                    }
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                        prefetch_part(next_k, cache_stride_token, t, t + TOKENS, next_tokens, h, num_q_heads);
                        float *s = scores + h * score_row + t;
                        if (format == KV_F32) {
                            dot_tokens(qs + h * row, k, head_dim, s);
                        } else {
                            dot_tokens_half(format, qs + h * row, k16, head_dim, s);
                            /* Each token's K scale on its score (fp8: the page's power of two, so the same bits as
                             * the dot product of the scaled codes). */
                            if (kv_scaled(format))
                                for (int i = 0; i < TOKENS; ++i) s[i] *= k_page_scale[(t + i) * scale_token + kvh];
                        }
                    }
                }
            }
            prefetch_part(next_k, cache_stride_token, t, next_tokens, next_tokens, 0, 1);
            for (; t < tokens; ++t) {
                for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                    const char *k = k_page + t * cache_stride_token + kvh * cache_stride_head;
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h)
                        scores[h * score_row + t] =
                            format == KV_F32   ? dot(qs + h * row, (const float *)k, head_dim)
                            : kv_scaled(format) ? dot_half(format, qs + h * row, k, head_dim) * k_page_scale[t * scale_token + kvh]
                                               : dot_half(format, qs + h * row, k, head_dim);
                }
            }

            /* Online softmax, one update per page rather than per token. Branch-free: the accumulator
             * is rescaled on every page (by exactly 1 when the max stays), which measured faster than a
             * data-dependent "did the max grow" branch. On the first page the correction is
             * exp(-inf) = 0, applied to a zero accumulator and sum. */
            for (int h = 0; h < num_q_heads; ++h) {
                const float *s = scores + h * score_row;
                float m = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int i = 0; i < tokens; ++i) m = s[i] > m ? s[i] : m;
                page_max[h] = m;
            }
#pragma omp simd
            for (int h = 0; h < num_q_heads; ++h) {
                const float m = run_max[h] > page_max[h] ? run_max[h] : page_max[h];
                correction[h] = exp_nonpositive(run_max[h] - m);
                run_max[h] = m;
            }
            for (int h = 0; h < num_q_heads; ++h) {
                float *s = scores + h * score_row;
                const float m = run_max[h];
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int i = 0; i < tokens; ++i) {
                    const float p = exp_nonpositive(s[i] - m);
                    s[i] = p;
                    sum += p;
                }
                const float c = correction[h];
                run_sum[h] = run_sum[h] * c + sum;
                float *a = acc + h * row;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) a[d] *= c;
            }

            /* V, in the same order as K. */
            t = 0;
            for (; t + TOKENS <= tokens; t += TOKENS) {
                for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                    const char *row0 = v_page + t * cache_stride_token + kvh * cache_stride_head;
                    const void *v16[TOKENS];
                    for (int i = 0; i < TOKENS; ++i) v16[i] = row0 + i * cache_stride_token;
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                        prefetch_part(next_v, cache_stride_token, t, t + TOKENS, next_tokens, h, num_q_heads);
                        const float *p = scores + h * score_row + t;
                        float *restrict a = acc + h * row;
                        if (kv_scaled(format)) { /* each token's V scale goes on its probability */
                            const float *vs = v_page_scale + t * scale_token + kvh;
                            const float pv[TOKENS] = {p[0] * vs[0], p[1] * vs[scale_token], p[2] * vs[2 * scale_token],
                                                      p[3] * vs[3 * scale_token]};
                            accumulate_half(format, a, pv, v16, TOKENS, head_dim);
                            continue;
                        }
                        if (format != KV_F32) {
                            accumulate_half(format, a, p, v16, TOKENS, head_dim);
                            continue;
                        }
                        const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                        const float *v0 = (const float *)row0, *v1 = (const float *)(row0 + cache_stride_token);
                        const float *v2 = (const float *)(row0 + 2 * cache_stride_token);
                        const float *v3 = (const float *)(row0 + 3 * cache_stride_token);
#pragma omp simd
                        for (int d = 0; d < head_dim; ++d)
                            a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
                    }
                }
            }
            prefetch_part(next_v, cache_stride_token, t, next_tokens, next_tokens, 0, 1);
            for (; t < tokens; ++t) {
                for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                    const char *v = v_page + t * cache_stride_token + kvh * cache_stride_head;
                    const void *v16[1] = {v};
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                        const float *p = scores + h * score_row + t;
                        float *restrict a = acc + h * row;
                        if (format != KV_F32) {
                            const float pv = kv_scaled(format) ? p[0] * v_page_scale[t * scale_token + kvh] : p[0];
                            accumulate_half(format, a, &pv, v16, 1, head_dim);
                            continue;
                        }
                        const float *vf = (const float *)v;
#pragma omp simd
                        for (int d = 0; d < head_dim; ++d) a[d] += p[0] * vf[d];
                    }
                }
            }
        }
        for (int h = 0; h < num_q_heads; ++h) {
            /* The token at the running max weighs exactly 1, so the sum is >= 1. */
            const float inv = 1.0f / run_sum[h];
            const float *a = acc + h * row;
            float *dst = out + b * out_stride_b + h * out_stride_h;
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) dst[d] = a[d] * inv;
        }
    }
    free(scratch);
    return 0;
}

/* Strides are in elements (of the cache's format for the caches); the last dimension of q, the caches and
 * out is contiguous, and K and V share their strides. `kv_format`: KV_F32, KV_F16, KV_BF16, KV_I8 or KV_F8
 * (kv_half.h); `k_scale`, `v_scale`: int8 and fp8 only (NULL otherwise), dense float32, int8's
 * [num_blocks, block_size, num_kv_heads] (one per token), fp8's [num_blocks, num_kv_heads] (one per page).
 * `window`: the sliding window in tokens, 0 for none (see the top of the file). Returns 0, -1 when the
 * scratch buffer cannot be allocated (then nothing is written), or -2 for an unknown kv_format. */
int kl_paged_decode_attention(const float *q, int64_t q_stride_b, int64_t q_stride_h, const void *k_cache,
                              const void *v_cache, int kv_format, const float *k_scale, const float *v_scale,
                              int64_t cache_stride_block,
                              int64_t cache_stride_token, int64_t cache_stride_head, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, int batch, int num_q_heads,
                              int num_kv_heads, int head_dim, int block_size, float scale, int window, float *out,
                              int64_t out_stride_b, int64_t out_stride_h) {
#define CALL(F, D)                                                                                            \
    paged_decode(q, q_stride_b, q_stride_h, k_cache, v_cache, F, k_scale, v_scale, cache_stride_block,         \
                 cache_stride_token,                                                                          \
                 cache_stride_head, block_tables, table_stride, seq_lens, batch, num_q_heads, num_kv_heads, D, \
                 block_size, scale, window, out, out_stride_b, out_stride_h)
    /* Only the engine's head_dim gets its own copy: each copy adds most of a second to the build, and the
     * tests' other head dims keep the generic copy covered. */
    switch (kv_format) {
    case KV_F32: return head_dim == 64 ? CALL(KV_F32, 64) : CALL(KV_F32, head_dim);
    case KV_F16: return head_dim == 64 ? CALL(KV_F16, 64) : CALL(KV_F16, head_dim);
    case KV_BF16: return head_dim == 64 ? CALL(KV_BF16, 64) : CALL(KV_BF16, head_dim);
    case KV_I8:
        if (!k_scale || !v_scale) return -2;
        return head_dim == 64 ? CALL(KV_I8, 64) : CALL(KV_I8, head_dim);
    case KV_F8:
        if (!k_scale || !v_scale) return -2;
        return head_dim == 64 ? CALL(KV_F8, 64) : CALL(KV_F8, head_dim);
    default: return -2;
    }
#undef CALL
}

/* The widest path this build's 16-bit page reads take: "avx512", "avx2" or "scalar". */
const char *kl_paged_attention_isa(void) { return kv_half_isa(); }

/* n floats into a cache row of `kv_format` (the fused call's write, exported so the tests can check its
 * rounding on chosen values). Not int8 or fp8, whose rows go through a scale (kl_write_kv_scaled). */
void kl_store_kv_row(int kv_format, const float *src, int64_t n, void *dst) {
    if (kv_scaled(kv_format)) return;
    if (kv_format == KV_F32)
        memcpy(dst, src, (size_t)n * sizeof(float));
    else
        store_half_row(kv_format, src, (int)n, dst);
}

/* Neox ("rotate half") RoPE of one head row: o[i] = x[i] cos[i] - x[i + half] sin[i] for i < half, and
 * x[i] cos[i] + x[i - half] sin[i] above (cos and sin hold each frequency twice, as the model's table does). */
static inline void rope_row(const float *restrict x, const float *restrict cos_row, const float *restrict sin_row,
                            int head_dim, float *restrict o) {
    const int half = head_dim / 2;
#pragma omp simd
    for (int i = 0; i < half; ++i) o[i] = x[i] * cos_row[i] - x[i + half] * sin_row[i];
#pragma omp simd
    for (int i = half; i < head_dim; ++i) o[i] = x[i] * cos_row[i] + x[i - half] * sin_row[i];
}

/* One token's K or V rows (num_kv_heads rows of head_dim floats, `x`) into int8 or fp8 pages at `slot`:
 * int8 with the token's own scales, fp8 under project 05's policy per (page, KV head), kv_int8.h. Strides in
 * elements (bytes, for one-byte codes). */
static void write_token_scaled(int format, const float *x, int64_t slot, uint8_t *cache, float *scales,
                               int64_t stride_block, int64_t stride_token, int64_t stride_head, int num_kv_heads,
                               int head_dim, int block_size, float *rotated) { /* rotated: K's scratch, NULL for V */
    const int64_t block = slot / block_size;
    const int offset = (int)(slot % block_size);
    for (int h = 0; h < num_kv_heads; ++h) {
        const float *row = x + (int64_t)h * head_dim;
        uint8_t *page = cache + block * stride_block + h * stride_head;
        if (format == KV_I8)
            write_int8_row(row, head_dim, (int8_t *)(page + offset * stride_token), scales + slot * num_kv_heads + h,
                           rotated);
        else
            write_fp8_row(row, head_dim, page, stride_token, block_size, offset, scales + block * num_kv_heads + h);
    }
}

/* `tokens` rows of K and V ([tokens, num_kv_heads, head_dim] floats, dense) into int8 or fp8 pages
 * (`kv_format`) at `slots`, one token after another, as the fused call writes them (a slot of -1 stores
 * nothing). Exported for the tests, which hold it to kernel_lab/ops/kv_cache.py's reference called once per
 * token. Returns -2 (nothing written) for a format without page scales, -1 when scratch cannot be allocated. */
int kl_write_kv_scaled(int kv_format, const float *key, const float *value, const int64_t *slots, int64_t tokens,
                       void *k_cache, void *v_cache, float *k_scale, float *v_scale, int64_t cache_stride_block,
                       int64_t cache_stride_token, int64_t cache_stride_head, int num_kv_heads, int head_dim,
                       int block_size) {
    if (!kv_scaled(kv_format)) return -2;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    float *rotated = malloc((size_t)head_dim * sizeof(float));
    if (!rotated) return -1;
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        write_token_scaled(kv_format, key + t * row, slots[t], k_cache, k_scale, cache_stride_block,
                           cache_stride_token, cache_stride_head, num_kv_heads, head_dim, block_size, rotated);
        write_token_scaled(kv_format, value + t * row, slots[t], v_cache, v_scale, cache_stride_block,
                           cache_stride_token, cache_stride_head, num_kv_heads, head_dim, block_size, NULL);
    }
    free(rotated);
    return 0;
}

/* One layer's attention for a CPU decode step in a single call: RoPE on q and k, K and V stored into the
 * paged cache at `slots` (rounded to nearest even for 16-bit pages), then every row attends (as
 * kl_paged_decode_attention) over its context.
 *
 * Why one call: at batch 1 a layer's own arithmetic here takes microseconds, while the same work as torch
 * ops (the RoPE's slices, negation, concatenation and products, an index copy per cache, the attention call
 * and each one's argument checks) cost over a hundred microseconds of dispatch per layer: the largest part of
 * a decode step outside the linear layers.
 *
 * qkv [tokens, (Hq + 2 Hkv) * head_dim] is the qkv projection's output, row stride `qkv_stride`; cos and
 * sin [tokens, head_dim] are the rows of each token's position (contiguous). Float32 and 16-bit pages: every
 * token's K and V are written before any row attends, so rows of one sequence in one call (prompt tokens)
 * see each other. Int8 and fp8 pages (`k_scale`, `v_scale` as kl_paged_decode_attention's; NULL for the
 * other formats): each row is written and then attends, in row order, because an fp8 write may requantise its
 * page: a row then sees its page as its own and the earlier tokens left it, never rescaled by a later token,
 * so its result does not depend on where a prompt's chunks begin. (An int8 write touches its own slot and
 * scale only, so the order changes nothing there; the one loop serves both.) With a sliding `window` each row sees the
 * last `window` tokens of its own length. A slot
 * of -1 stores nothing. `out` [tokens, Hq * head_dim] is contiguous. Returns 0, or -1 when scratch memory
 * cannot be allocated (then the cache may hold this call's K and V but `out` is unwritten). */
int kl_rope_write_paged_attention(const float *qkv, int64_t qkv_stride, const float *cos_rows,
                                  const float *sin_rows, const int64_t *slots, void *k_cache, void *v_cache,
                                  int kv_format, float *k_scale, float *v_scale, int64_t cache_stride_block,
                                  int64_t cache_stride_token, int64_t cache_stride_head, const int32_t *block_tables,
                                  int64_t table_stride, const int32_t *seq_lens, int tokens, int num_q_heads,
                                  int num_kv_heads, int head_dim, int block_size, float scale, int window,
                                  float *out) {
    if (kv_format != KV_F32 && kv_format != KV_F16 && kv_format != KV_BF16 && !kv_scaled(kv_format)) return -2;
    if (kv_scaled(kv_format) && (!k_scale || !v_scale)) return -2;
    const int64_t q_row = (int64_t)num_q_heads * head_dim, kv_row = (int64_t)num_kv_heads * head_dim;
    const int64_t element = kv_element_bytes(kv_format);
    /* The query rows, then the token's rotated K rows (converted from there when the pages are narrow). */
    float *q = malloc(((size_t)(tokens > 0 ? tokens : 1) * (size_t)q_row + (size_t)kv_row + (size_t)head_dim) *
                      sizeof(float)); /* + head_dim: an int8 K row's rotation */
    if (!q) return -1;
    float *k_row = q + (size_t)(tokens > 0 ? tokens : 1) * (size_t)q_row;
    int status = 0;
    for (int t = 0; t < tokens; ++t) {
        const float *src = qkv + t * qkv_stride, *c = cos_rows + (int64_t)t * head_dim;
        const float *s = sin_rows + (int64_t)t * head_dim;
        for (int h = 0; h < num_q_heads; ++h)
            rope_row(src + (int64_t)h * head_dim, c, s, head_dim, q + t * q_row + (int64_t)h * head_dim);
        const int64_t slot = slots[t];
        if (slot >= 0 && kv_scaled(kv_format)) {
            for (int h = 0; h < num_kv_heads; ++h)
                rope_row(src + q_row + (int64_t)h * head_dim, c, s, head_dim, k_row + (int64_t)h * head_dim);
            write_token_scaled(kv_format, k_row, slot, k_cache, k_scale, cache_stride_block, cache_stride_token,
                               cache_stride_head, num_kv_heads, head_dim, block_size, k_row + kv_row);
            write_token_scaled(kv_format, src + q_row + kv_row, slot, v_cache, v_scale, cache_stride_block,
                               cache_stride_token, cache_stride_head, num_kv_heads, head_dim, block_size, NULL);
        } else if (slot >= 0) {
            const int64_t at = slot / block_size * cache_stride_block + slot % block_size * cache_stride_token;
            for (int h = 0; h < num_kv_heads; ++h) {
                const float *k = src + q_row + (int64_t)h * head_dim, *v = k + kv_row;
                const int64_t byte = (at + h * cache_stride_head) * element;
                rope_row(k, c, s, head_dim, k_row);
                kl_store_kv_row(kv_format, k_row, head_dim, (char *)k_cache + byte);
                kl_store_kv_row(kv_format, v, head_dim, (char *)v_cache + byte);
            }
        }
        if (kv_scaled(kv_format) && status == 0)
            status = kl_paged_decode_attention(q + t * q_row, q_row, head_dim, k_cache, v_cache, kv_format, k_scale,
                                               v_scale, cache_stride_block, cache_stride_token, cache_stride_head,
                                               block_tables + t * table_stride, table_stride, seq_lens + t, 1,
                                               num_q_heads, num_kv_heads, head_dim, block_size, scale, window,
                                               out + t * q_row, q_row, head_dim);
    }
    if (!kv_scaled(kv_format))
        status = kl_paged_decode_attention(q, q_row, head_dim, k_cache, v_cache, kv_format, NULL, NULL,
                                           cache_stride_block, cache_stride_token, cache_stride_head, block_tables,
                                           table_stride, seq_lens, tokens, num_q_heads, num_kv_heads, head_dim,
                                           block_size, scale, window, out, q_row, head_dim);
    free(q);
    return status;
}
