/* Paged decode attention on the CPU: float32 queries and outputs, one query token per sequence, over a
 * block-table KV cache of float32, float16, bfloat16, int8 or fp8 E4M3 pages (`kv_format`, kv_half.h: narrow
 * rows widen in registers, every sum is float32; int8 pages carry one float32 scale per token, KV head and 16
 * channels and hold K and V rows Hadamard-rotated, fp8 pages one scale per page and KV head, kv_int8.h).
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
 * reductions across SIMD lanes, and nothing else. No OpenMP runtime is linked (torch brings its own, and two
 * in one process fight over the threads): a call's spans (below, "Splits") run on gguf_linear.c's pthread
 * pool, the one the projections use.
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
#define TOKENS KV_ROWS

/* Per-head scratch rows are padded to this many floats, so each starts on a 64-byte line. */
#define ROW_ALIGN 16

#define ALWAYS_INLINE KV_INLINE
#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define PREFETCH(p) ((void)(p))
#endif

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

/* Splits: a sequence's pages are cut at every multiple of split_pages(block_size) (absolute page indices), and
 * each piece ("span") is attended on its own, its (max, sum, unnormalised V sum) per query head merged in page
 * order afterwards: flash-decoding on the CPU. Why: one sequence's context then spreads over the pool's
 * threads (at batch 1 with a long context, one thread cannot read the KV at the machine's bandwidth), and
 * several short sequences spread too, a span each. The cut points depend on the sequence's length, window and
 * block size only, never on the thread count or the batch, so the bits do not either; a context within one
 * span (SPLIT_TOKENS, most chat turns) is computed exactly as a single pass. */
#define SPLIT_TOKENS 512
/* A part (thread) takes at least this many pages: fewer do not pay for waking a worker. */
#define MIN_PAGES_PER_PART 8
#define MAX_PARTS 256

static inline int split_pages(int block_size) { return block_size >= SPLIT_TOKENS ? 1 : SPLIT_TOKENS / block_size; }

typedef struct {
    int b, page_lo, page_hi;
    int64_t partial; /* float offset of the span's partial state, or -1: the span is its sequence's whole context */
} Span;

/* One call's arguments and its plan, shared by the parts. Cache strides in bytes. */
typedef struct {
    const float *q;
    int64_t q_stride_b, q_stride_h;
    const void *k_cache, *v_cache;
    int format;
    const float *k_scale, *v_scale;
    int64_t cache_stride_block, cache_stride_token, cache_stride_head;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    int batch, num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int window;
    float *out;
    int64_t out_stride_b, out_stride_h;
    const Span *spans;
    const int64_t *span_pages_before; /* pages of the spans before span i: the parts' split points */
    int num_spans;
    int64_t total_pages;
    float *partials; /* per split span: num_q_heads * (head_dim + 2) floats, [max, sum, V sum] per head */
    int status[MAX_PARTS];
} Attention;

/* Scores of nt rows of one KV head (k; ks their int8 group scales, NULL entries otherwise) for its query heads
 * [h, end), KV_HEADS_PER_PASS at a time and the rest one by one, into s[h * s_row + i]; fp8's page K scale goes
 * on each score (a power of two, so the same bits as the dot product of the scaled codes). */
static ALWAYS_INLINE void score_heads(int format, int nt, int h, int end, const float *qs, int64_t row,
                                      const void *const *k, const float *const *ks, float fp8_scale, int head_dim,
                                      float *s, int64_t s_row) {
    while (h < end) {
        const int nh = end - h >= KV_HEADS_PER_PASS ? KV_HEADS_PER_PASS : 1;
        float *sh = s + h * s_row;
        if (nh == KV_HEADS_PER_PASS)
            score_rows(format, KV_HEADS_PER_PASS, nt, qs + h * row, row, k, ks, head_dim, sh, s_row);
        else
            score_rows(format, 1, nt, qs + h * row, row, k, ks, head_dim, sh, s_row);
        if (format == KV_F8)
            for (int j = 0; j < nh; ++j)
                for (int i = 0; i < nt; ++i) sh[j * s_row + i] *= fp8_scale;
        h += nh;
    }
}

