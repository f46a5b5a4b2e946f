/* A CPU decode step's whole decoder stack in one C call (kernel_lab/models/decode_stack.py says when).
 *
 * Why: at batch 1 on the bundled model the Python between a layer's C calls (module calls, the projection,
 * norm and attention wrappers, ctypes argument conversion, tensor allocations), with caches the weight
 * stream keeps cold, was about a fifth of a step and did not split over threads (cpu_step_profile.py).
 *
 * What: for each layer exactly the calls DecoderLayer.forward makes on a fused CPU decode step, in the same
 * order on the same values: add+RMSNorm, the qkv projection, RoPE + KV write + attention, o_proj,
 * add+RMSNorm, gate_up, SiLU-and-mul, down. The kernels are the other libraries' own entry points, passed
 * in as function pointers (kl_gguf_linear, kl_add_rms_norm_f32, kl_silu_and_mul_f32,
 * kl_rope_write_paged_attention, and kl_lora_bgmv after each projection where LoRA rows are set), so the
 * arithmetic is theirs and the outputs are bit-identical to the Python path. No checks here: decode_stack.py checks the model's shapes once and the step's conditions are
 * those of the fused decode path (models/attention.py).
 */

#include <stdint.h>

typedef int (*linear_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, int64_t, float *,
                         int64_t, int);
typedef void (*norm_fn)(const float *, int64_t, const float *, int64_t, const float *, float, float *, int64_t,
                        float *, int64_t, int64_t, int64_t);
typedef void (*silu_fn)(const float *, int64_t, float *, int64_t, int64_t, int64_t);
typedef int (*lora_fn)(float *, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, const int32_t *, int,
                       const void *, const void *, int, int64_t, int64_t, int64_t, const float *, int, int,
                       const int64_t *, int);
typedef int (*attention_fn)(const float *, int64_t, const float *, const float *, const int64_t *, void *,
                            void *, int, float *, float *, int64_t, int64_t, int64_t, const int32_t *, int64_t,
                            const int32_t *, int, int, int, int, int, float, int, float *, int);

/* Per layer, LAYER_FIELDS int64 words: input norm, post-attention norm, k cache, v cache, k scale, v scale
 * (pointers; the scales are int8 and fp8 pages' float32 [num_blocks, num_kv_heads], else NULL), then type
 * and tiles pointer of qkv, o, gate_up and down. */
#define LAYER_FIELDS 14

/* LoRA (engine/lora.py's slots; NULL `lora` or `row_slots`: none), LORA_HEADER words: scale pointer, slots,
 * rank, the slots' weight format (lora.c's: 0 float32, 1 bfloat16); then per projection (qkv, o, gate_up, down) LORA_PROJECTION words: slices S, S + 1
 * column offsets (room for 4), B's strides (slot, n, r); then per layer, per projection, A and B pointers
 * (LORA_LAYER words). After each projection kl_lora_bgmv (fns[4]) adds the rows' deltas, as the layer
 * loop's LoRALinear does through add_lora. */
#define LORA_HEADER 4
#define LORA_PROJECTION 8
#define LORA_LAYER 8

/* sizes: h, qkv_n, q_heads, kv_heads, head_dim, inter (gate_up has 2 * inter rows), block_size.
 * cache: kv_format, stride block, token, head. hidden [rows, h] is the stack's input: already normalised
 * by layer 0's input norm when `normed_first` (residual then the embedding rows), else the residual stream
 * continues from `residual`. scratch: rows * (4 h + qkv_n + q_heads * head_dim + 3 inter) floats; out
 * hidden and residual are written to out_hidden and out_residual [rows, h]. Returns 0, or the first
 * failing kernel's status. */
