// The GPU portability layer (docs/design.md#gpu-portability-layer, llama.cpp style). Kernels and host code are
// written once in the CUDA dialect; kernels/common/vendor/hip.h maps the runtime names for
// AMD, and the same .cu files build as LANGUAGE HIP (kernels/gpu.cmake). Everything
// that differs between vendors inside a kernel is a helper here, so kernels have no
// #if of their own. The warp is kWarpSize lanes (32 NVIDIA, 64 CDNA): kernels never
// spell 32 or use 32-bit lane masks.
#pragma once

#if defined(KVFUSE_HIP) || defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#include "kernels/common/vendor/hip.h"
#else
#include "kernels/common/vendor/cuda.h"
#endif

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/common/host_device.h"

#define KVFUSE_DEVICE __device__ __forceinline__

// KVFUSE_LAUNCH_BOUNDS(threads, blocks): the kernel is launched with at most `threads`
// threads per block, and at least `blocks` such blocks must be resident on one
// multiprocessor (NVIDIA SM, AMD CU) at once; the compiler limits registers to match.
// The same meaning on both vendors (HIP's __launch_bounds__ takes waves per SIMD
// instead: vendor/hip.h converts). Kernels never use __launch_bounds__ directly.
#define KVFUSE_LAUNCH_BOUNDS(threads, blocks) KVFUSE_VENDOR_LAUNCH_BOUNDS(threads, blocks)

namespace kvfuse::gpu {

constexpr int kWarpSize = KVFUSE_WARP_SIZE;
static_assert(kWarpSize == 32 || kWarpSize == 64, "warp size");

KVFUSE_DEVICE int lane_id() { return int(threadIdx.x) % kWarpSize; }
KVFUSE_DEVICE int warp_id() { return int(threadIdx.x) / kWarpSize; }

template <class T>
KVFUSE_DEVICE T warp_shfl_xor(T x, int lane_xor) {
  return vendor_shfl_xor(x, lane_xor);
}

template <class T>
KVFUSE_DEVICE T warp_broadcast(T x, int src_lane) {
  return vendor_shfl(x, src_lane);
}

// op over all the lanes of the warp; every lane gets the same result. op(a, b) must be
// commutative, and associative up to rounding: the tree that combines the lanes is the
// vendor's (vendor/cuda.h: a butterfly over lane ^ 16, ..., ^ 1; vendor/hip.h: DPP steps
// within and across rows of 16 lanes, then lane 63 read into every lane). Both trees
// have depth log2(kWarpSize): a float sum rounds at most that often on the way from any
// addend to the result, |error| <= log2(kWarpSize) * u * sum|x| (u = 2^-24), on either
// vendor. T: a trivially copyable type of whole 32-bit words (a float, an integer, a
// small struct such as a value and its index). Every lane of the warp must take part.
template <class T, class Op>
KVFUSE_DEVICE T warp_reduce(T x, Op op) {
  return vendor_warp_reduce(x, op);
}

template <class T>
KVFUSE_DEVICE T warp_reduce_sum(T x) {
  return warp_reduce(x, [](T a, T b) { return a + b; });
}

template <class T>
KVFUSE_DEVICE T warp_reduce_max(T x) {
  return warp_reduce(x, [](T a, T b) { return b > a ? b : a; });
}

// Inclusive prefix sum over the lanes in lane order: lane i gets x(0) + ... + x(i).
// Exact for integers; a float sum's order is the vendor's.
template <class T>
KVFUSE_DEVICE T warp_inclusive_sum(T x) {
  return vendor_warp_inclusive_sum(x);
}

// 1/x rounded to nearest even: kernels compute a scale's reciprocal exactly as the CPU
// reference does (kernels/cpu/kv_write/kv_write.cc), or the bytes would differ.
KVFUSE_DEVICE float recip_rn(float x) { return vendor_recip_rn(x); }
// a * b, a + b, a - b each rounded on its own (never contracted into a multiply-add), so
// that kernels which share an expression give the same bits whatever the compiler fuses.
KVFUSE_DEVICE float mul_rn(float a, float b) { return vendor_mul_rn(a, b); }
KVFUSE_DEVICE float add_rn(float a, float b) { return vendor_add_rn(a, b); }
KVFUSE_DEVICE float sub_rn(float a, float b) { return vendor_sub_rn(a, b); }

// Exact bf16 / f16 -> fp32 widening of raw 16-bit patterns (kernels/common/bf16.h types).
KVFUSE_DEVICE float bf16_bits_to_f32(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }
KVFUSE_DEVICE float f16_bits_to_f32(uint16_t bits) { return vendor_f16_to_f32(bits); }

// Two fp32 loads that both issue before either value is used (vendor_load_f32_pair).
KVFUSE_DEVICE void load_f32_pair(const float* a, const float* b, float& x, float& y) {
  vendor_load_f32_pair(a, b, x, y);
}

// 16-byte vector memory access. The caller guarantees 16-byte alignment.
KVFUSE_DEVICE uint4 load_ro_16B(const void* p) { return vendor_load_ro_16B(p); }
KVFUSE_DEVICE void store_16B(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }
// Data read once per step (weights): not kept in L1, evicted first from L2 (CUDA; a plain
// load on HIP). policy: l2_evict_first_policy(), made once per thread.
KVFUSE_DEVICE uint64_t l2_evict_first_policy() { return vendor_l2_evict_first_policy(); }
KVFUSE_DEVICE uint4 load_stream_16B(const void* p, uint64_t policy) {
  return vendor_load_stream_16B(p, policy);
}

// x[0 .. N) = p[0 .. N) as N/4 16-byte loads. The caller guarantees 16-byte alignment.
template <int N>
KVFUSE_DEVICE void load_f32x4s(const float* p, float (&x)[N]) {
  static_assert(N % 4 == 0, "whole float4s");
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const float4 q = reinterpret_cast<const float4*>(p)[j];
    x[4 * j] = q.x;
    x[4 * j + 1] = q.y;
    x[4 * j + 2] = q.z;
    x[4 * j + 3] = q.w;
  }
}

