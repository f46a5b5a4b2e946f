// Paged decode attention (projects 04/05). Torch-free; bindings.cpp calls launch_paged_decode.
//
// One CTA per (KV head x head group, sequence, split). A head group is up to 8 query heads of one KV head,
// so each K/V element is loaded once for all of them. Inside the CTA, warp w takes the split's KV blocks
// w, w + kNumWarps, ...; a token row of head_dim elements is spread over kLanesPerToken lanes (8 elements,
// 16 bytes of fp16/bf16 or 8 bytes of fp8, per lane; head_dim 96 pads its 12 lanes to a group of 16), so a
// warp reads kTokensPerWarp rows at once. Each
// lane group keeps its own online-softmax state (max, sum, accumulator) over its tokens, updated once per
// chunk of kChunk tokens whose K and V loads are all issued before any math. Lane groups merge by shuffles,
// warps through shared memory. With one split the CTA writes the output; otherwise it writes its
// normalised partial output and (max, sum), and paged_decode_merge_kernel combines the splits.
// kernel_lab/ops/paged_attention.py:kernel_model is this algorithm in PyTorch.
//
// Scales: q is pre-multiplied by scale * log2(e) (softmax in base 2). For fp8 pages the per-page K scale
// multiplies the logit and the V scale multiplies the probability before it accumulates V, so the
// dequantisation of a row costs one conversion per element and nothing else.

#include <cfloat>
#ifndef KERNEL_LAB_SIMT  // the host runtime (csrc/simt) provides the __pipeline primitives itself
#include <cuda_pipeline.h>
#endif

#include "kernel_common.cuh"
#include "paged_kernels.h"

