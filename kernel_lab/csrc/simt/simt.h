// SIMT host runtime: compiles the CUDA kernels of kernel_lab/csrc as host C++ and runs them on CPU, for tests.
// Force-included (`-include simt/simt.h`) ahead of a kernel source by kernel_lab/ops/cuda_host.py; what this
// runtime checks and what it cannot tell you: kernel_lab/csrc/simt/README.md.
//
// Model: a launch runs the blocks of its grid one after another (in a seeded random order); the threads of a
// block are fibers (ucontext, a 256 KiB stack each) switched only at synchronisation points, in a seeded
// random order. `__shared__` variables are thread-local (all of them: the executable's TLS block), reset to a
// NaN byte pattern before every block, so each is one array per block. Warp collectives rendezvous the lanes
// their mask names and fail on a wrong mask; `__syncthreads()` fails unless every thread of the block
// reaches the same one.
//
// Adding an intrinsic: write it below as a plain inline function with CUDA's signature and semantics
// (lane-level ones through simt::warp_collective, see __shfl_sync). If the kernel reaches it through inline
// PTX (`asm(...)`), which no host compiler accepts, wrap the asm in `#ifdef KERNEL_LAB_SIMT` in the kernel
// source and call the emulation from the other branch (kernel_common.cuh's fast_exp2 does this).
#pragma once

#define KERNEL_LAB_SIMT 1

// Before CUDA's headers, which keep an execution-space macro that is already defined.
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict

#include <cuda_runtime_api.h>  // cudaError_t, cudaStream_t, dim3 and the vector types (host definitions)
#include <vector_functions.h>
#include <cuda_fp16.h>         // __half, __nv_bfloat16, __nv_fp8_e4m3: NVIDIA's own host implementations
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// The architecture the kernel's `#if __CUDA_ARCH__` branches see (CUDA's headers above were compiled as host
// code, before this). KL_SIMT_ARCH is set per build: 800 takes the sm_80 code paths, 890 the sm_89 ones.
#ifndef KL_SIMT_ARCH
#define KL_SIMT_ARCH 890
#endif
#define __CUDA_ARCH__ KL_SIMT_ARCH

// Every __shared__ variable is thread-local, and nothing else in the program is: all of them make up the
// executable's TLS block, which the runtime finds (dl_iterate_phdr), poisons before every block and tracks.
// (A section attribute would do, but GCC 12 ignores it on statics of function templates.) The fibers of a
// block share one OS thread, so each variable is one array per block.
#undef __shared__
#undef __align__
#define __shared__ static thread_local __attribute__((aligned(16)))
#define __align__(n) __attribute__((aligned(n)))

namespace simt {

// ------------------------------------------------------------------------------------------ runtime (runtime.cpp)
struct Fiber;
extern Fiber* g_current;
extern uint3 g_block_idx, g_block_dim, g_grid_dim;

const uint3& thread_idx();
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void syncthreads(const char* file, int line);

enum class Collective : int { kSyncWarp, kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };
// One lane's part of a warp collective: returns that lane's result once every lane of `mask` has arrived.
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width);
unsigned active_mask();

// Dynamic shared memory (`extern __shared__ T name[];` becomes a pointer to this, see cuda_host.py).
extern thread_local unsigned char dynamic_shared[];
constexpr size_t kDynamicSharedBytes = 96 * 1024;

// Asynchronous copies (cp.async through the __pipeline primitives): queued per thread at issue, performed
// when __pipeline_wait_prior releases their group, so a read that skips the wait sees poison.
void pipeline_memcpy_async(void* dst, const void* src, size_t bytes);
void pipeline_commit();
void pipeline_wait_prior(size_t groups);

// Grid launch (what `kernel<<<grid, block, smem, stream>>>(args)` becomes).
using BlockBody = void (*)(void* closure);
cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_smem, BlockBody body, void* closure);

// ex2.approx.ftz.f32 on the host: libm's exp2f with the instruction's flush-to-zero of subnormal inputs and
// results. Not bit-exact: the PTX ISA documents ex2.approx.f32 to 2 ulp; exp2f is within 1 ulp.
float ex2_approx_ftz(float x);

template <class... Args>
struct PendingLaunch {
  dim3 grid, block;
  size_t smem;
  std::tuple<Args...> args;
};

struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  template <class... Args>
  PendingLaunch<std::decay_t<Args>...> operator()(Args&&... args) const {
    return {grid, block, smem, std::tuple<std::decay_t<Args>...>(std::forward<Args>(args)...)};
  }
};

inline LaunchConfig launch_config(dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return {grid, block, smem};
}

