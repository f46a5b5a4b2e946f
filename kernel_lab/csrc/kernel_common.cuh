// Shared device helpers for the paged KV kernels. Torch-free: compiled standalone by the compile tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace kernel_lab {

// Element types of a paged cache (and of key/value inputs to write_kv).
enum class ElemKind : int { kF16 = 0, kBF16 = 1, kF32 = 2, kFP8 = 3 };

constexpr int kWarpSize = 32;
constexpr float kFp8Max = 448.0f;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float fast_exp2(float x) {
  // ex2.approx: 2 ulp, maps -inf to +0, which the masked softmax relies on.
#ifdef KERNEL_LAB_SIMT  // the host build of csrc/simt, where inline PTX cannot compile
  return simt::ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Sum across the `kLanes` lanes of an aligned lane group (all 32 lanes of the warp must call it).
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// ----------------------------------------------------------------------------------- 8 elements <-> floats
__device__ __forceinline__ void half8_to_float(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&f)[8]) {
  // bf16 is the top half of an fp32: the widening is a shift, exact and cheaper than a conversion.
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// FP8 E4M3 -> float. sm_89+ has a native e4m3x2 -> f16x2 conversion. Older GPUs use a bit trick: placing
// the 7 magnitude bits of an E4M3 value at bit 7 of an fp16 gives that value times 2**-8 exactly (normals
// and subnormals alike, since fp16 has a wider exponent range), so callers fold 2**8 into their scale.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr float kFp8DecodeFold = 1.0f;
#else
constexpr float kFp8DecodeFold = 256.0f;
#endif

__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
#else
  // byte i -> bits [8i+8, 8i+16) of a 32-bit word: each 16-bit lane holds its byte in its high half.
  const uint32_t spread = __byte_perm(two_bytes, 0u, 0x1404);
  uint32_t bits = ((spread >> 1) & 0x3f803f80u) | (spread & 0x80008000u);
  // E4M3's only NaN (magnitude 0x7f) would land on a finite fp16: raise its exponent to all ones instead.
  bits |= __vcmpeq2(bits & 0x7f807f80u, 0x3f803f80u) & 0x7c007c00u;
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
#endif
}

// 8 e4m3 bytes -> 8 floats (times kFp8DecodeFold^-1, see above).
__device__ __forceinline__ void fp8x8_to_float(const uint2& raw, float (&f)[8]) {
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 lo = fp8x2_to_float2(w[i] & 0xffffu);
    const float2 hi = fp8x2_to_float2(w[i] >> 16);
    f[4 * i] = lo.x;
    f[4 * i + 1] = lo.y;
    f[4 * i + 2] = hi.x;
    f[4 * i + 3] = hi.y;
  }
}

// Exact E4M3 decode (no fold), for requantisation where the value itself is needed.
__device__ __forceinline__ void fp8x8_to_float_exact(const uint2& raw, float (&f)[8]) {
  fp8x8_to_float(raw, f);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] *= kFp8DecodeFold;
}

// 8 floats -> 8 e4m3 bytes, round to nearest even, saturating to +-448 (native cvt on sm_89+).
__device__ __forceinline__ uint2 float8_to_fp8x8(const float (&f)[8]) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * i], f[4 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * i + 2], f[4 * i + 3]), __NV_SATFINITE, __NV_E4M3);
    w[i] = (lo & 0xffffu) | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

// 8 consecutive input elements (16-byte aligned for fp16/bf16, 32-byte for fp32) -> floats.
template <ElemKind kKind>
__device__ __forceinline__ void load8_as_float(const void* ptr, float (&f)[8]) {
  if constexpr (kKind == ElemKind::kF32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(ptr));
    const float4 b = __ldg(reinterpret_cast<const float4*>(ptr) + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(ptr));
    if constexpr (kKind == ElemKind::kF16) {
      half8_to_float(raw, f);
    } else {
      bf16x8_to_float(raw, f);
    }
  }
}

}  // namespace kernel_lab
