// The SIMT host runtime behind simt.h: fibers, the block scheduler, barriers, warp collectives, deferred
// cp.async copies and (KL_SIMT_RACE builds) the shared-memory race detector fed by the compiler's
// -fsanitize=thread access hooks. This file itself is never instrumented.
#include "simt.h"

#include <link.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace simt {

thread_local unsigned char dynamic_shared[kDynamicSharedBytes] __attribute__((aligned(16)));

namespace {

// The executable's TLS block: every __shared__ variable (see simt.h) and dynamic_shared, nothing else.
struct SharedRange {
  unsigned char* begin = nullptr;
  size_t bytes = 0;
};

int find_main_tls(dl_phdr_info* info, size_t, void* data) {
  auto* range = static_cast<SharedRange*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      range->begin = static_cast<unsigned char*>(info->dlpi_tls_data);
      range->bytes = info->dlpi_phdr[i].p_memsz;
    }
  }
  return 1;  // the first module reported is the executable itself
}

// Set while a block runs (outside kernels no address is shared memory).
const unsigned char* g_shared_begin = nullptr;
size_t g_shared_bytes = 0;

const SharedRange& shared_range() {
  static const SharedRange range = [] {
    SharedRange r;
    dl_iterate_phdr(find_main_tls, &r);
    if (!r.begin || r.bytes < kDynamicSharedBytes) fail("cannot find the executable's TLS block (shared memory)");
    return r;
  }();
  return range;
}

constexpr size_t kStackBytes = 256 * 1024;  // ASan's redzones make frames several times larger
constexpr unsigned char kSharedPoison = 0xff;  // every float and half made of these bytes is a NaN

enum class State { kRunnable, kBarrier, kCollective, kDone };

struct PendingCopy {
  void* dst;
  const void* src;
  size_t bytes;
  size_t group;
};

}  // namespace

struct Fiber {
  ucontext_t context;
  unsigned char* stack = nullptr;
  uint3 tid;
  int linear = 0, warp = 0, lane = 0;
  State state = State::kRunnable;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  uint64_t result = 0;
  uint32_t lane_clock[32] = {};  // this lane's view of its warp mates' progress (ordering without barriers)
  std::vector<PendingCopy> copies;
  size_t committed_groups = 0;
};

namespace {

struct OpenCollective {
  Collective kind;
  unsigned mask, arrived;
  int width;
  uint64_t value[32];
  int arg[32];
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<std::vector<OpenCollective>> warps;  // collectives waiting for lanes, per warp
  int at_barrier = 0;
  uint32_t barrier_epoch = 0;
  uint32_t serial = 0;  // distinguishes blocks in the race shadow
  ucontext_t scheduler;
  BlockBody body;
  void* closure;
};

Block g_block;
std::mt19937_64 g_rng(1);
cudaError_t g_last_error = cudaSuccess;
bool g_seeded = false;

const char* kind_name(Collective k) {
  static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync"};
  return names[static_cast<int>(k)];
}

void seed_once() {
  if (g_seeded) return;
  g_seeded = true;
  const char* seed = std::getenv("KL_SIMT_SEED");
  g_rng.seed(seed ? std::strtoull(seed, nullptr, 10) : 1);
}

// ASan must be told about every stack switch (__sanitizer_*_switch_fiber), or it takes a fiber's frames for
// a corrupted main stack.
#if defined(__SANITIZE_ADDRESS__)
void* g_fake_stack = nullptr;
const void* g_main_stack = nullptr;
size_t g_main_stack_bytes = 0;
void to_fiber(const Fiber* f) { __sanitizer_start_switch_fiber(&g_fake_stack, f->stack, kStackBytes); }
void arrived_in_fiber() { __sanitizer_finish_switch_fiber(g_fake_stack, &g_main_stack, &g_main_stack_bytes); }
void to_scheduler(bool exiting) {
  __sanitizer_start_switch_fiber(exiting ? nullptr : &g_fake_stack, g_main_stack, g_main_stack_bytes);
}
void arrived_in_scheduler() { __sanitizer_finish_switch_fiber(g_fake_stack, nullptr, nullptr); }
#else
void to_fiber(const Fiber*) {}
void arrived_in_fiber() {}
void to_scheduler(bool) {}
void arrived_in_scheduler() {}
#endif

// From a fiber back to the scheduler; returns when the scheduler resumes this fiber.
void yield() {
  Fiber* self = g_current;
  to_scheduler(false);
  swapcontext(&self->context, &g_block.scheduler);
  arrived_in_fiber();
}

}  // namespace