/* acc rows of query heads [h, end) += their probabilities p[h * p_row + i] (times fp8's page V scale) times nt
 * V rows of one KV head (v; vs their int8 group scales, NULL entries otherwise), heads grouped as score_heads. */
static ALWAYS_INLINE void accumulate_heads(int format, int nt, int h, int end, float *acc, int64_t row,
                                           const float *p, int64_t p_row, float p_scale, const void *const *v,
                                           const float *const *vs, int head_dim) {
    while (h < end) {
        const int nh = end - h >= KV_HEADS_PER_PASS ? KV_HEADS_PER_PASS : 1;
        if (nh == KV_HEADS_PER_PASS)
            accumulate_rows(format, KV_HEADS_PER_PASS, nt, acc + h * row, row, p + h * p_row, p_row, p_scale, v, vs,
                            head_dim);
        else
            accumulate_rows(format, 1, nt, acc + h * row, row, p + h * p_row, p_row, p_scale, v, vs, head_dim);
        h += nh;
    }
}

/* Attend one span: q scaled (and rotated for int8), the online softmax over the span's pages, then the
 * normalised rows into out (a whole context) or the span's partial state. `scratch` holds one part's rows.
 * Inlined per page format twice (see the entry point): for head_dim 64 with constant trip counts (no
 * remainder code, a 64-wide row's accumulators stay in registers: about 25% less compute), and for any
 * head_dim. */
