// write_kv for paged caches (projects 04/05). Torch-free; bindings.cpp calls launch_write_kv.
//
// Same-dtype caches: one CTA per token copies its K and V rows in 16-byte pieces.
// FP8 caches follow the page-scale policy of kernel_lab/ops/kv_cache.py in four launches, which is what
// makes the result independent of the order tokens of one call are processed in:
//   1. stage:     for every (page, head) a token writes, copy the current scale into a workspace and reset
//                 the page's leader (every writer stores the same values, so the race is benign);
//   2. candidates: each (token, head) row raises the workspace scale to its power-of-two scale (atomicMax
//                 on the bits: non-negative floats order like integers) and bids for leader (atomicMin);
//   3. requantise: the leader of each (page, head) whose scale grew rescales the page's existing bytes
//                 once (or zero-fills a page whose old scale was 0) and publishes the new scale;
//   4. quantise:  every row is quantised with its page's new scale and stored.
// Every (token, head) row is handled by a lane group of head_dim / 8 lanes rounded up to a power of two
// (16 for head_dim 96: the 4 spare lanes load and store nothing), 8 elements each.

#include <climits>

#include "kernel_common.cuh"
#include "paged_kernels.h"

namespace kernel_lab {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float pow2_scale(float amax) {
  // The smallest power of two >= amax / 448, at least 2^-126; bit-identical to kv_cache.pow2_scale.
  if (!(amax > 0.0f)) return 0.0f;
  const uint32_t bits = __float_as_uint(amax / kFp8Max);
  const uint32_t exponent = bits >> 23;
  if (exponent == 0) return __uint_as_float(1u << 23);  // below the normal range: 2^-126
  const uint32_t rounded = (bits & 0x7fffffu) ? exponent + 1 : exponent;
  return __uint_as_float(rounded << 23);
}

// |x| where x is finite, else 0: NaN and inf never set a page scale (kv_cache.finite_amax).
__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

// Clamp to the E4M3 range keeping NaN (fminf/fmaxf would turn a NaN into a bound), as torch.clamp does.
__device__ __forceinline__ float clamp_fp8_range(float x) { return isnan(x) ? x : fminf(fmaxf(x, -kFp8Max), kFp8Max); }

__global__ void __launch_bounds__(kThreads) copy_rows_kernel(const WriteKVParams p, int elem_bytes) {
  const int token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const int64_t page = slot / p.block_size;
  const int offset = static_cast<int>(slot % p.block_size);
  const int pieces_per_head = p.head_dim * elem_bytes / 16;
  const int pieces = pieces_per_head * p.num_kv_heads;
  const int64_t row_elems = static_cast<int64_t>(offset) * p.num_kv_heads * p.head_dim;
  for (int i = threadIdx.x; i < pieces; i += kThreads) {
    const int head = i / pieces_per_head;
    const int piece = i % pieces_per_head;
    const int64_t dst = ((page * p.k_block_stride + row_elems + head * p.head_dim) * elem_bytes) / 16 + piece;
    const int64_t dst_v = ((page * p.v_block_stride + row_elems + head * p.head_dim) * elem_bytes) / 16 + piece;
    const int64_t src_k = ((token * p.key_token_stride + head * p.key_head_stride) * elem_bytes) / 16 + piece;
    const int64_t src_v = ((token * p.value_token_stride + head * p.value_head_stride) * elem_bytes) / 16 + piece;
    reinterpret_cast<uint4*>(p.k_cache)[dst] = __ldg(reinterpret_cast<const uint4*>(p.key) + src_k);
    reinterpret_cast<uint4*>(p.v_cache)[dst_v] = __ldg(reinterpret_cast<const uint4*>(p.value) + src_v);
  }
}

// The (token, head) row this thread works on, and its lane within the row's lane group.
struct RowCoord {
  int token, head, lane;
  int64_t slot, page;
  int offset;
  bool active;  // the row exists and its slot is not -1
  bool holds_data;  // the lane's 8 elements lie inside head_dim (false on a padded group's spare lanes)
};

template <int kLanes>
__device__ __forceinline__ RowCoord row_coord(const WriteKVParams& p) {
  RowCoord r;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / kLanes) + threadIdx.x / kLanes;
  r.lane = threadIdx.x % kLanes;
  r.holds_data = r.lane * 8 < p.head_dim;
  const bool exists = row < static_cast<int64_t>(p.num_tokens) * p.num_kv_heads;
  r.token = exists ? static_cast<int>(row / p.num_kv_heads) : 0;
  r.head = exists ? static_cast<int>(row % p.num_kv_heads) : 0;
  r.slot = exists ? p.slot_mapping[r.token] : -1;
  r.active = r.slot >= 0;
  r.page = r.active ? r.slot / p.block_size : 0;
  r.offset = r.active ? static_cast<int>(r.slot % p.block_size) : 0;
  return r;
}