Fiber* g_current = nullptr;
uint3 g_block_idx, g_block_dim, g_grid_dim;

void fail(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "SIMT ERROR");
  if (g_current) {
    std::fprintf(stderr, " (block %u,%u,%u thread %u,%u,%u)", g_block_idx.x, g_block_idx.y, g_block_idx.z,
                 g_current->tid.x, g_current->tid.y, g_current->tid.z);
  }
  std::fprintf(stderr, ": ");
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::_Exit(86);
}

const uint3& thread_idx() {
  if (!g_current) fail("threadIdx read outside a kernel");
  return g_current->tid;
}

unsigned active_mask() {
  const int first = g_current->warp * 32;
  unsigned mask = 0;
  for (int l = 0; l < 32 && first + l < static_cast<int>(g_block.fibers.size()); ++l) {
    if (g_block.fibers[first + l].state != State::kDone) mask |= 1u << l;
  }
  return mask;
}

// ------------------------------------------------------------------------------------------ barriers
void syncthreads(const char* file, int line) {
  Fiber* self = g_current;
  for (const Fiber& f : g_block.fibers) {
    if (f.state == State::kDone) {
      fail("__syncthreads() at %s:%d: thread %d of the block has already returned, so not every thread "
           "reaches this barrier (divergent __syncthreads)", file, line, f.linear);
    }
    if (f.state == State::kBarrier && (f.barrier_line != line || std::strcmp(f.barrier_file, file) != 0)) {
      fail("__syncthreads() at %s:%d while thread %d waits at the one at %s:%d (divergent __syncthreads)", file,
           line, f.linear, f.barrier_file, f.barrier_line);
    }
  }
  self->state = State::kBarrier;
  self->barrier_file = file;
  self->barrier_line = line;
  if (++g_block.at_barrier == static_cast<int>(g_block.fibers.size())) {
    g_block.at_barrier = 0;
    ++g_block.barrier_epoch;
    for (Fiber& f : g_block.fibers) f.state = State::kRunnable;
  }
  yield();
}