static ALWAYS_INLINE void attend_span(const Attention *A, const Span *span, int format, int head_dim,
                                      float *scratch) {
    const float *q = A->q;
    const int64_t q_stride_b = A->q_stride_b, q_stride_h = A->q_stride_h;
    const void *k_cache = A->k_cache, *v_cache = A->v_cache;
    const float *k_scale = A->k_scale, *v_scale = A->v_scale;
    const int64_t cache_stride_block = A->cache_stride_block, cache_stride_token = A->cache_stride_token;
    const int64_t cache_stride_head = A->cache_stride_head, table_stride = A->table_stride;
    const int32_t *block_tables = A->block_tables, *seq_lens = A->seq_lens;
    const int batch = A->batch, num_q_heads = A->num_q_heads, num_kv_heads = A->num_kv_heads;
    const int block_size = A->block_size, window = A->window, b = span->b;
    const int group = num_q_heads / num_kv_heads;
    /* Scale strides in floats: int8 [num_blocks, block_size, num_kv_heads, groups] (a token's own, one per
     * KV_I8_GROUP channels), fp8 [num_blocks, num_kv_heads] (every token of a page and head shares one: a token
     * stride of 0). */
    const int64_t scale_head = format == KV_I8 ? int8_groups(head_dim) : 1;
    const int64_t scale_token = format == KV_I8 ? num_kv_heads * scale_head : 0;
    const int64_t scale_block = format == KV_I8 ? (int64_t)block_size * scale_token : num_kv_heads;
    const int64_t row = ((int64_t)head_dim + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int64_t score_row = ((int64_t)block_size + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    float *qs = scratch;
    float *acc = qs + num_q_heads * row;
    float *scores = acc + num_q_heads * row;
    float *run_max = scores + num_q_heads * score_row;
    float *run_sum = run_max + num_q_heads;
    float *page_max = run_sum + num_q_heads;
    float *correction = page_max + num_q_heads;
    const int len = seq_lens[b];
    /* The scale folded into q once, rather than a multiply per score. int8 K rows hold H k, so q is
     * rotated too: (H q) . (H k) = block * q . k, and 1 / block (a power of two) joins the scale. */
    const float q_scale = format == KV_I8 ? A->scale / (float)hadamard_block(head_dim) : A->scale;
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
    for (int page_idx = span->page_lo; page_idx < span->page_hi; ++page_idx) {
        /* The page's part of [first, len): slots past the sequence's length (or before the window)
         * may hold anything (even NaN): never read them. Only the window's first page starts inside. */
        const int lo = page_idx * block_size > first ? page_idx * block_size : first;
        const int hi = len < (page_idx + 1) * block_size ? len : (page_idx + 1) * block_size;
        const int tokens = hi - lo;
        const int64_t skip = (int64_t)(lo - page_idx * block_size) * cache_stride_token;
        const char *k_page = (const char *)k_cache + (int64_t)table[page_idx] * cache_stride_block + skip;
        const char *v_page = (const char *)v_cache + (int64_t)table[page_idx] * cache_stride_block + skip;
        /* int8, fp8: the scales of this page's token lo on, token t's for KV head h at t * scale_token + h *
         * scale_head (unused, and never read, for the other formats). */
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

        /* Scores: a K row, once widened, serves every query head of its KV head (kv_half.h's score_rows). */
        int t = 0;
        for (; t + TOKENS <= tokens; t += TOKENS) {
            for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                const void *k[TOKENS];
                const float *ks[TOKENS]; /* int8's group scales */
                for (int i = 0; i < TOKENS; ++i) {
                    k[i] = k_page + (t + i) * cache_stride_token + kvh * cache_stride_head;
                    ks[i] = format == KV_I8 ? k_page_scale + (t + i) * scale_token + kvh * scale_head : NULL;
                }
                for (int h = kvh * group; h < (kvh + 1) * group; ++h)
                    prefetch_part(next_k, cache_stride_token, t, t + TOKENS, next_tokens, h, num_q_heads);
                score_heads(format, TOKENS, kvh * group, (kvh + 1) * group, qs, row, k, ks,
                            format == KV_F8 ? k_page_scale[kvh] : 1.0f, head_dim, scores + t, score_row);
            }
        }
        prefetch_part(next_k, cache_stride_token, t, next_tokens, next_tokens, 0, 1);
        for (; t < tokens; ++t) {
            for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                const void *k[1] = {k_page + t * cache_stride_token + kvh * cache_stride_head};
                const float *ks[1] = {format == KV_I8 ? k_page_scale + t * scale_token + kvh * scale_head : NULL};
                score_heads(format, 1, kvh * group, (kvh + 1) * group, qs, row, k, ks,
                            format == KV_F8 ? k_page_scale[kvh] : 1.0f, head_dim, scores + t, score_row);
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

        /* V, in the same order as K, each row widened once for its KV head's query heads. fp8's page V scale
         * goes on each probability, int8's group scales on the widened rows (kv_half.h's accumulate_rows). */
        t = 0;
        for (; t + TOKENS <= tokens; t += TOKENS) {
            for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                const void *v[TOKENS];
                const float *vs[TOKENS];
                for (int i = 0; i < TOKENS; ++i) {
                    v[i] = v_page + (t + i) * cache_stride_token + kvh * cache_stride_head;
                    vs[i] = format == KV_I8 ? v_page_scale + (t + i) * scale_token + kvh * scale_head : NULL;
                }
                for (int h = kvh * group; h < (kvh + 1) * group; ++h)
                    prefetch_part(next_v, cache_stride_token, t, t + TOKENS, next_tokens, h, num_q_heads);
                accumulate_heads(format, TOKENS, kvh * group, (kvh + 1) * group, acc, row, scores + t, score_row,
                                 format == KV_F8 ? v_page_scale[kvh] : 1.0f, v, vs, head_dim);
            }
        }
        prefetch_part(next_v, cache_stride_token, t, next_tokens, next_tokens, 0, 1);
        for (; t < tokens; ++t) {
            for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
                const void *v[1] = {v_page + t * cache_stride_token + kvh * cache_stride_head};
                const float *vs[1] = {format == KV_I8 ? v_page_scale + t * scale_token + kvh * scale_head : NULL};
                accumulate_heads(format, 1, kvh * group, (kvh + 1) * group, acc, row, scores + t, score_row,
                                 format == KV_F8 ? v_page_scale[kvh] : 1.0f, v, vs, head_dim);
            }
        }
    }
    /* int8 V rows hold H v, so acc holds H (sum p v): rotated back here, H H = block * I, 1 / block (a power of
     * two) exact. The spans' merge is linear, so a partial state is rotated back before it is stored. */
    if (format == KV_I8) {
        const float inv_block = 1.0f / (float)hadamard_block(head_dim);
        for (int h = 0; h < num_q_heads; ++h) {
            float *a = acc + h * row;
            hadamard_rotate(a, head_dim);
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) a[d] *= inv_block;
        }
    }
    if (span->partial < 0) {
        for (int h = 0; h < num_q_heads; ++h) {
            /* The token at the running max weighs exactly 1, so the sum is >= 1. */
            const float inv = 1.0f / run_sum[h];
            const float *a = acc + h * row;
            float *dst = A->out + b * A->out_stride_b + h * A->out_stride_h;
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) dst[d] = a[d] * inv;
        }
        return;
    }
    float *state = A->partials + span->partial;
    for (int h = 0; h < num_q_heads; ++h, state += head_dim + 2) {
        state[0] = run_max[h];
        state[1] = run_sum[h];
        memcpy(state + 2, acc + h * row, (size_t)head_dim * sizeof(float));
    }
}

