/* exp(x) for x <= 0: included by paged_decode_attention.c (softmax weights) and norm_activation.c (silu). */
#ifndef KL_EXP_NONPOSITIVE_H
#define KL_EXP_NONPOSITIVE_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0, within about 2 ulp, in a form the compiler vectorises: the softmax takes one exp per
 * (query head, token), and libm's expf is a call no loop can vectorise (glibc's vector expf needs
 * -ffast-math). Cody-Waite reduction x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-6 polynomial for
 * exp(r), 2^n built in the exponent bits. Below -87 the result is 0: 2^n would leave the normal range, and
 * such a weight is under float32 resolution next to the running maximum's weight of 1 anyway (flushing it,
 * rather than returning a denormal, also keeps denormals out of the V accumulation). */
#pragma omp declare simd notinbranch
static inline float exp_nonpositive(float x) {
    const int underflow = x < -87.0f;
    x = underflow ? -87.0f : x;
    /* Adding and removing 1.5 * 2^23 rounds to the nearest integer (kept as written without -ffast-math). */
    const float shifter = 12582912.0f;
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f; /* ln2 in two parts: n times the first is exact */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0f : p * two_n;
}

#endif
