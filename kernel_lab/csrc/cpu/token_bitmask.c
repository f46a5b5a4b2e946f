/* The CPU path of project 06's token-bitmask op: logits[rows[i], j] = -inf wherever bit j of bitmask row i
 * is 0 (xgrammar's layout: token j is bit j % 32 of int32 word j / 32, bit = 1 means allowed).
 *
 * Contract: kernel_lab/ops/token_bitmask.py (validation happens there). Plain C built on first use by
 * kernel_lab/ops/cpu_kernels.py and called through ctypes.
 *
 * Why in C: a CPU decode step with structured requests masks a few rows of ~50K logits. As torch ops the
 * mask is unpacked into a [rows, vocab] boolean tensor (a shift, an and, a compare, a masked fill: four
 * full-size temporaries) before anything is written; here each word is read once and only the disallowed
 * logits are written, so allowed entries are never touched and a word of all ones costs one compare.
 *
 * The logits are written as raw bit patterns (`neg_inf_bits`, the caller's dtype's -inf) so one loop serves
 * fp32 (4-byte elements) and fp16/bf16 (2-byte elements) without any float conversion. */

#include <stdint.h>

/* -inf into element k of a row of 2- or 4-byte elements (a branch the predictor learns: one size per call). */
static inline void store_neg_inf(void *row, int64_t k, int elem_bytes, uint32_t neg_inf) {
    if (elem_bytes == 4)
        ((uint32_t *)row)[k] = neg_inf;
    else
        ((uint16_t *)row)[k] = (uint16_t)neg_inf;
}

static void mask_row(void *row, int elem_bytes, int64_t col_stride, int64_t vocab, const int32_t *words,
                     uint32_t neg_inf) {
    for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = (uint32_t)words[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t end = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
        for (int64_t b = 0; b < end; ++b)
            if (!((word >> b) & 1u)) store_neg_inf(row, (w * 32 + b) * col_stride, elem_bytes, neg_inf);
    }
}

/* logits: element size elem_bytes (2 or 4), strides in elements. bitmask: n_masks rows of ceil(vocab / 32)
 * int32 words, `mask_stride` words apart. rows: n_masks logits row numbers (int64), or NULL for row i = i.
 * Returns 0, or -1 for an unsupported element size (nothing written). */
int kl_apply_token_bitmask(void *logits, int elem_bytes, uint32_t neg_inf_bits, int64_t row_stride,
                           int64_t col_stride, int64_t vocab, const int32_t *bitmask, int64_t mask_stride,
                           const int64_t *rows, int64_t n_masks) {
    if (elem_bytes != 2 && elem_bytes != 4) return -1;
    for (int64_t i = 0; i < n_masks; ++i) {
        const int64_t r = rows ? rows[i] : i;
        char *row = (char *)logits + r * row_stride * elem_bytes;
        mask_row(row, elem_bytes, col_stride, vocab, bitmask + i * mask_stride, neg_inf_bits);
    }
    return 0;
}
