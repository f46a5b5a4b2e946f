/* The CPU float32 paths of two small ops that sit between a layer's linear layers: fused residual-add +
 * RMSNorm (project 01) and SwiGLU's silu_and_mul (project 02).
 *
 * Contracts: kernel_lab/ops/rmsnorm.py and kernel_lab/ops/swiglu.py (same math, fp32 throughout). Plain C
 * built on first use by kernel_lab/ops/cpu_kernels.py and called through ctypes.
 *
 * Why in C: at batch 1 a CPU decode step runs each of these about 30-60 times on a few hundred floats. The
 * arithmetic is well under a microsecond; as torch ops (an add, the norm, silu, a product, each dispatched
 * and allocated) they cost tens of microseconds per layer, which is time the linear layers cannot hide.
 *
 * Single-threaded: rows are short, and the callers run with torch on one thread during a quantized step. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_nonpositive.h"

/* out = x / sqrt(mean(x^2) + eps) * weight per row of h floats. With `residual` (else NULL): the row is
 * x + residual instead, stored to residual_out first (the fused op's second output); residual_out may be
 * x or residual itself. Row strides in elements; each row is contiguous. */
void kl_add_rms_norm_f32(const float *x, int64_t ldx, const float *residual, int64_t ldr, const float *weight,
                         float eps, float *out, int64_t ldo, float *residual_out, int64_t ldro, int64_t rows,
                         int64_t h) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ldx;
        if (residual) {
            const float *res = residual + r * ldr;
            float *sum = residual_out + r * ldro;
#pragma omp simd
            for (int64_t i = 0; i < h; ++i) sum[i] = row[i] + res[i];
            row = sum;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < h; ++i) squares += row[i] * row[i];
        const float inv = 1.0f / sqrtf(squares / (float)h + eps);
        float *o = out + r * ldo;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) o[i] = row[i] * inv * weight[i];
    }
}

/* out[:, i] = silu(x[:, i]) * x[:, d + i]: x rows hold [gate | up]. silu(g) = g / (1 + exp(-g)), taken as
 * g e / (1 + e) with e = exp(g) for g < 0 so that exp's argument is never positive (no overflow). */
void kl_silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * ldx, *up = gate + d;
        float *o = out + r * ldo;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
            const float g = gate[i];
            const float e = exp_nonpositive(g < 0.0f ? g : -g);
            const float sig = g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
            o[i] = g * sig * up[i];
        }
    }
}