namespace kernel_lab {
namespace {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * kWarpSize;
constexpr int kElemsPerLane = 8;

constexpr int pow2_ceil(int n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

template <int kHeadDim, int kHeadTile>
struct DecodeShape {
  // Raws (8 elements) per K/V row; a lane group is that rounded up to a power of two, so head_dim 96 (12)
  // runs in groups of 16 whose 4 spare lanes hold zeros and load nothing.
  static constexpr int kRowRaws = kHeadDim / kElemsPerLane;             // 8, 12, 16, 32
  static constexpr int kLanesPerToken = pow2_ceil(kRowRaws);            // 8, 16, 16, 32
  static constexpr int kTokensPerWarp = kWarpSize / kLanesPerToken;    // 4, 2, 2, 1
  static constexpr int kChunk = kHeadTile <= 2 ? 4 : 2;                // tokens per lane group per step
  // Occupancy floor handed to ptxas: without one it may cap small tiles at 80 registers and spill.
  static constexpr int kMinBlocksPerSM = kHeadTile <= 2 ? 4 : kHeadTile == 4 ? 3 : 2;
  static constexpr int kStageTokens = kChunk * kTokensPerWarp;         // tokens one loop step consumes
};

// Decode variants (PagedDecodeParams::variant). kDirect: each lane loads its K/V Raws straight from global
// memory into registers. kPipelined: each warp copies the K/V rows of its next step into shared memory
// with 16-byte cp.async (16 fp8 values per copy) while it computes the current step (two stages), and
// loads the page index of its next page one page ahead; the maths reads the same Raws from shared memory,
// so both variants compute the same bits.
enum class Variant : int { kDirect = 0, kPipelined = 1 };

template <ElemKind kCache>
struct CacheRow;

template <>
struct CacheRow<ElemKind::kF16> {
  using Raw = uint4;
  static __device__ __forceinline__ void decode(const Raw& r, float (&f)[8]) { half8_to_float(r, f); }
  static __device__ __forceinline__ float fold() { return 1.0f; }
};

template <>
struct CacheRow<ElemKind::kBF16> {
  using Raw = uint4;
  static __device__ __forceinline__ void decode(const Raw& r, float (&f)[8]) { bf16x8_to_float(r, f); }
  static __device__ __forceinline__ float fold() { return 1.0f; }
};

template <>
struct CacheRow<ElemKind::kFP8> {
  using Raw = uint2;
  static __device__ __forceinline__ void decode(const Raw& r, float (&f)[8]) { fp8x8_to_float(r, f); }
  static __device__ __forceinline__ float fold() { return kFp8DecodeFold; }
};

// The first position a sequence's query attends: it sees keys in (len - 1 - W, len - 1] under a window W.
__device__ __forceinline__ int window_start(const PagedDecodeParams& p, int seq_len) {
  return p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
}

__device__ __forceinline__ void store_out(void* base, int64_t index, float v, bool bf16) {
  if (bf16) {
    reinterpret_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(v);
  } else {
    reinterpret_cast<__half*>(base)[index] = __float2half_rn(v);
  }
}

template <ElemKind kCache, int kHeadDim, int kHeadTile, Variant kVariant>
__global__ void __launch_bounds__(kNumThreads, (DecodeShape<kHeadDim, kHeadTile>::kMinBlocksPerSM))
paged_decode_kernel(const PagedDecodeParams p) {
  using Shape = DecodeShape<kHeadDim, kHeadTile>;
  using Row = CacheRow<kCache>;
  using Raw = typename Row::Raw;
  constexpr int kLanes = Shape::kLanesPerToken;
  constexpr int kTPW = Shape::kTokensPerWarp;
  constexpr int kChunk = Shape::kChunk;
  constexpr bool kPipelined = kVariant == Variant::kPipelined;
  // Pipelined stages: [warp][stage][K, V][token of the step][Raw of the row]; the warps' final merge reuses
  // the space (after a barrier), so the variant adds no shared memory beyond its stages.
  constexpr int kStageRaws = kPipelined ? Shape::kStageTokens * Shape::kRowRaws : 1;
  union alignas(16) Shared {
    float acc[kNumWarps][kHeadTile][kHeadDim];
    Raw stage[kPipelined ? kNumWarps : 1][2][2][kStageRaws];
  };
  __shared__ Shared smem;
  auto& s_acc = smem.acc;
  __shared__ float s_max[kNumWarps][kHeadTile];
  __shared__ float s_sum[kNumWarps][kHeadTile];

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int lane_group = lane / kLanes;
  const int lane_in_group = lane % kLanes;
  const bool holds_data = lane_in_group < Shape::kRowRaws;
  const int kv_head = blockIdx.x / p.head_groups;
  const int head_group = blockIdx.x % p.head_groups;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int group_size = p.num_q_heads / p.num_kv_heads;
  const int first_head = kv_head * group_size + head_group * p.heads_per_group;
  const int num_heads = min(p.heads_per_group, group_size - head_group * p.heads_per_group);

  const int seq_len = p.seq_lens[seq];
  const int seq_blocks = (seq_len + p.block_size - 1) >> p.log2_block_size;
  const int window_first = window_start(p, seq_len);
  // Splits cover the window's blocks only (plan_splits counts those), so the work is bounded by the window.
  const int first_block = (window_first >> p.log2_block_size) + split * p.partition_blocks;
  const int end_block = min(first_block + p.partition_blocks, seq_blocks);
  if (first_block >= end_block) {
    // An empty split: the merge kernel counts splits from seq_len and never reads it. Without a split,
    // this CTA owns the output rows (seq_len 0): they are zero.
    if (p.num_splits == 1) {
      for (int i = threadIdx.x; i < num_heads * kHeadDim; i += kNumThreads) {
        const int h = first_head + i / kHeadDim;
        store_out(p.out, seq * p.out_batch_stride + h * p.out_head_stride + i % kHeadDim, 0.0f, p.q_is_bf16);
      }
    }
    return;
  }

  // q of every head in the tile, pre-scaled for a base-2 softmax; padding heads get zeros.
  float q[kHeadTile][kElemsPerLane];
  const float q_mult = p.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < kHeadTile; ++g) {
    if (g < num_heads && holds_data) {
      const int64_t offset = seq * p.q_batch_stride + (first_head + g) * p.q_head_stride + lane_in_group * 8;
      if (p.q_is_bf16) {
        load8_as_float<ElemKind::kBF16>(reinterpret_cast<const __nv_bfloat16*>(p.q) + offset, q[g]);
      } else {
        load8_as_float<ElemKind::kF16>(reinterpret_cast<const __half*>(p.q) + offset, q[g]);
      }
#pragma unroll
      for (int e = 0; e < kElemsPerLane; ++e) q[g][e] *= q_mult;
    } else {
#pragma unroll
      for (int e = 0; e < kElemsPerLane; ++e) q[g][e] = 0.0f;
    }
  }

  float run_max[kHeadTile], run_sum[kHeadTile], acc[kHeadTile][kElemsPerLane];
#pragma unroll
  for (int g = 0; g < kHeadTile; ++g) {
    run_max[g] = -INFINITY;
    run_sum[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kElemsPerLane; ++e) acc[g][e] = 0.0f;
  }

  // Raw is 8 cache elements, so a row of head_dim elements is kRowRaws Raws and one token is
  // num_kv_heads rows.
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * Shape::kRowRaws;
  const int64_t row_offset = static_cast<int64_t>(kv_head) * Shape::kRowRaws + lane_in_group;
  const int32_t* table = p.block_tables + seq * p.block_table_stride;
  const Raw* k_base = reinterpret_cast<const Raw*>(p.k_cache);
  const Raw* v_base = reinterpret_cast<const Raw*>(p.v_cache);
  const int64_t k_block_stride = p.k_block_stride / kElemsPerLane;
  const int64_t v_block_stride = p.v_block_stride / kElemsPerLane;

  // One loop step: kChunk tokens per lane group (offsets base + c * kTPW + lane_group of a page), loaded
  // into k_raw/v_raw by the variant, then one online-softmax update.
  const auto step = [&](const Raw (&k_raw)[kChunk], const Raw (&v_raw)[kChunk], const bool (&valid)[kChunk],
                        float k_mult, float v_mult) {
    float logit[kChunk][kHeadTile];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      float k[kElemsPerLane];
      Row::decode(k_raw[c], k);
#pragma unroll
      for (int g = 0; g < kHeadTile; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kElemsPerLane; ++e) dot = fmaf(q[g][e], k[e], dot);
        dot = group_sum<kLanes>(dot);
        logit[c][g] = valid[c] ? dot * k_mult : -INFINITY;
      }
    }