int kl_decode_stack(const int64_t *layers, int num_layers, void *const *fns, const float *hidden,
                    const float *residual, int normed_first, int64_t rows, const int64_t *sizes, float eps,
                    float scale, int window, const float *cos_rows, const float *sin_rows, const int64_t *slots,
                    const int64_t *cache, const int32_t *block_tables, int64_t table_stride,
                    const int32_t *seq_lens, int threads, const int64_t *lora, const int32_t *row_slots,
                    float *scratch, float *out_hidden, float *out_residual) {
    const linear_fn linear = (linear_fn)fns[0];
    const norm_fn add_rms_norm = (norm_fn)fns[1];
    const silu_fn silu_and_mul = (silu_fn)fns[2];
    const attention_fn attention = (attention_fn)fns[3];
    const lora_fn add_lora = (lora_fn)fns[4];
    const int with_lora = lora && row_slots;
    const int64_t h = sizes[0], qkv_n = sizes[1], q_heads = sizes[2], kv_heads = sizes[3], head_dim = sizes[4],
                  inter = sizes[5], block_size = sizes[6], attn_n = q_heads * head_dim;
    float *res[2] = {scratch, scratch + rows * h};
    float *normed = res[1] + rows * h, *o = normed + rows * h, *qkv = o + rows * h, *attn = qkv + rows * qkv_n;
    float *gate_up = attn + rows * attn_n, *act = gate_up + rows * 2 * inter;
    const float *x = hidden, *r = residual;
    int status = 0, next = 0;   /* each norm writes its residual into res[next], never the buffer it reads */
/* projection p of layer i: y [rows, n] += its LoRA deltas for x [rows, k] */
#define LORA(p, y, n, x, k)                                                                                      \
    if (with_lora) {                                                                                            \
        const int64_t *pr = lora + LORA_HEADER + (p) * LORA_PROJECTION;                                          \
        const int64_t *ab = lora + LORA_HEADER + 4 * LORA_PROJECTION + (int64_t)i * LORA_LAYER + 2 * (p);        \
        if ((status = add_lora((y), (n), (x), (k), rows, (k), (n), row_slots, (int)lora[1],                      \
                               (const void *)(intptr_t)ab[0], (const void *)(intptr_t)ab[1], (int)lora[3],       \
                               pr[5], pr[6],                                                                     \
                               pr[7], (const float *)(intptr_t)lora[0], (int)pr[0], (int)lora[2], pr + 1,         \
                               threads)))                                                                        \
            return status;                                                                                       \
    }
    for (int i = 0; i < num_layers; i++) {
        const int64_t *l = layers + (int64_t)i * LAYER_FIELDS;
        const float *input_norm = (const float *)(intptr_t)l[0], *post_norm = (const float *)(intptr_t)l[1];
        const float *normed_in;
        if (i == 0 && normed_first) {
            normed_in = x;
        } else {
            add_rms_norm(x, h, r, h, input_norm, eps, normed, h, res[next], h, rows, h);
            normed_in = normed;
            r = res[next];
            next ^= 1;
        }
        if ((status = linear((int)l[6], (const uint8_t *)(intptr_t)l[7], qkv_n, h, normed_in, rows, h, qkv, qkv_n,
                             threads)))
            return status;
        LORA(0, qkv, qkv_n, normed_in, h)
        if ((status = attention(qkv, qkv_n, cos_rows, sin_rows, slots, (void *)(intptr_t)l[2],
                                (void *)(intptr_t)l[3], (int)cache[0], (float *)(intptr_t)l[4],
                                (float *)(intptr_t)l[5], cache[1], cache[2], cache[3], block_tables,
                                table_stride, seq_lens, (int)rows, (int)q_heads, (int)kv_heads, (int)head_dim,
                                (int)block_size, scale, window, attn, threads)))
            return status;
        if ((status = linear((int)l[8], (const uint8_t *)(intptr_t)l[9], h, attn_n, attn, rows, attn_n, o, h,
                             threads)))
            return status;
        LORA(1, o, h, attn, attn_n)
        add_rms_norm(o, h, r, h, post_norm, eps, normed, h, res[next], h, rows, h);
        r = res[next];
        next ^= 1;
        if ((status = linear((int)l[10], (const uint8_t *)(intptr_t)l[11], 2 * inter, h, normed, rows, h, gate_up,
                             2 * inter, threads)))
            return status;
        LORA(2, gate_up, 2 * inter, normed, h)
        silu_and_mul(gate_up, 2 * inter, act, inter, rows, inter);
        float *down = i == num_layers - 1 ? out_hidden : o;
        if ((status = linear((int)l[12], (const uint8_t *)(intptr_t)l[13], h, inter, act, rows, inter, down, h,
                             threads)))
            return status;
        LORA(3, down, h, act, inter)
        x = down;
    }
    for (int64_t j = 0; j < rows * h; j++) out_residual[j] = r[j];
    return 0;
}