// ------------------------------------------------------------------------------------------ warp collectives
namespace {

bool is_power_of_two(int w) { return w > 0 && (w & (w - 1)) == 0; }

// The lane whose value `lane` receives, or -1 for its own value (CUDA's rules for each shuffle and width).
int source_lane(Collective kind, int lane, int arg, int width) {
  const int segment = lane & ~(width - 1);
  switch (kind) {
    case Collective::kShfl: return segment + (arg & (width - 1));
    case Collective::kShflUp: return lane - arg >= segment ? lane - arg : -1;
    case Collective::kShflDown: return lane + arg < segment + width ? lane + arg : -1;
    case Collective::kShflXor: {
      const int src = lane ^ arg;
      return src < segment + width ? src : -1;
    }
    default: return -1;
  }
}

void complete(OpenCollective& c, int warp) {
  std::vector<Fiber>& fibers = g_block.fibers;
  Fiber* lanes[32] = {};
  uint32_t joined[32] = {};
  for (int l = 0; l < 32; ++l) {
    if (!(c.mask >> l & 1)) continue;
    lanes[l] = &fibers[warp * 32 + l];
    lanes[l]->lane_clock[l] += 1;
    for (int k = 0; k < 32; ++k) joined[k] = std::max(joined[k], lanes[l]->lane_clock[k]);
  }
  uint64_t ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] && c.value[l]) ballot |= 1ull << l;
  }
  for (int l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    if (!f) continue;
    std::memcpy(f->lane_clock, joined, sizeof(joined));
    switch (c.kind) {
      case Collective::kSyncWarp: f->result = 0; break;
      case Collective::kBallot: f->result = ballot; break;
      case Collective::kAny: f->result = ballot != 0; break;
      case Collective::kAll: f->result = ballot == c.mask; break;
      default: {
        const int src = source_lane(c.kind, l, c.arg[l], c.width);
        if (src >= 0 && !(c.mask >> src & 1)) {
          g_current = f;
          fail("%s with mask 0x%08x: lane %d reads lane %d, which the mask does not name (its value is "
               "undefined)", kind_name(c.kind), c.mask, l, src);
        }
        f->result = src < 0 ? c.value[l] : c.value[src];
      }
    }
    f->state = State::kRunnable;
  }
}

}  // namespace

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width) {
  Fiber* self = g_current;
  if (!self) fail("%s called outside a kernel", kind_name(kind));
  const int warp = self->warp, lane = self->lane;
  const int warp_threads = std::min(32, static_cast<int>(g_block.fibers.size()) - warp * 32);
  const unsigned existing = warp_threads == 32 ? 0xffffffffu : (1u << warp_threads) - 1;
  if (!(mask >> lane & 1)) fail("%s with mask 0x%08x: the calling lane %d is not in its mask", kind_name(kind), mask, lane);
  if (mask & ~existing) fail("%s with mask 0x%08x names lanes this warp does not have", kind_name(kind), mask);
  if (!is_power_of_two(width) || width > 32) fail("%s: width %d is not a power of two <= 32", kind_name(kind), width);
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1) && g_block.fibers[warp * 32 + l].state == State::kDone) {
      fail("%s with mask 0x%08x: lane %d has already returned and will never arrive", kind_name(kind), mask, l);
    }
  }
  std::vector<OpenCollective>& open = g_block.warps[warp];
  OpenCollective* mine = nullptr;
  for (OpenCollective& c : open) {
    if (!(c.mask & mask)) continue;
    if (c.mask != mask || c.kind != kind || c.width != width) {
      fail("%s with mask 0x%08x meets lanes 0x%08x waiting in %s with mask 0x%08x: every lane a mask names "
           "must call the same collective with the same mask", kind_name(kind), mask, c.arrived,
           kind_name(c.kind), c.mask);
    }
    mine = &c;
  }
  if (!mine) {
    open.push_back(OpenCollective{kind, mask, 0, width, {}, {}});
    mine = &open.back();
  }
  mine->value[lane] = value;
  mine->arg[lane] = arg;
  mine->arrived |= 1u << lane;
  self->state = State::kCollective;
  if (mine->arrived == mask) {
    complete(*mine, warp);
    open.erase(open.begin() + (mine - open.data()));
    g_current = self;
  }
  yield();  // even when this lane completed it: another runnable thread may go first
  return self->result;
}

// ------------------------------------------------------------------------------------------ cp.async
#if defined(KL_SIMT_RACE)
void note_shared_write(void* p, size_t bytes);
#endif

void pipeline_memcpy_async(void* dst, const void* src, size_t bytes) {
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("__pipeline_memcpy_async of %zu bytes (4, 8 or 16)", bytes);
  if (reinterpret_cast<uintptr_t>(dst) % bytes || reinterpret_cast<uintptr_t>(src) % bytes) {
    fail("__pipeline_memcpy_async: %zu-byte copy with a misaligned address", bytes);
  }
  g_current->copies.push_back(PendingCopy{dst, src, bytes, g_current->committed_groups});
}

void pipeline_commit() { ++g_current->committed_groups; }

void pipeline_wait_prior(size_t groups) {
  Fiber* self = g_current;
  std::vector<PendingCopy> still;
  for (const PendingCopy& c : self->copies) {
    if (c.group + groups < self->committed_groups) {
      std::memcpy(c.dst, c.src, c.bytes);
#if defined(KL_SIMT_RACE)
      note_shared_write(c.dst, c.bytes);
#endif
    } else {
      still.push_back(c);
    }
  }
  self->copies.swap(still);
}

