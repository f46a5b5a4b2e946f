/* Multi-LoRA's CPU path (project 11, kernel_lab/ops/lora.py): for each row t of a BGMV map with slot
 * a = row_slots[t] >= 0,
 *     h[t, s*R + r]   = sum_k x[t, k] * A[a, s, r, k]                          (shrink, fp32)
 *     y[t, n]        += scale[a] * sum_r h[t, s(n)*R + r] * B[a, n, r]          (expand, s(n): n's slice)
 * and rows with a = -1 are not touched (their bits stay the base projection's).
 *
 * Why C: the torch form ran one small matmul per adapter and per projection, and its dispatch, not its
 * arithmetic, was the LoRA step's cost (a 30-layer model makes 120 projections a step). Here one call per
 * projection does both steps, and decode_stack.c calls it between a layer's projections.
 *
 * Traffic: each distinct adapter's A and B rows are read once per call (its rows are grouped, so a weight
 * row read for the group's first row is in L1 for the others); x and h stay in cache.
 *
 * Bits: every h sums its k products in LANES fixed partial sums added in a fixed order, and every y column
 * sums its R products in order r = 0..R-1, on its own row's values, so a row's result does not depend on
 * the other rows, the thread count, the split or B's layout. Work is split over gguf_linear.c's pool
 * (kl_parallel_for, set by cpu_kernels.py as for the attention library): by whole groups where there are
 * at least as many as parts (one dispatch, both steps per part), else by columns (shrink, then expand).
 *
 * Weights are float32 or bfloat16 (`weight_format`, vLLM's --lora-dtype; widened exactly in registers, so a
 * bfloat16 slot gives the bits of a float32 slot holding the same values). Half the bytes and half the slots'
 * memory, but not half the time: in a kernel-only A/B on a 2-core Zen 4 (the bundled model's 30 layers, 8
 * rows, 2 threads) bfloat16 was level with float32 at 4 adapters a step and about 10% faster at 8, so the
 * widening's work, not only the bytes, bounds the calls (an earlier try on a 2-core Xeon measured no gain).
 * A is [slots, S, R, K], contiguous, and B [slots, N, R] with any strides (in elements). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))
enum { LORA_F32 = 0, LORA_BF16 = 1 };

/* Element i of float32 or bfloat16 weights as float32 (a bfloat16 is a float32's top half: exact). */
static ALWAYS_INLINE float weight_at(const void *w, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef void (*parallel_fn)(void (*task)(void *, int, int), void *ctx, int parts);
static parallel_fn parallel_for;

void kl_lora_use_pool(parallel_fn fn) { parallel_for = fn; }

/* Below this many weight bytes a part, a split costs more in wake-ups than it saves (the work is bound by
 * reading the weights: a few multiply-adds per byte at decode's row counts). */
#define MIN_BYTES_PER_PART 16384
#define MAX_PARTS 64

typedef struct {
    float *y;
    int64_t ldy;
    const float *x;
    int64_t ldx, k, n;
    const void *a, *b;         /* float32 or bfloat16 (bf16) */
    int bf16;
    int64_t b_stride_slot, b_stride_n, b_stride_r;
    int num_slices, rank;
    const int64_t *offsets;
    const float *scale;
    const int32_t *order;      /* adapted rows grouped by slot: group g is order[group_begin[g] .. group_begin[g+1]) */
    const int32_t *group_slot;
    const int32_t *group_begin;
    int groups;
    float *h;                  /* [rows, S*R] */
    int64_t hw;                /* S*R */
} Lora;

/* h[t, j .. j + SHRINK_J) for one row: SHRINK_J dots over k at once, each in LANES partial sums (one
 * 512-bit or two 256-bit vectors), so the multiply-adds form independent chains and x is loaded once per
 * SHRINK_J weight rows; the lanes are then added in a fixed order. */
#define SHRINK_J 4
#define LANES 16

/* always inlined, so the full-block call below gets a constant count and keeps acc in registers */
static ALWAYS_INLINE void shrink_row(const Lora *L, const float *x, int64_t slot_base, int64_t j0, int64_t count,
                                     float *h, const int bf16) {
    const int64_t k = L->k, body = k - k % LANES;
    float acc[SHRINK_J][LANES] = {{0}};
    for (int64_t c = 0; c < body; c += LANES)
        for (int64_t jj = 0; jj < count; jj++) {
            const int64_t w = slot_base + (j0 + jj) * k + c;
#pragma omp simd
            for (int v = 0; v < LANES; v++) acc[jj][v] += x[c + v] * weight_at(L->a, w + v, bf16);
        }
    for (int64_t jj = 0; jj < count; jj++) {
        const int64_t w = slot_base + (j0 + jj) * k;
        for (int64_t c = body; c < k; c++)
            acc[jj][c - body] += x[c] * weight_at(L->a, w + c, bf16);
        float sum = 0.0f;
        for (int v = 0; v < LANES; v++) sum += acc[jj][v];
        h[jj] = sum;
    }
}

/* h's columns j0 .. j1 for group g's rows. */
static ALWAYS_INLINE void shrink_group_as(const Lora *L, int g, int64_t j0, int64_t j1, const int bf16) {
    const int64_t slot_base = (int64_t)L->group_slot[g] * L->hw * L->k;
    for (int64_t j = j0; j < j1; j += SHRINK_J) {
        const int64_t count = j1 - j < SHRINK_J ? j1 - j : SHRINK_J;
        for (int32_t i = L->group_begin[g]; i < L->group_begin[g + 1]; i++) {
            const int32_t t = L->order[i];
            if (count == SHRINK_J)
                shrink_row(L, L->x + t * L->ldx, slot_base, j, SHRINK_J, L->h + t * L->hw + j, bf16);
            else
                shrink_row(L, L->x + t * L->ldx, slot_base, j, count, L->h + t * L->hw + j, bf16);
        }
    }
}

static void shrink_group(const Lora *L, int g, int64_t j0, int64_t j1) {
    if (L->bf16)
        shrink_group_as(L, g, j0, j1, 1);
    else
        shrink_group_as(L, g, j0, j1, 0);
}

/* A block of columns sums acc[i] += h[r] * B[r, c0 + i] over r, vectorised over i. B with its n stride 1 in
 * float32 (stored [slots, R, N], as the engine's CPU slots are) is read in place; any other layout
 * is first copied, 16 ranks at a time, into a tile of that form, so every layout runs the same
 * multiply-adds and gives the same bits. */
#define EXPAND_BLOCK 256
#define TILE_RANKS 16

static ALWAYS_INLINE void axpy_weights(float *acc, float hv, const void *b, int64_t at, int64_t w, const int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < w; i++) acc[i] += hv * weight_at(b, at + i, bf16);
}