    float base_max[kHeadTile];
#pragma unroll
    for (int g = 0; g < kHeadTile; ++g) {
      float chunk_max = logit[0][g];
#pragma unroll
      for (int c = 1; c < kChunk; ++c) chunk_max = fmaxf(chunk_max, logit[c][g]);
      const float new_max = fmaxf(run_max[g], chunk_max);
      // All-masked so far: keep exponents finite (exp2(-inf - 0) = 0 leaves the state at zero).
      base_max[g] = new_max == -INFINITY ? 0.0f : new_max;
      const float correction = fast_exp2(run_max[g] - base_max[g]);
      run_max[g] = new_max;
      run_sum[g] *= correction;
#pragma unroll
      for (int e = 0; e < kElemsPerLane; ++e) acc[g][e] *= correction;
    }

#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      float v[kElemsPerLane];
      Row::decode(v_raw[c], v);
#pragma unroll
      for (int g = 0; g < kHeadTile; ++g) {
        const float prob = fast_exp2(logit[c][g] - base_max[g]);
        run_sum[g] += prob;
        const float weight = prob * v_mult;
#pragma unroll
        for (int e = 0; e < kElemsPerLane; ++e) acc[g][e] = fmaf(weight, v[e], acc[g][e]);
      }
    }
  };

  // A page's facts: its tokens, where the window starts in it, the multipliers of its fp8 scales.
  struct Page {
    int64_t id;
    int tokens, first_offset;
    float k_mult, v_mult;
  };
  const auto page_facts = [&](int block, int64_t id) {
    Page pg{id, 0, 0, 1.0f, 1.0f};
    const int block_start = block << p.log2_block_size;
    pg.tokens = min(p.block_size, seq_len - block_start);
    // The window's first block starts mid-page: its earlier offsets are neither loaded nor counted.
    pg.first_offset = max(0, window_first - block_start);
    if constexpr (kCache == ElemKind::kFP8) {
      pg.k_mult = p.k_scale[id * p.num_kv_heads + kv_head] * Row::fold();
      pg.v_mult = p.v_scale[id * p.num_kv_heads + kv_head] * Row::fold();
    }
    return pg;
  };

  if constexpr (!kPipelined) {
    for (int block = first_block + warp; block < end_block; block += kNumWarps) {
      const Page pg = page_facts(block, table[block]);
      const Raw* k_page = k_base + pg.id * k_block_stride + row_offset;
      const Raw* v_page = v_base + pg.id * v_block_stride + row_offset;
      for (int base = pg.first_offset; base < pg.tokens; base += kChunk * kTPW) {
        Raw k_raw[kChunk], v_raw[kChunk];
        bool valid[kChunk];
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          const int offset = base + c * kTPW + lane_group;
          valid[c] = offset < pg.tokens;
          if (valid[c] && holds_data) {
            k_raw[c] = __ldg(k_page + offset * token_stride);
            v_raw[c] = __ldg(v_page + offset * token_stride);
          } else {
            k_raw[c] = Raw{};
            v_raw[c] = Raw{};
          }
        }
        step(k_raw, v_raw, valid, pg.k_mult, pg.v_mult);
      }
    }
  } else {
    // The warp's steps in order: (page, base) advances by kStageTokens within a page, then to the warp's
    // next page, whose table entry was read one page earlier (page-index prefetch).
    constexpr int kRowPieces = Shape::kRowRaws * static_cast<int>(sizeof(Raw)) / 16;  // 16-byte copies per row
    const int64_t row_bytes = static_cast<int64_t>(kv_head) * kHeadDim * static_cast<int64_t>(sizeof(Raw)) /
                              kElemsPerLane;
    const int64_t token_bytes = token_stride * static_cast<int64_t>(sizeof(Raw));
    const char* k_bytes = reinterpret_cast<const char*>(p.k_cache);
    const char* v_bytes = reinterpret_cast<const char*>(p.v_cache);
    const int64_t k_page_bytes = k_block_stride * static_cast<int64_t>(sizeof(Raw));
    const int64_t v_page_bytes = v_block_stride * static_cast<int64_t>(sizeof(Raw));
    int block = first_block + warp;
    int64_t next_id = block + kNumWarps < end_block ? table[block + kNumWarps] : 0;
    Page cur{0, 0, 0, 1.0f, 1.0f};
    if (block < end_block) cur = page_facts(block, table[block]);
    int base = cur.first_offset;
    Page stage_page[2];
    int stage_base[2];
    bool stage_live[2];
    // Issue the copies of the current cursor into stage s and advance the cursor (an empty group past the
    // warp's last step keeps the wait counts uniform).
    const auto issue = [&](int s) {
      stage_live[s] = block < end_block;
      if (stage_live[s]) {
        stage_page[s] = cur;
        stage_base[s] = base;
        for (int i = lane; i < Shape::kStageTokens * kRowPieces; i += kWarpSize) {
          const int t = i / kRowPieces;
          const int piece = i % kRowPieces;
          if (base + t < cur.tokens) {
            const int64_t src = row_bytes + (base + t) * token_bytes + piece * 16;
            const int dst = t * Shape::kRowRaws * static_cast<int>(sizeof(Raw)) + piece * 16;
            __pipeline_memcpy_async(reinterpret_cast<char*>(&smem.stage[warp][s][0][0]) + dst,
                                    k_bytes + cur.id * k_page_bytes + src, 16);
            __pipeline_memcpy_async(reinterpret_cast<char*>(&smem.stage[warp][s][1][0]) + dst,
                                    v_bytes + cur.id * v_page_bytes + src, 16);
          }
        }
        base += Shape::kStageTokens;
        if (base >= cur.tokens) {
          block += kNumWarps;
          if (block < end_block) {
            cur = page_facts(block, next_id);
            base = cur.first_offset;
            next_id = block + kNumWarps < end_block ? table[block + kNumWarps] : 0;
          }
        }
      }
      __pipeline_commit();
    };
    // Compute stage s (its copies awaited) while the next step's copies fly; s is a constant at each call
    // (the loop below is unrolled by hand), so the stage bookkeeping stays in registers.
    const auto consume = [&](int s) {
      __pipeline_wait_prior(1);
      __syncwarp();  // every lane's copies of stage s have landed
      Raw k_raw[kChunk], v_raw[kChunk];
      bool valid[kChunk];
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        const int t = c * kTPW + lane_group;
        valid[c] = stage_base[s] + t < stage_page[s].tokens;
        if (valid[c] && holds_data) {
          k_raw[c] = smem.stage[warp][s][0][t * Shape::kRowRaws + lane_in_group];
          v_raw[c] = smem.stage[warp][s][1][t * Shape::kRowRaws + lane_in_group];
        } else {
          k_raw[c] = Raw{};
          v_raw[c] = Raw{};
        }
      }
      step(k_raw, v_raw, valid, stage_page[s].k_mult, stage_page[s].v_mult);
      __syncwarp();  // stage s is read before the next issue overwrites it
    };
    issue(0);
    while (stage_live[0]) {
      issue(1);
      consume(0);
      if (!stage_live[1]) break;
      issue(0);
      consume(1);
    }
    __pipeline_wait_prior(0);
    __syncthreads();  // the stages are s_acc's space: every warp has finished reading its own
  }

  // Merge the lane groups of this warp (they hold the same heads and elements, different tokens).