// ------------------------------------------------------------------------------------------ launch
namespace {

void fiber_entry() {
  arrived_in_fiber();
  g_block.body(g_block.closure);
  Fiber* self = g_current;
  if (g_block.at_barrier) {
    fail("returned while %d threads of the block wait at a __syncthreads() (divergent __syncthreads)",
         g_block.at_barrier);
  }
  for (const OpenCollective& c : g_block.warps[self->warp]) {
    if (c.mask >> self->lane & 1) {
      fail("returned while lanes 0x%08x wait in %s with mask 0x%08x, which names this lane", c.arrived,
           kind_name(c.kind), c.mask);
    }
  }
  if (!self->copies.empty()) fail("returned with %zu cp.async copies never waited for", self->copies.size());
  self->state = State::kDone;
  to_scheduler(true);
  setcontext(&g_block.scheduler);
}

void run_block(dim3 block) {
  std::vector<Fiber>& fibers = g_block.fibers;
  const int n = static_cast<int>(block.x * block.y * block.z);
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.tid = make_uint3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
    f.linear = i;
    f.warp = i / 32;
    f.lane = i % 32;
    f.state = State::kRunnable;
    std::memset(f.lane_clock, 0, sizeof(f.lane_clock));
    f.copies.clear();
    f.committed_groups = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (auto& w : g_block.warps) w.clear();
  g_block.at_barrier = 0;
  g_block.barrier_epoch = 0;
  ++g_block.serial;
  std::memset(shared_range().begin, kSharedPoison, shared_range().bytes);
  g_shared_begin = shared_range().begin;
  g_shared_bytes = shared_range().bytes;
  std::vector<int> runnable;
  for (;;) {
    runnable.clear();
    int done = 0;
    for (int i = 0; i < n; ++i) {
      if (fibers[i].state == State::kRunnable) runnable.push_back(i);
      done += fibers[i].state == State::kDone;
    }
    if (done == n) break;
    if (runnable.empty()) {
      g_current = nullptr;
      for (int i = 0; i < n; ++i) {
        if (fibers[i].state == State::kCollective) {
          g_current = &fibers[i];
          for (const OpenCollective& c : g_block.warps[fibers[i].warp]) {
            if (c.arrived >> fibers[i].lane & 1) {
              fail("deadlock: waits in %s with mask 0x%08x; lanes 0x%08x never arrive", kind_name(c.kind),
                   c.mask, c.mask & ~c.arrived);
            }
          }
        }
      }
      fail("deadlock: no thread of the block can run (%d done of %d)", done, n);
    }
    Fiber* next = &fibers[runnable[std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(g_rng)]];
    g_current = next;
    to_fiber(next);
    swapcontext(&g_block.scheduler, &next->context);
    arrived_in_scheduler();
    g_current = nullptr;
  }
}

}  // namespace

cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_smem, BlockBody body, void* closure) {
  seed_once();
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || grid.y > 65535 ||
      grid.z > 65535 || block.z > 64) {
    g_last_error = cudaErrorInvalidConfiguration;
    return g_last_error;
  }
  if (dynamic_smem > kDynamicSharedBytes) {
    g_last_error = cudaErrorInvalidValue;
    return g_last_error;
  }
  static std::vector<unsigned char*> stacks;  // kept for the process's later launches
  while (stacks.size() < threads) stacks.push_back(static_cast<unsigned char*>(std::malloc(kStackBytes)));
  std::vector<Fiber>& fibers = g_block.fibers;
  fibers.resize(threads);
  for (size_t i = 0; i < threads; ++i) fibers[i].stack = stacks[i];
  g_block.warps.assign((threads + 31) / 32, {});
  g_block.body = body;
  g_block.closure = closure;
  g_block_dim = make_uint3(block.x, block.y, block.z);
  g_grid_dim = make_uint3(grid.x, grid.y, grid.z);
  std::vector<uint3> order;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back(make_uint3(x, y, z));
  std::shuffle(order.begin(), order.end(), g_rng);
  for (const uint3& b : order) {
    g_block_idx = b;
    run_block(block);
  }
  return cudaSuccess;
}