template <ElemKind kInput>
__device__ __forceinline__ void load_row(const void* base, int64_t element, float (&f)[8]) {
  if constexpr (kInput == ElemKind::kF32) {
    load8_as_float<kInput>(reinterpret_cast<const float*>(base) + element, f);
  } else {
    load8_as_float<kInput>(reinterpret_cast<const uint16_t*>(base) + element, f);
  }
}

__global__ void __launch_bounds__(kThreads) stage_scales_kernel(const WriteKVParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= static_cast<int64_t>(p.num_tokens) * p.num_kv_heads) return;
  const int64_t slot = p.slot_mapping[row / p.num_kv_heads];
  if (slot < 0) return;
  const int64_t index = (slot / p.block_size) * p.num_kv_heads + row % p.num_kv_heads;
  p.k_scale_next[index] = p.k_scale[index];
  p.v_scale_next[index] = p.v_scale[index];
  p.page_leader[index] = INT_MAX;
}

template <ElemKind kInput, int kLanes>
__global__ void __launch_bounds__(kThreads) propose_scales_kernel(const WriteKVParams p) {
  const RowCoord r = row_coord<kLanes>(p);
  float k[8], v[8];
  float k_max = 0.0f, v_max = 0.0f;
  if (r.active && r.holds_data) {
    load_row<kInput>(p.key, r.token * p.key_token_stride + r.head * p.key_head_stride + r.lane * 8, k);
    load_row<kInput>(p.value, r.token * p.value_token_stride + r.head * p.value_head_stride + r.lane * 8, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      k_max = fmaxf(k_max, finite_abs(k[e]));
      v_max = fmaxf(v_max, finite_abs(v[e]));
    }
  }
  k_max = group_max<kLanes>(k_max);
  v_max = group_max<kLanes>(v_max);
  if (r.active && r.lane == 0) {
    const int64_t index = r.page * p.num_kv_heads + r.head;
    atomicMax(reinterpret_cast<int*>(p.k_scale_next) + index, __float_as_int(pow2_scale(k_max)));
    atomicMax(reinterpret_cast<int*>(p.v_scale_next) + index, __float_as_int(pow2_scale(v_max)));
    atomicMin(p.page_leader + index, r.token);
  }
}

