// Kernels that pin down the SIMT runtime's own semantics (`harness selftest NAME DIR`, tested by
// projects/04_paged_decode/test_cuda_source.py): shuffles and votes against CUDA's documented results, and
// one kernel per defect the runtime must refuse (wrong masks, divergent barriers, shared-memory races,
// a cp.async read before its wait).
#include <cstring>

namespace selftest {

constexpr int kResults = 9;  // per thread

// Two warps of 32. Lane l of warp w holds v = 100 * w + l.
__global__ void shuffles(int* out) {
  const int lane = threadIdx.x % 32;
  const int v = 100 * (threadIdx.x / 32) + lane;
  int* r = out + threadIdx.x * kResults;
  r[0] = __shfl_xor_sync(0xffffffffu, v, 5);
  r[1] = __shfl_xor_sync(0xffffffffu, v, 8, 8);    // width 8: a later group -> own value, an earlier one: read
  r[2] = __shfl_down_sync(0xffffffffu, v, 3);      // lanes 29..31 keep their own
  r[3] = __shfl_up_sync(0xffffffffu, v, 2, 16);    // lanes 0, 1, 16, 17 keep their own
  r[4] = __shfl_sync(0xffffffffu, v, 7);
  r[5] = __shfl_sync(0xffffffffu, v, lane + 3, 8);  // source (lane + 3) % 8 of the lane's group of 8
  r[6] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  r[7] = __any_sync(0xffffffffu, v == 105) * 2 + __all_sync(0xffffffffu, lane < 31);
  // Half warps shuffle on their own masks at once (disjoint masks may be in flight together).
  const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  r[8] = __shfl_xor_sync(half, v, 1);
}

__global__ void mask_misses_a_lane(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);  // lanes 16..31 never call it
}

__global__ void reads_a_lane_outside_the_mask(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[lane] = __shfl_xor_sync(0x0000ffffu, lane, 16);  // source lane ^ 16 is not in the mask
}

__global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 32) __syncthreads();  // the second warp never arrives
  out[threadIdx.x] = 1;
}

__global__ void barrier_then_exit(int* out) {
  if (threadIdx.x == 40) return;  // one thread leaves; the rest wait at a barrier it never reaches
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void collective_against_barrier(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);  // waits for lanes 16..31 ...
  __syncthreads();                                                   // ... which wait here: a deadlock
}

__global__ void shared_race(int* out) {
  __shared__ int cell[64];
  cell[threadIdx.x] = static_cast<int>(threadIdx.x);
  // no __syncthreads(): thread t reads what thread t + 32 (another warp) wrote in the same interval
  out[threadIdx.x] = cell[(threadIdx.x + 32) % 64];
}

__global__ void shared_ordered_by_barrier_and_syncwarp(int* out) {
  __shared__ int cell[64];
  cell[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  int v = cell[63 - threadIdx.x];
  __syncthreads();
  cell[threadIdx.x] = v;  // rewritten after every read of the interval before
  __syncwarp();
  out[threadIdx.x] = cell[threadIdx.x ^ 1];  // a lane of the same warp, ordered by __syncwarp
}

__global__ void cp_async_copy(const int* in, int* out, int wait) {
  __shared__ __align__(16) int tile[64];
  __pipeline_memcpy_async(&tile[threadIdx.x], &in[threadIdx.x], sizeof(int));
  __pipeline_commit();
  if (wait) __pipeline_wait_prior(0);
  __syncthreads();
  out[threadIdx.x] = tile[63 - threadIdx.x];
  if (!wait) __pipeline_wait_prior(0);
}

__global__ void dynamic_shared_reverse(int* out) {
  extern __shared__ __align__(16) int buffer[];
  buffer[threadIdx.x] = 3 * static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = buffer[63 - threadIdx.x];
}

}  // namespace selftest

// Returns the launch's status; `out` holds 64 * kResults ints, `in` 64.
int run_selftest(const char* name, const int* in, int* out) {
  using namespace selftest;
  if (!std::strcmp(name, "shuffles")) shuffles<<<1, 64>>>(out);
  else if (!std::strcmp(name, "mask_misses_a_lane")) mask_misses_a_lane<<<1, 32>>>(out);
  else if (!std::strcmp(name, "reads_a_lane_outside_the_mask")) reads_a_lane_outside_the_mask<<<1, 32>>>(out);
  else if (!std::strcmp(name, "divergent_barrier")) divergent_barrier<<<1, 64>>>(out);
  else if (!std::strcmp(name, "barrier_then_exit")) barrier_then_exit<<<1, 64>>>(out);
  else if (!std::strcmp(name, "collective_against_barrier")) collective_against_barrier<<<1, 64>>>(out);
  else if (!std::strcmp(name, "shared_race")) shared_race<<<1, 64>>>(out);
  else if (!std::strcmp(name, "shared_ordered")) shared_ordered_by_barrier_and_syncwarp<<<1, 64>>>(out);
  else if (!std::strcmp(name, "cp_async")) cp_async_copy<<<1, 64>>>(in, out, 1);
  else if (!std::strcmp(name, "cp_async_without_wait")) cp_async_copy<<<1, 64>>>(in, out, 0);
  else if (!std::strcmp(name, "dynamic_shared")) dynamic_shared_reverse<<<1, 64, 64 * sizeof(int)>>>(out);
  else return 1;
  return cudaGetLastError();
}