float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = exp2f(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// ------------------------------------------------------------------------------------------ race detector
#if defined(KL_SIMT_RACE)
namespace {

struct ShadowByte {
  uint32_t serial = 0;  // the block that last touched it; 0 = never
  uint32_t write_epoch = 0, read_epoch = 0;
  uint32_t write_clock = 0, read_clock = 0;
  uint32_t read_warps = 0;  // warps that read it in read_epoch
  int16_t writer = -1, reader = -1;
};

std::vector<ShadowByte>& shadow() {
  static std::vector<ShadowByte> bytes(shared_range().bytes);
  return bytes;
}

// Whether thread `other`'s access, stamped with its own lane clock `clock`, happens before `self`'s now:
// only a barrier (a new epoch) or a warp collective both took part in orders them.
bool ordered(const Fiber* self, int other, uint32_t clock) {
  const Fiber& o = g_block.fibers[other];
  return o.warp == self->warp && self->lane_clock[o.lane] > clock;
}

void access(const void* p, size_t bytes, bool is_write) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  const unsigned char* begin = g_shared_begin;
  // Most accesses are to registers spilled to the stack or to global memory: one unsigned compare.
  if (static_cast<size_t>(c - begin) >= g_shared_bytes) return;
  Fiber* self = g_current;
  if (!self) return;
  const uint32_t epoch = g_block.barrier_epoch, serial = g_block.serial;
  const uint32_t my_clock = self->lane_clock[self->lane];
  for (size_t i = 0; i < bytes; ++i) {
    ShadowByte& s = shadow()[c + i - begin];
    const long offset = static_cast<long>(c + i - begin);
    if (s.serial != serial) s = ShadowByte{serial, 0, 0, 0, 0, 0, -1, -1};
    const bool written_now = s.writer >= 0 && s.write_epoch == epoch && s.writer != self->linear;
    if (written_now && !ordered(self, s.writer, s.write_clock)) {
      fail("shared-memory race: %s of shared byte %ld, which thread %d wrote since the last __syncthreads()",
           is_write ? "write" : "read", offset, s.writer);
    }
    if (is_write) {
      const uint32_t other_warps = s.read_epoch == epoch ? s.read_warps & ~(1u << self->warp) : 0;
      const bool read_now = s.reader >= 0 && s.read_epoch == epoch && s.reader != self->linear;
      if (other_warps || (read_now && !ordered(self, s.reader, s.read_clock))) {
        fail("shared-memory race: write of shared byte %ld, which thread %d read since the last __syncthreads()",
             offset, s.reader);
      }
      s.writer = static_cast<int16_t>(self->linear);
      s.write_epoch = epoch;
      s.write_clock = my_clock;
    } else {
      if (s.writer < 0) {
        fail("read of shared byte %ld before any thread of this block wrote it: uninitialised shared memory, or a "
             "race with a write still to come (a missing __syncthreads()?)", offset);
      }
      if (s.read_epoch != epoch) s.read_warps = 0;
      s.read_warps |= 1u << self->warp;
      s.reader = static_cast<int16_t>(self->linear);
      s.read_epoch = epoch;
      s.read_clock = my_clock;
    }
  }
}

}  // namespace

void note_shared_write(void* p, size_t bytes) { access(p, bytes, true); }

}  // namespace simt

// The hooks GCC's -fsanitize=thread instrumentation calls on every load and store of the kernel sources; no
// ThreadSanitizer runtime is linked (fibers would confuse it), these feed the shared-memory detector only.
#define KL_SIMT_HOOKS(n)                                                                      \
  extern "C" void __tsan_read##n(void* p) { simt::access(p, n, false); }                     \
  extern "C" void __tsan_write##n(void* p) { simt::access(p, n, true); }                     \
  extern "C" void __tsan_unaligned_read##n(void* p) { simt::access(p, n, false); }           \
  extern "C" void __tsan_unaligned_write##n(void* p) { simt::access(p, n, true); }           \
  extern "C" void __tsan_volatile_read##n(void* p) { simt::access(p, n, false); }            \
  extern "C" void __tsan_volatile_write##n(void* p) { simt::access(p, n, true); }
KL_SIMT_HOOKS(1)
KL_SIMT_HOOKS(2)
KL_SIMT_HOOKS(4)
KL_SIMT_HOOKS(8)
KL_SIMT_HOOKS(16)
extern "C" void __tsan_read_range(void* p, unsigned long n) { simt::access(p, n, false); }
extern "C" void __tsan_write_range(void* p, unsigned long n) { simt::access(p, n, true); }
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_init() {}
extern "C" void __tsan_vptr_update(void*, void*) {}
extern "C" void __tsan_vptr_read(void*) {}
namespace simt {
#endif  // KL_SIMT_RACE

}  // namespace simt

extern "C" cudaError_t cudaGetLastError(void) {
  const cudaError_t e = simt::g_last_error;
  simt::g_last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return simt::g_last_error; }

extern "C" const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "error";
  }
}