// A row of n fp32 values split for 16-byte loads: `head` elements (0-3) before the
// row's first 16-byte boundary, `vecs` whole aligned float4s from there, and the 0-3
// elements from tail() on. The row must be 4-byte aligned (any float*).
struct F32Row {
  const float* p;
  int64_t n;
  int64_t head;
  int64_t vecs;

  KVFUSE_DEVICE F32Row(const float* row, int64_t count) : p(row), n(count) {
    const int64_t to_boundary = int64_t((4 - ((reinterpret_cast<uintptr_t>(row) >> 2) & 3)) & 3);
    head = to_boundary < count ? to_boundary : count;
    vecs = (count - head) / 4;
  }
  KVFUSE_DEVICE int64_t tail() const { return head + 4 * vecs; }
  // x[0 .. 4) = p[head + 4v .. head + 4v + 4), one 16-byte load.
  KVFUSE_DEVICE void load_vec(int64_t v, float (&x)[4]) const {
    const uint4 q = load_ro_16B(p + head + 4 * v);
    x[0] = __uint_as_float(q.x);
    x[1] = __uint_as_float(q.y);
    x[2] = __uint_as_float(q.z);
    x[3] = __uint_as_float(q.w);
  }
};

// f(i, row[i]) for every i in [0, n), split over the kThreads threads of the block: the
// 0-6 elements outside F32Row's whole vectors one per thread, then thread t takes vectors
// t, t + kThreads, ..., kUnroll of them loaded before any is used so that as many loads
// are in flight. Each element is visited exactly once; which thread visits it, and in
// what order a thread visits its elements, differ from a scalar `i += kThreads` walk, so
// f must not depend on either beyond rounding (a float sum's order).
template <int kThreads, int kUnroll, class F>
KVFUSE_DEVICE void block_for_each_f32(const float* row, int64_t n, F&& f) {
  const F32Row r(row, n);
  const int64_t t = threadIdx.x;
  if (t < r.head + (n - r.tail())) {
    const int64_t i = t < r.head ? t : r.tail() + (t - r.head);
    f(i, row[i]);
  }
  for (int64_t v0 = t; v0 < r.vecs; v0 += int64_t(kUnroll) * kThreads) {
    float x[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 + u * kThreads < r.vecs) r.load_vec(v0 + u * kThreads, x[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * kThreads;
      if (v >= r.vecs) break;
#pragma unroll
      for (int j = 0; j < 4; ++j) f(r.head + 4 * v + j, x[u][j]);
    }
  }
}

// f(i) for each work item i in [0, items) of this thread: a grid-stride loop, so any
// grid covers any count.
template <class F>
KVFUSE_DEVICE void grid_stride_loop(int64_t items, F&& f) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * blockDim.x) {
    f(i);
  }
}

KVFUSE_HD bool is_aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Programmatic dependent launch. Kernels call grid_dependency_wait() before their first
// access to global memory (inputs come from the previous kernel, outputs may still be
// read by it), then launch_dependents() so the next kernel's launch overlaps their own
// work. Both are no-ops unless the kernel was launched with pdl = true on CUDA sm_90+.
KVFUSE_DEVICE void grid_dependency_wait() { vendor_grid_dependency_wait(); }
KVFUSE_DEVICE void launch_dependents() { vendor_launch_dependents(); }

// Kernels launched either way, with and without PDL (the KV writes, whose A/B arms run
// both), are built twice: an instance that holds the two instructions costs about 0.2 us
// more a call at one token on an H200 when launched without the attribute, even with
// them behind a branch. The kPdl instance triggers first and then waits, so that the next
// kernel's launch overlaps this one's wait as well: about 0.16 us less a call under PDL
// (bench/bench_kv_write_probe.cu). The next kernel still waits for this one to finish.
template <bool kPdl>
KVFUSE_DEVICE void pdl_handshake() {
  if constexpr (kPdl) {
    launch_dependents();
    grid_dependency_wait();
  }
}

// f(std::true_type{}) for a launch with PDL, f(std::false_type{}) without: the instance
// to launch (pdl_handshake). AMD, which has no PDL, instantiates only the second.
template <class F>
auto with_pdl(bool pdl, F&& f) {
  if constexpr (KVFUSE_HAS_PDL) {
    return pdl ? f(std::true_type{}) : f(std::false_type{});
  } else {
    (void)pdl;
    return f(std::false_type{});
  }
}

