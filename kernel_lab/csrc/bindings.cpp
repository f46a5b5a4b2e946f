// Torch binding of the paged KV kernels (built only on a CUDA machine by kernel_lab/ops/cuda_extension.py).
// Python has already validated shapes and dtypes (kernel_lab/ops/paged_attention.py, kv_cache.py); the
// checks here guard the assumptions the kernels make about alignment and layout, without reading device
// memory, so both ops stay capturable in CUDA graphs.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "paged_kernels.h"

namespace {

using kernel_lab::PagedDecodeParams;
using kernel_lab::WriteKVParams;

int elem_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return 0;
    case at::kBFloat16: return 1;
    case at::kFloat: return 2;
    case at::kFloat8_e4m3fn: return 3;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
  return -1;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_cuda(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& k_scale,
                  const c10::optional<at::Tensor>& v_scale, const at::Tensor& out, const c10::optional<at::Tensor>& partial_out,
                  const c10::optional<at::Tensor>& partial_stats, double scale, int64_t heads_per_group,
                  int64_t partition_blocks, int64_t num_splits, int64_t sliding_window, int64_t variant) {
  check_cuda("q", q);
  check_cuda("k_cache", k_cache);
  check_cuda("v_cache", v_cache);
  check_cuda("block_tables", block_tables);
  check_cuda("seq_lens", seq_lens);
  check_cuda("out", out);
  const c10::cuda::CUDAGuard guard(q.device());
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t head_dim = q.size(2);
  // The kernel reads 8 cache elements (16 or 8 bytes) and 8 q elements per lane.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && aligned16(q),
              "q must be 16-byte aligned with strides that are multiples of 8 elements");
  TORCH_CHECK(out.stride(2) == 1, "out must be contiguous in its last dimension");
  TORCH_CHECK(k_cache.stride(0) % 8 == 0 && v_cache.stride(0) % 8 == 0 && aligned16(k_cache) && aligned16(v_cache),
              "k_cache/v_cache must be 16-byte aligned with a block stride that is a multiple of 8 elements");
  TORCH_CHECK(block_tables.stride(1) == 1 || block_tables.size(1) <= 1, "block_tables must have unit column stride");
  const int64_t bs = k_cache.size(1);
  int log2_bs = 0;
  while ((int64_t{1} << log2_bs) < bs) ++log2_bs;
  TORCH_CHECK((int64_t{1} << log2_bs) == bs, "block_size must be a power of two");

  PagedDecodeParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  if (fp8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "fp8 caches need k_scale and v_scale");
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
  }
  p.out = out.data_ptr();
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.has_value() && partial_stats.has_value(), "split decode needs its workspaces");
    p.partial_out = partial_out->data_ptr<float>();
    p.partial_stats = partial_stats->data_ptr<float>();
  }
  p.q_batch_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.out_batch_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.k_block_stride = k_cache.stride(0);
  p.v_block_stride = v_cache.stride(0);
  p.block_table_stride = block_tables.size(1) > 0 ? block_tables.stride(0) : 0;
  p.batch = static_cast<int>(q.size(0));
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(bs);
  p.log2_block_size = log2_bs;
  p.heads_per_group = static_cast<int>(heads_per_group);
  p.head_groups = static_cast<int>((q.size(1) / k_cache.size(2) + heads_per_group - 1) / heads_per_group);
  p.partition_blocks = static_cast<int>(partition_blocks);
  p.num_splits = static_cast<int>(num_splits);
  p.scale = static_cast<float>(scale);
  p.q_is_bf16 = q.scalar_type() == at::kBFloat16;
  p.cache_kind = elem_kind(k_cache);
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX, "sliding_window must be in [0, 2^31), got ",
              sliding_window);
  p.sliding_window = static_cast<int>(sliding_window);
  TORCH_CHECK(variant == 0 || variant == 1, "variant must be 0 (direct) or 1 (pipelined), got ", variant);
  // The pipelined variant copies 16-byte pieces of rows: fp8 pages need 16-byte block strides too.
  TORCH_CHECK(variant == 0 || ((k_cache.stride(0) * k_cache.element_size()) % 16 == 0 &&
                               (v_cache.stride(0) * v_cache.element_size()) % 16 == 0),
              "the pipelined variant needs k_cache/v_cache block strides that are multiples of 16 bytes");
  p.variant = static_cast<int>(variant);
  const cudaError_t status = kernel_lab::launch_paged_decode(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "paged_decode launch failed: ", cudaGetErrorString(status));
}

// A 16-byte aligned view of a [tokens, heads, head_dim] input whose strides are whole 16-byte pieces.
at::Tensor aligned_rows(const at::Tensor& t) {
  const int64_t e = t.element_size();
  const bool ok = aligned16(t) && t.stride(2) == 1 && (t.stride(0) * e) % 16 == 0 && (t.stride(1) * e) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void write_kv(const at::Tensor& key_in, const at::Tensor& value_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
              const c10::optional<at::Tensor>& v_scale) {
  check_cuda("key", key_in);
  check_cuda("value", value_in);
  check_cuda("k_cache", k_cache);
  check_cuda("v_cache", v_cache);
  check_cuda("slot_mapping", slot_mapping);
  const c10::cuda::CUDAGuard guard(key_in.device());
  const at::Tensor key = aligned_rows(key_in);
  const at::Tensor value = aligned_rows(value_in);
  const at::Tensor slots = slot_mapping.contiguous();
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t cache_bytes = k_cache.element_size();
  TORCH_CHECK(aligned16(k_cache) && aligned16(v_cache) && (k_cache.stride(0) * cache_bytes) % 16 == 0 &&
                  (v_cache.stride(0) * cache_bytes) % 16 == 0,
              "k_cache/v_cache must be 16-byte aligned with 16-byte multiple block strides");

  WriteKVParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slots.data_ptr<int64_t>();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.k_block_stride = k_cache.stride(0);
  p.v_block_stride = v_cache.stride(0);
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_dim = static_cast<int>(key.size(2));
  p.block_size = static_cast<int>(k_cache.size(1));
  p.input_kind = elem_kind(key);
  p.cache_kind = elem_kind(k_cache);
  at::Tensor k_next, v_next, leader;
  if (fp8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "fp8 caches need k_scale and v_scale");
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
    // Workspaces the size of the scale tables; only entries of pages this call touches are used, and the
    // kernels initialise those themselves, so no memset is needed.
    k_next = at::empty_like(*k_scale);
    v_next = at::empty_like(*v_scale);
    leader = at::empty(k_scale->sizes(), k_scale->options().dtype(at::kInt));
    p.k_scale_next = k_next.data_ptr<float>();
    p.v_scale_next = v_next.data_ptr<float>();
    p.page_leader = leader.data_ptr<int32_t>();
  }
  const cudaError_t status = kernel_lab::launch_write_kv(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "write_kv launch failed: ", cudaGetErrorString(status));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernel_lab paged KV kernels: paged decode attention and write_kv (fp16/bf16/fp32, fp8 e4m3)";
  m.def("paged_decode", &paged_decode, "paged decode attention (see kernel_lab.ops.paged_attention)");
  m.def("write_kv", &write_kv, "store K/V rows into a paged cache (see kernel_lab.ops.kv_cache)");
}
