// Host-side interface of the paged KV kernels: plain structs and launchers, no torch and no device code,
// so bindings.cpp (torch) and the standalone nvcc builds of the .cu files share one definition.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

namespace kernel_lab {

struct PagedDecodeParams {
  const void* q;              // [batch, num_q_heads, head_dim], fp16 or bf16 (q_is_bf16)
  const void* k_cache;        // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;
  const int32_t* block_tables;  // [batch, block_table_stride]
  const int32_t* seq_lens;      // [batch]
  const float* k_scale;       // [num_blocks, num_kv_heads] (fp8 caches only)
  const float* v_scale;
  void* out;                  // [batch, num_q_heads, head_dim], q's dtype
  float* partial_out;         // [batch, num_q_heads, num_splits, head_dim] (num_splits > 1)
  float* partial_stats;       // [batch, num_q_heads, num_splits, 2]: running max (log2 domain), sum
  int64_t q_batch_stride, q_head_stride;      // elements
  int64_t out_batch_stride, out_head_stride;  // elements
  int64_t k_block_stride, v_block_stride;     // elements
  int64_t block_table_stride;
  int batch, num_q_heads, num_kv_heads, head_dim;
  int block_size, log2_block_size;
  int heads_per_group, head_groups, partition_blocks, num_splits;
  float scale;
  int q_is_bf16;
  int cache_kind;  // ElemKind of the cache: 0 fp16, 1 bf16, 3 fp8 e4m3
  int sliding_window;  // W > 0: the query at position len - 1 sees keys in (len - 1 - W, len - 1]; 0: all
  int variant;         // 0: direct loads (default); 1: cp.async-pipelined (16-byte copies; paged_attention.cu)
};

struct WriteKVParams {
  const void* key;            // [tokens, num_kv_heads, head_dim]
  const void* value;
  void* k_cache;
  void* v_cache;
  const int64_t* slot_mapping;  // [tokens], -1 = skip
  float* k_scale;             // fp8 only: [num_blocks, num_kv_heads]
  float* v_scale;
  float* k_scale_next;        // fp8 only, workspaces of k_scale's shape (contents need no initialisation)
  float* v_scale_next;
  int32_t* page_leader;
  int64_t key_token_stride, key_head_stride;      // elements
  int64_t value_token_stride, value_head_stride;  // elements
  int64_t k_block_stride, v_block_stride;         // elements
  int num_tokens, num_kv_heads, head_dim, block_size;
  int input_kind;  // ElemKind of key/value
  int cache_kind;  // ElemKind of the cache
};

// Both return cudaSuccess, cudaErrorInvalidValue for an unsupported configuration, or a launch error.
// Neither synchronises nor allocates: they are safe to capture in a CUDA graph.
cudaError_t launch_paged_decode(const PagedDecodeParams& params, cudaStream_t stream);
cudaError_t launch_write_kv(const WriteKVParams& params, cudaStream_t stream);

}  // namespace kernel_lab
