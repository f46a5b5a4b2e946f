// Test driver for the host build of the paged KV kernels: `harness decode|write_kv|convert|selftest DIR`.
//
// DIR holds params.txt (`name value` lines: the launch parameters, named as in paged_kernels.h) and one
// NAME.bin per buffer. Every buffer is copied into a guarded allocation (poisoned margins on both sides, as
// large as the buffer itself up to 16 MiB: AddressSanitizer reports any touch of them; without it they read
// as NaN), the real launcher of paged_kernels.h runs, and every buffer is written back to NAME.out.
// kernel_lab/ops/cuda_host.py writes the inputs and reads the results.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_common.cuh"
#include "paged_kernels.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

int run_selftest(const char* name, const int* in, int* out);  // selftest.cu

namespace {

struct Guarded {
  unsigned char* base = nullptr;
  size_t guard = 0, bytes = 0;
  unsigned char* data() const { return base + guard; }
};

Guarded guarded_alloc(size_t bytes) {
  Guarded g;
  g.bytes = bytes;
  g.guard = std::min<size_t>(std::max<size_t>(bytes, 64 * 1024), 16u << 20);
  g.guard = (g.guard + 255) / 256 * 256;  // the buffer starts 256-byte aligned, as cudaMalloc's do
  g.base = static_cast<unsigned char*>(std::aligned_alloc(256, (bytes + 2 * g.guard + 255) / 256 * 256));
  std::memset(g.base, 0xff, g.guard);
  std::memset(g.data() + bytes, 0xff, g.guard);
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(g.base, g.guard);
  ASAN_POISON_MEMORY_REGION(g.data() + bytes, g.guard);
#endif
  return g;
}

std::string g_dir;
std::map<std::string, std::string> g_params;
std::map<std::string, Guarded> g_buffers;

void load(const std::string& dir) {
  std::ifstream params(dir + "/params.txt");
  if (!params) simt::fail("no %s/params.txt", dir.c_str());
  std::string name, value;
  while (params >> name >> value) {
    if (name == "buffer") {
      std::ifstream in(dir + "/" + value + ".bin", std::ios::binary | std::ios::ate);
      const size_t bytes = static_cast<size_t>(in.tellg());
      in.seekg(0);
      Guarded g = guarded_alloc(bytes);
      in.read(reinterpret_cast<char*>(g.data()), static_cast<std::streamsize>(bytes));
      g_buffers[value] = g;
    } else {
      g_params[name] = value;
    }
  }
}

void save() {
  for (const auto& [name, g] : g_buffers) {
    std::ofstream out(g_dir + "/" + name + ".out", std::ios::binary);
    out.write(reinterpret_cast<const char*>(g.data()), static_cast<std::streamsize>(g.bytes));
  }
}

template <class T>
T* buffer(const std::string& name) {
  auto it = g_buffers.find(name);
  return it == g_buffers.end() ? nullptr : reinterpret_cast<T*>(it->second.data());
}

int64_t param(const std::string& name) {
  auto it = g_params.find(name);
  if (it == g_params.end()) simt::fail("params.txt lacks %s", name.c_str());
  return std::stoll(it->second);
}

// Launch parameters and buffers by field name (params.txt and NAME.bin use paged_kernels.h's names).
#define KL_BUFFER(field) p.field = buffer<std::remove_pointer_t<decltype(p.field)>>(#field)
#define KL_PARAM(field) p.field = static_cast<decltype(p.field)>(param(#field))

int run_decode() {
  kernel_lab::PagedDecodeParams p{};
  KL_BUFFER(q), KL_BUFFER(k_cache), KL_BUFFER(v_cache), KL_BUFFER(block_tables), KL_BUFFER(seq_lens);
  KL_BUFFER(k_scale), KL_BUFFER(v_scale), KL_BUFFER(out), KL_BUFFER(partial_out), KL_BUFFER(partial_stats);
  KL_PARAM(q_batch_stride), KL_PARAM(q_head_stride), KL_PARAM(out_batch_stride), KL_PARAM(out_head_stride);
  KL_PARAM(k_block_stride), KL_PARAM(v_block_stride), KL_PARAM(block_table_stride);
  KL_PARAM(batch), KL_PARAM(num_q_heads), KL_PARAM(num_kv_heads), KL_PARAM(head_dim);
  KL_PARAM(block_size), KL_PARAM(log2_block_size), KL_PARAM(heads_per_group), KL_PARAM(head_groups);
  KL_PARAM(partition_blocks), KL_PARAM(num_splits), KL_PARAM(q_is_bf16), KL_PARAM(cache_kind);
  KL_PARAM(sliding_window), KL_PARAM(variant);
  p.scale = std::stof(g_params.at("scale"));
  return kernel_lab::launch_paged_decode(p, nullptr);
}

int run_write_kv() {
  kernel_lab::WriteKVParams p{};
  KL_BUFFER(key), KL_BUFFER(value), KL_BUFFER(k_cache), KL_BUFFER(v_cache), KL_BUFFER(slot_mapping);
  KL_BUFFER(k_scale), KL_BUFFER(v_scale), KL_BUFFER(k_scale_next), KL_BUFFER(v_scale_next), KL_BUFFER(page_leader);
  KL_PARAM(key_token_stride), KL_PARAM(key_head_stride), KL_PARAM(value_token_stride), KL_PARAM(value_head_stride);
  KL_PARAM(k_block_stride), KL_PARAM(v_block_stride), KL_PARAM(num_tokens), KL_PARAM(num_kv_heads);
  KL_PARAM(head_dim), KL_PARAM(block_size), KL_PARAM(input_kind), KL_PARAM(cache_kind);
  return kernel_lab::launch_write_kv(p, nullptr);
}

// Every bit pattern of a format (Bits wide), 8 at a time as the kernels load them (Raw), through each decoder.
template <class Raw, class Bits>
void decode_every(std::initializer_list<std::pair<void (*)(const Raw&, float (&)[8]), std::vector<float>*>> decoders) {
  for (size_t i = 0; i < (size_t{1} << (8 * sizeof(Bits))); i += 8) {
    Bits bits[8];
    for (size_t e = 0; e < 8; ++e) bits[e] = static_cast<Bits>(i + e);
    Raw raw;
    std::memcpy(&raw, bits, sizeof(raw));
    for (const auto& [decode, out] : decoders) {
      float f[8];
      decode(raw, f);
      std::memcpy(out->data() + i, f, sizeof(f));
    }
  }
}

// The conversions the kernels use, over all 2^16 fp16 / bf16 and 2^8 e4m3 bit patterns and the floats in
// x.bin, through kernel_common.cuh's own helpers where the kernels call those.
int run_convert() {
  const float* x = buffer<float>("x");
  const size_t n = g_buffers.at("x").bytes / 4;
  std::vector<uint16_t> to_half(n), to_bf16(n);
  std::vector<uint8_t> to_fp8((n + 7) / 8 * 8);
  std::vector<float> exp2(n);
  for (size_t i = 0; i < n; ++i) {
    const __half h = __float2half_rn(x[i]);
    const __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
    std::memcpy(&to_half[i], &h, 2);
    std::memcpy(&to_bf16[i], &b, 2);
    exp2[i] = kernel_lab::fast_exp2(x[i]);
  }
  for (size_t i = 0; i < n; i += 8) {
    float f[8] = {};
    for (size_t e = 0; e < 8 && i + e < n; ++e) f[e] = x[i + e];
    const uint2 packed = kernel_lab::float8_to_fp8x8(f);
    std::memcpy(&to_fp8[i], &packed, 8);
  }
  std::vector<float> from_half(65536), from_bf16(65536), from_fp8(256), from_fp8_folded(256);
  decode_every<uint4, uint16_t>({{kernel_lab::half8_to_float, &from_half}, {kernel_lab::bf16x8_to_float, &from_bf16}});
  decode_every<uint2, uint8_t>(
      {{kernel_lab::fp8x8_to_float_exact, &from_fp8}, {kernel_lab::fp8x8_to_float, &from_fp8_folded}});
  auto write = [](const char* name, const void* data, size_t bytes) {
    std::ofstream out(g_dir + "/" + name, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  };
  write("half_from_float.out", to_half.data(), n * 2);
  write("bf16_from_float.out", to_bf16.data(), n * 2);
  write("fp8_from_float.out", to_fp8.data(), n);
  write("exp2.out", exp2.data(), n * 4);
  write("float_from_half.out", from_half.data(), from_half.size() * 4);
  write("float_from_bf16.out", from_bf16.data(), from_bf16.size() * 4);
  write("float_from_fp8.out", from_fp8.data(), from_fp8.size() * 4);
  write("float_from_fp8_folded.out", from_fp8_folded.data(), from_fp8_folded.size() * 4);
  const float fold = kernel_lab::kFp8DecodeFold;
  write("fp8_fold.out", &fold, 4);
  return 0;
}

int run_selftest_case() {
  return run_selftest(g_params.at("case").c_str(), buffer<int>("in"), buffer<int>("out"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s decode|write_kv|convert|selftest DIR\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  g_dir = argv[2];
  load(g_dir);
  int status;
  if (mode == "decode") {
    status = run_decode();
  } else if (mode == "write_kv") {
    status = run_write_kv();
  } else if (mode == "selftest") {
    status = run_selftest_case();
  } else if (mode == "convert") {
    status = run_convert();
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  if (status != 0) {
    std::fprintf(stderr, "launch returned %d (%s)\n", status, cudaGetErrorString(static_cast<cudaError_t>(status)));
    return 3;
  }
  save();
  return 0;
}