// `kernel * launch_config(...)(args)`: every thread calls the kernel with its own copy of the arguments, as
// kernel parameters are per-thread on the GPU.
template <class... Params, class... Args>
void operator*(void (*kernel)(Params...), PendingLaunch<Args...>&& pending) {
  struct Closure {
    void (*kernel)(Params...);
    std::tuple<Args...>* args;
  } closure{kernel, &pending.args};
  auto body = [](void* c) {
    auto* self = static_cast<Closure*>(c);
    std::tuple<Args...> mine = *self->args;
    std::apply([&](auto&... a) { self->kernel(a...); }, mine);
  };
  run_grid(pending.grid, pending.block, pending.smem, body, &closure);
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace simt

// ------------------------------------------------------------------------------------------ built-in variables
#define threadIdx (::simt::thread_idx())
#define blockIdx (static_cast<const uint3&>(::simt::g_block_idx))
#define blockDim (static_cast<const uint3&>(::simt::g_block_dim))
#define gridDim (static_cast<const uint3&>(::simt::g_grid_dim))
#define warpSize 32

// ------------------------------------------------------------------------------------------ synchronisation
#define __syncthreads() ::simt::syncthreads(__FILE__, __LINE__)

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::simt::warp_collective(::simt::Collective::kSyncWarp, mask, 0, 0, 32);
}

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::simt::from_bits<T>(
      ::simt::warp_collective(::simt::Collective::kShfl, mask, ::simt::to_bits(var), src_lane, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::Collective::kShflUp, mask, ::simt::to_bits(var),
                                                      static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::Collective::kShflDown, mask, ::simt::to_bits(var),
                                                      static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::simt::from_bits<T>(
      ::simt::warp_collective(::simt::Collective::kShflXor, mask, ::simt::to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(::simt::warp_collective(::simt::Collective::kBallot, mask, predicate != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(::simt::warp_collective(::simt::Collective::kAny, mask, predicate != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(::simt::warp_collective(::simt::Collective::kAll, mask, predicate != 0, 0, 32));
}
inline unsigned __activemask() { return ::simt::active_mask(); }

// ------------------------------------------------------------------------------------------ cp.async
#define _CUDA_PIPELINE_PRIMITIVES_H_  // CUDA's versions are inline PTX; these replace them
#define _CUDA_PIPELINE_H_
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes, size_t = 0) {
  ::simt::pipeline_memcpy_async(dst, src, bytes);
}
inline void __pipeline_commit() { ::simt::pipeline_commit(); }
inline void __pipeline_wait_prior(size_t prior) { ::simt::pipeline_wait_prior(prior); }

// ------------------------------------------------------------------------------------------ memory
template <class T>
inline T __ldg(const T* ptr) {
  return *ptr;
}

// Fibers switch only at synchronisation points, so a read-modify-write is atomic as written.
namespace simt {
template <class T, class Next>
inline T atomic_update(T* address, Next next) {
  const T old = *address;
  *address = next(old);
  return old;
}
}  // namespace simt
template <class T>
inline T atomicMax(T* address, T v) {
  return ::simt::atomic_update(address, [v](T old) { return old > v ? old : v; });
}
template <class T>
inline T atomicMin(T* address, T v) {
  return ::simt::atomic_update(address, [v](T old) { return old < v ? old : v; });
}
template <class T>
inline T atomicAdd(T* address, T v) {
  return ::simt::atomic_update(address, [v](T old) { return old + v; });
}
template <class T>
inline T atomicExch(T* address, T v) {
  return ::simt::atomic_update(address, [v](T) { return v; });
}
template <class T>
inline T atomicCAS(T* address, T compare, T v) {
  return ::simt::atomic_update(address, [=](T old) { return old == compare ? v : old; });
}

// ------------------------------------------------------------------------------------------ integer and bits
inline float __uint_as_float(unsigned x) { return ::simt::from_bits<float>(x); }
inline float __int_as_float(int x) { return ::simt::from_bits<float>(static_cast<uint32_t>(x)); }
inline unsigned __float_as_uint(float x) { return static_cast<unsigned>(::simt::to_bits(x)); }
inline int __float_as_int(float x) { return static_cast<int>(static_cast<uint32_t>(::simt::to_bits(x))); }

// prmt: byte n of the result is byte (s >> 4n) & 7 of the 8-byte value {y:x} (x is bytes 0-3).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned result = 0;
  for (int n = 0; n < 4; ++n) result |= static_cast<unsigned>((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return result;
}
// Per 16-bit half: 0xffff where a and b are equal, else 0.
inline unsigned __vcmpeq2(unsigned a, unsigned b) {
  unsigned result = 0;
  for (int h = 0; h < 2; ++h) {
    if (((a >> (16 * h)) & 0xffff) == ((b >> (16 * h)) & 0xffff)) result |= 0xffffu << (16 * h);
  }
  return result;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

// ------------------------------------------------------------------------------------------ float intrinsics
// fmaf/fmaxf/fminf/fabsf/exp2f/isfinite/isnan are libm's (IEEE, like the device's). The approximate ones:
inline float __expf(float x) { return ::simt::ex2_approx_ftz(x * 1.4426950408889634f); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
using std::isfinite;
using std::isnan;