static size_t part_scratch_bytes(int num_q_heads, int head_dim, int block_size) {
    const int64_t row = ((int64_t)head_dim + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int64_t score_row = ((int64_t)block_size + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    /* Per query head: scaled query and V accumulator rows, a page of scores, and four scalars. */
    const int64_t floats = (int64_t)num_q_heads * (2 * row + score_row + 4);
    return ((size_t)floats * sizeof(float) + 63) / 64 * 64; /* aligned_alloc: a multiple */
}

/* Part `part` of `parts`: the spans whose first page falls in its share of the call's pages, in order. */
static ALWAYS_INLINE void run_part_as(Attention *A, int part, int parts, int format, int head_dim) {
    const int64_t lo = A->total_pages * part / parts, hi = A->total_pages * (part + 1) / parts;
    float *scratch = aligned_alloc(64, part_scratch_bytes(A->num_q_heads, head_dim, A->block_size));
    if (!scratch) {
        A->status[part] = -1;
        return;
    }
    for (int i = 0; i < A->num_spans; ++i)
        if (A->span_pages_before[i] >= lo && A->span_pages_before[i] < hi)
            attend_span(A, &A->spans[i], format, head_dim, scratch);
    free(scratch);
    A->status[part] = 0;
}

/* The pool's entry (gguf_linear.c's kl_parallel_for): one copy per page format, the engine's head_dim 64
 * with constant trip counts, any other through the generic copy. */
static void run_part(void *ctx, int part, int parts) {
    Attention *A = ctx;
    const int d64 = A->head_dim == 64;
    switch (A->format) {
    case KV_F32: d64 ? run_part_as(A, part, parts, KV_F32, 64) : run_part_as(A, part, parts, KV_F32, A->head_dim); break;
    case KV_F16: d64 ? run_part_as(A, part, parts, KV_F16, 64) : run_part_as(A, part, parts, KV_F16, A->head_dim); break;
    case KV_BF16: d64 ? run_part_as(A, part, parts, KV_BF16, 64) : run_part_as(A, part, parts, KV_BF16, A->head_dim); break;
    case KV_I8: d64 ? run_part_as(A, part, parts, KV_I8, 64) : run_part_as(A, part, parts, KV_I8, A->head_dim); break;
    default: d64 ? run_part_as(A, part, parts, KV_F8, 64) : run_part_as(A, part, parts, KV_F8, A->head_dim); break;
    }
}

/* The thread pool the projections use (gguf_linear.c's kl_parallel_for, set by cpu_kernels.py when it loads
 * this library): one pool in the process, so attention's threads are the projections' and never contend
 * with a second set of spinning workers. NULL: every call runs on the caller's thread. */
typedef void (*parallel_fn)(void (*task)(void *, int, int), void *ctx, int parts);
static parallel_fn parallel_for;

void kl_paged_attention_use_pool(parallel_fn fn) { parallel_for = fn; }

/* SPLIT_TOKENS, for the tests' lengths around the cut points. */
int kl_paged_attention_split_tokens(void) { return SPLIT_TOKENS; }

/* Merge a sequence's split spans (in page order) into its output rows: weights exp(max_i - max), the
 * log-sum-exp merge. */
static void merge_spans(const Attention *A, const Span *spans, int count) {
    const int b = spans[0].b, head_dim = A->head_dim;
    for (int h = 0; h < A->num_q_heads; ++h) {
        float m = -INFINITY;
        for (int i = 0; i < count; ++i) {
            const float mi = A->partials[spans[i].partial + (int64_t)h * (head_dim + 2)];
            m = mi > m ? mi : m;
        }
        float *dst = A->out + b * A->out_stride_b + h * A->out_stride_h;
        memset(dst, 0, (size_t)head_dim * sizeof(float));
        float sum = 0.0f;
        for (int i = 0; i < count; ++i) {
            const float *state = A->partials + spans[i].partial + (int64_t)h * (head_dim + 2);
            const float w = exp_nonpositive(state[0] - m);
            sum += state[1] * w;
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) dst[d] += state[2 + d] * w;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) dst[d] *= inv;
    }
}

/* Strides are in elements (of the cache's format for the caches); the last dimension of q, the caches and
 * out is contiguous, and K and V share their strides. `kv_format`: KV_F32, KV_F16, KV_BF16, KV_I8 or KV_F8
 * (kv_half.h); `k_scale`, `v_scale`: int8 and fp8 only (NULL otherwise), dense float32, int8's
 * [num_blocks, block_size, num_kv_heads, ceil(head_dim / 16)] (one per token and 16 channels), fp8's [num_blocks, num_kv_heads] (one per page).
 * `window`: the sliding window in tokens, 0 for none (see the top of the file). `threads`: at most this many
 * of the pool's threads (the result is the same for any count). Returns 0, -1 when memory cannot be
 * allocated (then `out` may be partly written), or -2 for an unknown kv_format. */
int kl_paged_decode_attention(const float *q, int64_t q_stride_b, int64_t q_stride_h, const void *k_cache,
                              const void *v_cache, int kv_format, const float *k_scale, const float *v_scale,
                              int64_t cache_stride_block,
                              int64_t cache_stride_token, int64_t cache_stride_head, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, int batch, int num_q_heads,
                              int num_kv_heads, int head_dim, int block_size, float scale, int window, float *out,
                              int64_t out_stride_b, int64_t out_stride_h, int threads) {
    if (kv_format != KV_F32 && kv_format != KV_F16 && kv_format != KV_BF16 && !kv_scaled(kv_format)) return -2;
    if (kv_scaled(kv_format) && (!k_scale || !v_scale)) return -2;
    const int64_t element = kv_element_bytes(kv_format);
    const int per_split = split_pages(block_size);
    int num_spans = 0;
    int64_t partial_floats = 0;
    for (int b = 0; b < batch; ++b) {
        const int len = seq_lens[b];
        if (len <= 0) {
            for (int h = 0; h < num_q_heads; ++h)
                memset(out + b * out_stride_b + h * out_stride_h, 0, (size_t)head_dim * sizeof(float));
            continue;
        }
        const int pieces = (len - 1) / block_size / per_split - window_start(len, window) / block_size / per_split + 1;
        num_spans += pieces;
        if (pieces > 1) partial_floats += (int64_t)pieces * num_q_heads * (head_dim + 2);
    }
    if (num_spans == 0) return 0;
    Span *spans = malloc((size_t)num_spans * (sizeof(Span) + sizeof(int64_t)));
    float *partials = partial_floats ? malloc((size_t)partial_floats * sizeof(float)) : NULL;
    if (!spans || (partial_floats && !partials)) {
        free(spans);
        free(partials);
        return -1;
    }
    int64_t *pages_before = (int64_t *)(spans + num_spans);
    int n = 0;
    int64_t pages = 0, partial_at = 0;
    for (int b = 0; b < batch; ++b) {
        const int len = seq_lens[b];
        if (len <= 0) continue;
        const int first_page = window_start(len, window) / block_size, end_page = (len - 1) / block_size + 1;
        const int whole = first_page / per_split == (end_page - 1) / per_split;
        for (int lo = first_page; lo < end_page; n++) {
            const int hi = (lo / per_split + 1) * per_split < end_page ? (lo / per_split + 1) * per_split : end_page;
            spans[n] = (Span){b, lo, hi, whole ? -1 : partial_at};
            if (!whole) partial_at += (int64_t)num_q_heads * (head_dim + 2);
            pages_before[n] = pages;
            pages += hi - lo;
            lo = hi;
        }
    }
    Attention a = {q, q_stride_b, q_stride_h, k_cache, v_cache, kv_format, k_scale, v_scale,
                   cache_stride_block * element, cache_stride_token * element, cache_stride_head * element,
                   block_tables, table_stride, seq_lens, batch, num_q_heads, num_kv_heads, head_dim, block_size,
                   scale, window, out, out_stride_b, out_stride_h, spans, pages_before, num_spans, pages,
                   partials, {0}};
    /* At most `threads` parts, one span each at least, and MIN_PAGES_PER_PART pages each. */
    const int64_t by_work = pages / MIN_PAGES_PER_PART;
    int parts = threads < 1 ? 1 : threads > MAX_PARTS ? MAX_PARTS : threads;
    if (parts > num_spans) parts = num_spans;
    if (parts > by_work) parts = by_work > 1 ? (int)by_work : 1;
    if (parts > 1 && parallel_for) {
        parallel_for(run_part, &a, parts);
    } else {
        parts = 1;
        run_part(&a, 0, 1);
    }
    int status = 0;
    for (int p = 0; p < parts; ++p) status = a.status[p] ? a.status[p] : status;
    for (int i = 0; status == 0 && i < num_spans;) { /* each split sequence's spans are consecutive */
        int count = 1;
        while (i + count < num_spans && spans[i + count].b == spans[i].b) count++;
        if (spans[i].partial >= 0) merge_spans(&a, spans + i, count);
        i += count;
    }
    free(spans);
    free(partials);
    return status;
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
                               int head_dim, int block_size, float *rotated) { /* rotated: int8's scratch */
    const int64_t block = slot / block_size;
    const int offset = (int)(slot % block_size);
    for (int h = 0; h < num_kv_heads; ++h) {
        const float *row = x + (int64_t)h * head_dim;
        uint8_t *page = cache + block * stride_block + h * stride_head;
        if (format == KV_I8)
            write_int8_row(row, head_dim, (int8_t *)(page + offset * stride_token),
                           scales + (slot * num_kv_heads + h) * int8_groups(head_dim), rotated);
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
                           cache_stride_token, cache_stride_head, num_kv_heads, head_dim, block_size, rotated);
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
 * of -1 stores nothing. `out` [tokens, Hq * head_dim] is contiguous. `threads`: as kl_paged_decode_attention's.
 * Returns 0, or -1 when scratch memory cannot be allocated (then the cache may hold this call's K and V but
 * `out` is not all written). */
int kl_rope_write_paged_attention(const float *qkv, int64_t qkv_stride, const float *cos_rows,
                                  const float *sin_rows, const int64_t *slots, void *k_cache, void *v_cache,
                                  int kv_format, float *k_scale, float *v_scale, int64_t cache_stride_block,
                                  int64_t cache_stride_token, int64_t cache_stride_head, const int32_t *block_tables,
                                  int64_t table_stride, const int32_t *seq_lens, int tokens, int num_q_heads,
                                  int num_kv_heads, int head_dim, int block_size, float scale, int window,
                                  float *out, int threads) {
    if (kv_format != KV_F32 && kv_format != KV_F16 && kv_format != KV_BF16 && !kv_scaled(kv_format)) return -2;
    if (kv_scaled(kv_format) && (!k_scale || !v_scale)) return -2;
    const int64_t q_row = (int64_t)num_q_heads * head_dim, kv_row = (int64_t)num_kv_heads * head_dim;
    const int64_t element = kv_element_bytes(kv_format);
    /* The query rows, then the token's roped K rows (converted from there when the pages are narrow). */
    float *q = malloc(((size_t)(tokens > 0 ? tokens : 1) * (size_t)q_row + (size_t)kv_row + (size_t)head_dim) *
                      sizeof(float)); /* + head_dim: an int8 row's rotation */
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
                               cache_stride_token, cache_stride_head, num_kv_heads, head_dim, block_size,
                               k_row + kv_row);
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
                                               out + t * q_row, q_row, head_dim, threads);
    }
    if (!kv_scaled(kv_format))
        status = kl_paged_decode_attention(q, q_row, head_dim, k_cache, v_cache, kv_format, NULL, NULL,
                                           cache_stride_block, cache_stride_token, cache_stride_head, block_tables,
                                           table_stride, seq_lens, tokens, num_q_heads, num_kv_heads, head_dim,
                                           block_size, scale, window, out, q_row, head_dim, threads);
    free(q);
    return status;
}
