/* The CPU float32 paths of the small ops that sit between a layer's linear layers: fused residual-add +
 * RMSNorm (project 01) and the gated activations silu_and_mul / gelu_and_mul (project 02).
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

/* sigmoid(z) with exp's argument never positive (no overflow): e / (1 + e) with e = exp(z) for z < 0. */
#pragma omp declare simd notinbranch
static inline float sigmoid(float z) {
    const float e = exp_nonpositive(z < 0.0f ? z : -z);
    return z < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

/* out[:, i] = silu(x[:, i]) * x[:, d + i]: x rows hold [gate | up]; silu(g) = g sigmoid(g). */
void kl_silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * ldx, *up = gate + d;
        float *o = out + r * ldo;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = gate[i] * sigmoid(gate[i]) * up[i];
    }
}

/* out[:, i] = gelu(x[:, i]) * x[:, d + i]. tanh_approximation != 0: gelu(g) = g/2 (1 + tanh(u)) =
 * g sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3) (torch's approximate="tanh"); otherwise the exact
 * g/2 (1 + erf(g / sqrt 2)) with libm's erff (a call per element, not vectorised; Gemma's models use tanh). */
void kl_gelu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t d,
                         int tanh_approximation) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * ldx, *up = gate + d;
        float *o = out + r * ldo;
        if (tanh_approximation) {
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) {
                const float g = gate[i];
                o[i] = g * sigmoid(1.5957691216057308f * (g + 0.044715f * g * g * g)) * up[i];
            }
        } else {
            for (int64_t i = 0; i < d; ++i)
                o[i] = 0.5f * gate[i] * (1.0f + erff(gate[i] * 0.70710678118654752f)) * up[i];
        }
    }
}