#pragma unroll
  for (int offset = kLanes; offset < kWarpSize; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < kHeadTile; ++g) {
      const float other_max = __shfl_xor_sync(0xffffffffu, run_max[g], offset);
      const float other_sum = __shfl_xor_sync(0xffffffffu, run_sum[g], offset);
      const float new_max = fmaxf(run_max[g], other_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float mine = fast_exp2(run_max[g] - base);
      const float theirs = fast_exp2(other_max - base);
      run_max[g] = new_max;
      run_sum[g] = run_sum[g] * mine + other_sum * theirs;
#pragma unroll
      for (int e = 0; e < kElemsPerLane; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
        acc[g][e] = acc[g][e] * mine + other * theirs;
      }
    }
  }

  if (lane_group == 0 && holds_data) {
#pragma unroll
    for (int g = 0; g < kHeadTile; ++g) {
#pragma unroll
      for (int e = 0; e < kElemsPerLane; ++e) s_acc[warp][g][lane_in_group * kElemsPerLane + e] = acc[g][e];
      if (lane == 0) {
        s_max[warp][g] = run_max[g];
        s_sum[warp][g] = run_sum[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps; thread i finishes element i % head_dim of head i / head_dim.
  for (int i = threadIdx.x; i < num_heads * kHeadDim; i += kNumThreads) {
    const int g = i / kHeadDim;
    const int e = i % kHeadDim;
    float block_max = s_max[0][g];
#pragma unroll
    for (int w = 1; w < kNumWarps; ++w) block_max = fmaxf(block_max, s_max[w][g]);
    float total = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float weight = fast_exp2(s_max[w][g] - block_max);  // a warp without tokens has max -inf
      total += s_sum[w][g] * weight;
      value += s_acc[w][g][e] * weight;
    }
    const int head = first_head + g;
    const float result = value / total;  // total >= 1: the split holds at least one token
    if (p.num_splits == 1) {
      store_out(p.out, seq * p.out_batch_stride + head * p.out_head_stride + e, result, p.q_is_bf16);
    } else {
      const int64_t row = (static_cast<int64_t>(seq) * p.num_q_heads + head) * p.num_splits + split;
      p.partial_out[row * kHeadDim + e] = result;
      if (e == 0) {
        p.partial_stats[row * 2] = block_max;
        p.partial_stats[row * 2 + 1] = total;
      }
    }
  }
}

// Combines the splits of one (sequence, query head): out = sum_s w_s * o_s / sum_s w_s with
// w_s = sum_s * 2^(max_s - max). The number of splits that hold tokens follows from seq_len (and the window).
__global__ void __launch_bounds__(256) paged_decode_merge_kernel(const PagedDecodeParams p) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int window_blocks = ((seq_len + p.block_size - 1) >> p.log2_block_size) -
                            (window_start(p, seq_len) >> p.log2_block_size);
  const int splits = (window_blocks + p.partition_blocks - 1) / p.partition_blocks;
  const int64_t first_row = (static_cast<int64_t>(seq) * p.num_q_heads + head) * p.num_splits;
  const float* stats = p.partial_stats + first_row * 2;
  const float* partial = p.partial_out + first_row * p.head_dim;

  float global_max = -INFINITY;
  for (int s = 0; s < splits; ++s) global_max = fmaxf(global_max, stats[2 * s]);
  float total = 0.0f;
  for (int s = 0; s < splits; ++s) total += stats[2 * s + 1] * fast_exp2(stats[2 * s] - global_max);

  for (int e = threadIdx.x; e < p.head_dim; e += blockDim.x) {
    float value = 0.0f;
    for (int s = 0; s < splits; ++s) {
      value += partial[s * p.head_dim + e] * (stats[2 * s + 1] * fast_exp2(stats[2 * s] - global_max));
    }
    const float result = splits > 0 ? value / total : 0.0f;
    store_out(p.out, seq * p.out_batch_stride + head * p.out_head_stride + e, result, p.q_is_bf16);
  }
}

template <ElemKind kCache, int kHeadDim, int kHeadTile>
cudaError_t launch_tile(const PagedDecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads * p.head_groups, p.batch, p.num_splits);
  switch (static_cast<Variant>(p.variant)) {
    case Variant::kDirect:
      paged_decode_kernel<kCache, kHeadDim, kHeadTile, Variant::kDirect><<<grid, kNumThreads, 0, stream>>>(p);
      break;
    case Variant::kPipelined:
      paged_decode_kernel<kCache, kHeadDim, kHeadTile, Variant::kPipelined><<<grid, kNumThreads, 0, stream>>>(p);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <ElemKind kCache, int kHeadDim>
cudaError_t launch_head_dim(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.heads_per_group <= 1) return launch_tile<kCache, kHeadDim, 1>(p, stream);
  if (p.heads_per_group <= 2) return launch_tile<kCache, kHeadDim, 2>(p, stream);
  if (p.heads_per_group <= 4) return launch_tile<kCache, kHeadDim, 4>(p, stream);
  if (p.heads_per_group <= 8) return launch_tile<kCache, kHeadDim, 8>(p, stream);
  return cudaErrorInvalidValue;
}

template <ElemKind kCache>
cudaError_t launch_cache(const PagedDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_head_dim<kCache, 64>(p, stream);
    case 96: return launch_head_dim<kCache, 96>(p, stream);
    case 128: return launch_head_dim<kCache, 128>(p, stream);
    case 256: return launch_head_dim<kCache, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_paged_decode(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.block_size != (1 << p.log2_block_size) || p.num_splits < 1 || p.partition_blocks < 1 ||
      p.sliding_window < 0) {
    return cudaErrorInvalidValue;
  }
  cudaError_t status;
  switch (static_cast<ElemKind>(p.cache_kind)) {
    case ElemKind::kF16: status = launch_cache<ElemKind::kF16>(p, stream); break;
    case ElemKind::kBF16: status = launch_cache<ElemKind::kBF16>(p, stream); break;
    case ElemKind::kFP8: status = launch_cache<ElemKind::kFP8>(p, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (status != cudaSuccess || p.num_splits == 1) return status;
  paged_decode_merge_kernel<<<dim3(p.num_q_heads, p.batch), p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kernel_lab