// Signalling between the GPUs of one process (kernels/parallel/peer_allreduce.cu): a store
// with release semantics at system scope (everything this thread's block wrote before a
// __syncthreads() is visible to whoever reads the value), a relaxed load at system scope
// to poll with, and the acquire fence that follows a poll which saw the value. 64-bit
// words, naturally aligned, in device memory from malloc_signals() or host memory from
// host_alloc_mapped().
KVFUSE_DEVICE void store_release_system(uint64_t* p, uint64_t v) { vendor_store_release_system(p, v); }
KVFUSE_DEVICE uint64_t load_relaxed_system(const uint64_t* p) { return vendor_load_relaxed_system(p); }
KVFUSE_DEVICE void fence_acquire_system() { vendor_fence_acquire_system(); }
// 16 bytes that other GPUs (or other kernels) store into while this kernel polls them,
// read from memory each time (never a cached copy), each 4-byte word at once.
KVFUSE_DEVICE uint4 load_volatile_16B(const void* p) { return vendor_load_volatile_16B(p); }
// A clock at a constant rate (wall_clock_hz), for timeouts inside kernels.
KVFUSE_DEVICE uint64_t wall_clock() { return vendor_wall_clock(); }

// The one way kernels are launched: <<<>>> or, with pdl, a launch that may start
// before the previous kernel in the stream has finished (CUDA only). Returns the
// launch status.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), unsigned grid, unsigned block, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  return vendor_launch(kernel, dim3(grid), dim3(block), stream, pdl, static_cast<Args&&>(args)...);
}

// --- Host side: launch results --------------------------------------------------------

// "cuda error in <what>: cudaErrorX (text)" (hip on AMD): the one way a GPU error is
// put into words.
inline std::string error_message(cudaError_t err, const char* what) {
  return std::string(KVFUSE_GPU_VENDOR) + " error in " + what + ": " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ")";
}

// What a launcher returns: the vendor status and, when the launcher refused its
// arguments (cudaErrorInvalidValue), a message naming the whole argument tuple. Converts
// to its cudaError_t, so a caller that wants only the code writes `== cudaSuccess` or
// `cudaError_t err = launch_...(...)`; one that reports it keeps the message.
class [[nodiscard]] LaunchStatus {
 public:
  LaunchStatus(cudaError_t code = cudaSuccess) : code_(code) {}  // NOLINT: implicit by design
  LaunchStatus(cudaError_t code, std::string message) : code_(code), message_(std::move(message)) {}
  // An argument tuple the kernels do not support.
  static LaunchStatus refused(std::string message) { return {cudaErrorInvalidValue, std::move(message)}; }

  bool ok() const { return code_ == cudaSuccess; }
  cudaError_t code() const { return code_; }
  // Empty on success and for errors of the vendor runtime (their text is error_message's).
  const std::string& message() const { return message_; }
  operator cudaError_t() const { return code_; }  // NOLINT: implicit by design

 private:
  cudaError_t code_;
  std::string message_;
};

// Returns from the enclosing function (which returns LaunchStatus or cudaError_t) when
// `expr` (a LaunchStatus or cudaError_t) is not a success.
#define KVFUSE_GPU_RETURN_IF_ERROR(...)                                         \
  do {                                                                          \
    if (::kvfuse::gpu::LaunchStatus st_ = (__VA_ARGS__); !st_.ok()) return st_; \
  } while (0)

// Ticks per second of wall_clock() on `device`.
inline cudaError_t wall_clock_hz(int device, int64_t* hz) { return vendor_wall_clock_hz(device, hz); }
// Device memory for flags that other GPUs store into while a kernel polls them.
inline cudaError_t malloc_signals(void** p, size_t bytes) { return vendor_malloc_signals(p, bytes); }
// Pinned host memory, mapped into every GPU at the same address, coherent while kernels
// run (free with cudaFreeHost).
inline cudaError_t host_alloc_mapped(void** p, size_t bytes) { return vendor_host_alloc_mapped(p, bytes); }

// query() for the current device, asked once per device and slot (0 .. kSlots-1) and kept
// by the calling site (each lambda type has its own cache): device properties and
// occupancy do not change while the process runs. `fallback` when the device or the slot
// is out of range. A query that returns 0 is not kept: it is asked again at the next call.
template <int kSlots, class Query>
int32_t once_per_device(int slot, int32_t fallback, Query&& query) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int32_t> cache[kMaxDevices][kSlots];
  int dev = 0;
  if (slot < 0 || slot >= kSlots || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    return fallback;
  }
  int32_t n = cache[dev][slot].load(std::memory_order_relaxed);
  if (n == 0) {
    n = query();
    cache[dev][slot].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Grid size for `items` work items of `per_block` each, capped at the largest 1D grid
// every vendor accepts (kernels that use it loop with a grid stride).
inline unsigned grid_blocks(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  constexpr int64_t kMaxBlocks = 0x7fffffff;
  return unsigned(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace kvfuse::gpu