template <int kLanes>
__device__ __forceinline__ void requantise_page(uint8_t* cache, int64_t block_stride, float* scale,
                                                const float* next_scale, const WriteKVParams& p, const RowCoord& r) {
  const int64_t index = r.page * p.num_kv_heads + r.head;
  const float old_scale = scale[index];
  const float new_scale = next_scale[index];
  if (!(new_scale > old_scale)) return;
  // An old scale of 0 marks an empty page: its bytes are meaningless (maybe NaN patterns), so clear them.
  const float ratio = old_scale > 0.0f ? old_scale / new_scale : 0.0f;
  for (int offset = 0; offset < (r.holds_data ? p.block_size : 0); ++offset) {
    uint2* ptr = reinterpret_cast<uint2*>(
        cache + r.page * block_stride + (static_cast<int64_t>(offset) * p.num_kv_heads + r.head) * p.head_dim) +
        r.lane;
    float f[8];
    if (old_scale > 0.0f) {
      fp8x8_to_float_exact(*ptr, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = clamp_fp8_range(f[e] * ratio);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = 0.0f;
    }
    *ptr = float8_to_fp8x8(f);
  }
  // Every lane of the row has read the old scale before lane 0 replaces it. Only this row's lanes sync:
  // other rows of the warp may have returned (the leader test is uniform per row, not per warp).
  const unsigned row_lanes = kLanes == kWarpSize ? 0xffffffffu
                                                 : ((1u << kLanes) - 1u) << (threadIdx.x % kWarpSize / kLanes * kLanes);
  __syncwarp(row_lanes);
  if (r.lane == 0) scale[index] = new_scale;
}

template <int kLanes>
__global__ void __launch_bounds__(kThreads) requantise_kernel(const WriteKVParams p) {
  const RowCoord r = row_coord<kLanes>(p);
  if (!r.active || p.page_leader[r.page * p.num_kv_heads + r.head] != r.token) return;
  requantise_page<kLanes>(reinterpret_cast<uint8_t*>(p.k_cache), p.k_block_stride, p.k_scale, p.k_scale_next, p, r);
  requantise_page<kLanes>(reinterpret_cast<uint8_t*>(p.v_cache), p.v_block_stride, p.v_scale, p.v_scale_next, p, r);
}

__device__ __forceinline__ void quantise_store(uint8_t* cache, int64_t block_stride, float scale, float (&f)[8],
                                               const WriteKVParams& p, const RowCoord& r) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = scale > 0.0f ? clamp_fp8_range(f[e] / scale) : (isnan(f[e]) ? f[e] : 0.0f);
  uint2* ptr = reinterpret_cast<uint2*>(
      cache + r.page * block_stride + (static_cast<int64_t>(r.offset) * p.num_kv_heads + r.head) * p.head_dim) +
      r.lane;
  *ptr = float8_to_fp8x8(f);
}

template <ElemKind kInput, int kLanes>
__global__ void __launch_bounds__(kThreads) quantise_kernel(const WriteKVParams p) {
  const RowCoord r = row_coord<kLanes>(p);
  if (!r.active || !r.holds_data) return;
  const int64_t index = r.page * p.num_kv_heads + r.head;
  float k[8], v[8];
  load_row<kInput>(p.key, r.token * p.key_token_stride + r.head * p.key_head_stride + r.lane * 8, k);
  load_row<kInput>(p.value, r.token * p.value_token_stride + r.head * p.value_head_stride + r.lane * 8, v);
  quantise_store(reinterpret_cast<uint8_t*>(p.k_cache), p.k_block_stride, p.k_scale_next[index], k, p, r);
  quantise_store(reinterpret_cast<uint8_t*>(p.v_cache), p.v_block_stride, p.v_scale_next[index], v, p, r);
}

template <ElemKind kInput, int kLanes>
cudaError_t launch_fp8(const WriteKVParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads;
  const unsigned row_blocks = static_cast<unsigned>((rows + kThreads / kLanes - 1) / (kThreads / kLanes));
  stage_scales_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  propose_scales_kernel<kInput, kLanes><<<row_blocks, kThreads, 0, stream>>>(p);
  requantise_kernel<kLanes><<<row_blocks, kThreads, 0, stream>>>(p);
  quantise_kernel<kInput, kLanes><<<row_blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <ElemKind kInput>
cudaError_t launch_fp8_input(const WriteKVParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_fp8<kInput, 8>(p, stream);
    case 96: return launch_fp8<kInput, 16>(p, stream);  // 12 lanes of data in a group of 16
    case 128: return launch_fp8<kInput, 16>(p, stream);
    case 256: return launch_fp8<kInput, 32>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

int elem_bytes(ElemKind kind) { return kind == ElemKind::kF32 ? 4 : kind == ElemKind::kFP8 ? 1 : 2; }

}  // namespace

cudaError_t launch_write_kv(const WriteKVParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const auto cache = static_cast<ElemKind>(p.cache_kind);
  const auto input = static_cast<ElemKind>(p.input_kind);
  if (cache != ElemKind::kFP8) {
    if (input != cache) return cudaErrorInvalidValue;
    copy_rows_kernel<<<p.num_tokens, kThreads, 0, stream>>>(p, elem_bytes(cache));
    return cudaGetLastError();
  }
  switch (input) {
    case ElemKind::kF16: return launch_fp8_input<ElemKind::kF16>(p, stream);
    case ElemKind::kBF16: return launch_fp8_input<ElemKind::kBF16>(p, stream);
    case ElemKind::kF32: return launch_fp8_input<ElemKind::kF32>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kernel_lab