typedef float f32x16 __attribute__((vector_size(64)));

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* 16 weights from element i on, widened to float32 */
static ALWAYS_INLINE f32x16 load16_weights(const void *w, int64_t i, const int bf16) {
    if (!bf16) return load16((const float *)w + i);
    u16x16 h;
    __builtin_memcpy(&h, (const uint16_t *)w + i, sizeof h);
    const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

/* The in-place layout's full blocks of 64 columns: their sums live in four 16-float vector registers over
 * all R ranks (GCC vector types, lowered to whatever the ISA has) and are stored once, where the generic
 * loop below keeps them in a stack array that every rank's multiply-add loads and stores. The same sums in
 * the same order as the generic path, so the same bits. */
static ALWAYS_INLINE void expand_register_block(const float *hr, const void *b, int64_t at, int64_t sr, int64_t R,
                                                float sc, float *yr, const int bf16) {
    f32x16 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    for (int64_t r = 0; r < R; r++) {
        const float hv = hr[r];
        const int64_t row = at + r * sr;
        acc0 += hv * load16_weights(b, row, bf16);
        acc1 += hv * load16_weights(b, row + 16, bf16);
        acc2 += hv * load16_weights(b, row + 32, bf16);
        acc3 += hv * load16_weights(b, row + 48, bf16);
    }
    const f32x16 out[4] = {load16(yr) + sc * acc0, load16(yr + 16) + sc * acc1, load16(yr + 32) + sc * acc2,
                           load16(yr + 48) + sc * acc3};
    __builtin_memcpy(yr, out, sizeof out);
}

#define REGISTER_BLOCK 64

/* b: the slot's B (element `at` is its (0, 0)) */
static ALWAYS_INLINE void expand_columns(const Lora *L, const float *hr, const void *b, int64_t at, int64_t n0,
                                         int64_t n1, float sc, float *yr, const int bf16) {
    const int64_t R = L->rank, sn = L->b_stride_n, sr = L->b_stride_r;
    const int in_place = sn == 1;
    float tile[TILE_RANKS][EXPAND_BLOCK];
    if (in_place)
        for (; n0 + REGISTER_BLOCK <= n1; n0 += REGISTER_BLOCK)
            expand_register_block(hr, b, at + n0, sr, R, sc, yr + n0, bf16);
    for (int64_t c0 = n0; c0 < n1; c0 += EXPAND_BLOCK) {
        const int64_t w = n1 - c0 < EXPAND_BLOCK ? n1 - c0 : EXPAND_BLOCK;
        float acc[EXPAND_BLOCK] = {0};
        for (int64_t r0 = 0; r0 < R; r0 += TILE_RANKS) {
            const int64_t rc = R - r0 < TILE_RANKS ? R - r0 : TILE_RANKS;
            if (in_place) {
                for (int64_t r = 0; r < rc; r++) axpy_weights(acc, hr[r0 + r], b, at + (r0 + r) * sr + c0, w, bf16);
                continue;
            }
            for (int64_t r = 0; r < rc; r++)
                for (int64_t i = 0; i < w; i++) {
                    const int64_t e = (c0 + i) * sn + (r0 + r) * sr;
                    tile[r][i] = weight_at(b, at + e, bf16);
                }
            for (int64_t r = 0; r < rc; r++) axpy_weights(acc, hr[r0 + r], tile[r], 0, w, 0);
        }
#pragma omp simd
        for (int64_t i = 0; i < w; i++) yr[c0 + i] += sc * acc[i];
    }
}

/* y's columns n0 .. n1 for group g's rows. */
static ALWAYS_INLINE void expand_group_as(const Lora *L, int g, int64_t n0, int64_t n1, const int bf16) {
    const int32_t slot = L->group_slot[g];
    const int64_t at = (int64_t)slot * L->b_stride_slot;
    for (int s = 0; s < L->num_slices; s++) {   /* the columns of slice s */
        const int64_t lo = L->offsets[s] > n0 ? L->offsets[s] : n0;
        const int64_t hi = L->offsets[s + 1] < n1 ? L->offsets[s + 1] : n1;
        if (lo >= hi) continue;
        for (int32_t i = L->group_begin[g]; i < L->group_begin[g + 1]; i++) {
            const int32_t t = L->order[i];
            expand_columns(L, L->h + t * L->hw + s * L->rank, L->b, at, lo, hi, L->scale[slot], L->y + t * L->ldy,
                           bf16);
        }
    }
}

static void expand_group(const Lora *L, int g, int64_t n0, int64_t n1) {
    if (L->bf16)
        expand_group_as(L, g, n0, n1, 1);
    else
        expand_group_as(L, g, n0, n1, 0);
}

/* Split by groups (as many groups as parts, or more): a part owns whole groups, the ones whose first row
 * falls in its share of the adapted rows, and runs both steps for them; no part waits for another. */
static void groups_part(void *ctx, int part, int parts) {
    const Lora *L = ctx;
    const int64_t adapted = L->group_begin[L->groups];
    for (int g = 0; g < L->groups; g++) {
        if ((int64_t)L->group_begin[g] * parts / adapted != part) continue;
        shrink_group(L, g, 0, L->hw);
        expand_group(L, g, 0, L->n);
    }
}

/* Split by columns (fewer groups than parts): shrink by h's columns, then expand by y's columns, starting
 * on 16-float (64-byte) boundaries so no two threads write one cache line of y. */
static void shrink_part(void *ctx, int part, int parts) {
    const Lora *L = ctx;
    for (int g = 0; g < L->groups; g++) shrink_group(L, g, L->hw * part / parts, L->hw * (part + 1) / parts);
}

static void expand_part(void *ctx, int part, int parts) {
    const Lora *L = ctx;
    const int64_t lines = (L->n + 15) / 16;
    const int64_t n1 = 16 * (lines * (part + 1) / parts);
    for (int g = 0; g < L->groups; g++) expand_group(L, g, 16 * (lines * part / parts), n1 < L->n ? n1 : L->n);
}

static int parts_for(int64_t bytes, int64_t units, int threads) {
    int64_t parts = bytes / MIN_BYTES_PER_PART;
    if (parts > threads) parts = threads;
    if (parts > units) parts = units;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    return parts < 1 || !parallel_for ? 1 : (int)parts;
}

static void run(void (*task)(void *, int, int), Lora *L, int parts) {
    if (parts > 1)
        parallel_for(task, L, parts);
    else
        task(L, 0, 1);
}

/* y [rows, n] (row stride ldy) += the LoRA delta of each adapted row of x [rows, k] (ldx); b's element
 * (slot, n, r) at b_stride_slot * slot + b_stride_n * n + b_stride_r * r; offsets: the
 * S + 1 slice boundaries of y's columns (0 .. n). Returns 0, -1 for bad sizes, -2 when out of memory. The
 * caller checked the slots (in [-1, slots)) and the shapes once, where they entered. */
int kl_lora_bgmv(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t n,
                 const int32_t *row_slots, int num_slots, const void *a, const void *b, int weight_format,
                 int64_t b_stride_slot, int64_t b_stride_n, int64_t b_stride_r,
                 const float *scale, int num_slices, int rank, const int64_t *offsets, int threads) {
    if (rows < 0 || k < 1 || n < 1 || num_slots < 1 || num_slices < 1 || rank < 1 || offsets[0] != 0 ||
        offsets[num_slices] != n || (weight_format != LORA_F32 && weight_format != LORA_BF16))
        return -1;
    if (rows == 0) return 0;
    const int64_t hw = (int64_t)num_slices * rank;
    int32_t *counts = calloc((size_t)num_slots + 1, sizeof *counts);
    int32_t *order = malloc((size_t)rows * sizeof *order);
    int32_t *group_slot = malloc((size_t)num_slots * sizeof *group_slot);
    int32_t *group_begin = malloc(((size_t)num_slots + 1) * sizeof *group_begin);
    float *h = malloc((size_t)(rows * hw) * sizeof *h);
    int status = 0;
    if (!counts || !order || !group_slot || !group_begin || !h) {
        status = -2;
        goto done;
    }
    int64_t adapted = 0;
    for (int64_t t = 0; t < rows; t++)
        if (row_slots[t] >= 0) counts[row_slots[t]]++, adapted++;
    if (adapted == 0) goto done;
    /* a counting sort of the adapted rows by slot, each group in row order */
    int groups = 0, begin = 0;
    for (int s = 0; s < num_slots; s++) {
        if (!counts[s]) continue;
        group_slot[groups] = s;
        group_begin[groups++] = begin;
        const int c = counts[s];
        counts[s] = begin;   /* now the slot's next free position */
        begin += c;
    }
    group_begin[groups] = begin;
    for (int64_t t = 0; t < rows; t++)
        if (row_slots[t] >= 0) order[counts[row_slots[t]]++] = (int32_t)t;
    Lora L = {.y = y, .ldy = ldy, .x = x, .ldx = ldx, .k = k, .n = n, .a = a, .b = b,
              .bf16 = weight_format == LORA_BF16, .b_stride_slot = b_stride_slot, .b_stride_n = b_stride_n,
              .b_stride_r = b_stride_r, .num_slices = num_slices, .rank = rank, .offsets = offsets, .scale = scale,
              .order = order, .group_slot = group_slot, .group_begin = group_begin, .groups = groups, .h = h,
              .hw = hw};
    const int64_t weight_bytes = groups * (int64_t)(weight_format == LORA_BF16 ? 2 : 4);
    const int wanted = parts_for(weight_bytes * (hw * k + n * rank), n, threads);
    if (groups >= wanted) {
        run(groups_part, &L, wanted);
    } else {
        run(shrink_part, &L, parts_for(weight_bytes * hw * k, hw, threads));
        run(expand_part, &L, parts_for(weight_bytes * n * rank, (n + 15) / 16, threads));
    }
done:
    free(counts);
    free(order);
    free(group_slot);
    free(group_begin);
    free(h);
    return status;
}
