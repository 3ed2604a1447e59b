// The all-reduce over peer memory on the device: the one-shot all-reduce kernel and the
// pushed calls' norm (kernels/parallel/peer_allreduce.cuh). The protocol, and why it is
// safe: src/parallel/peer_allreduce.h.
#include "kernels/common/gpu.h"  // first: under HIP it brings the device memcpy that bf16.h uses

#include "kernels/parallel/peer_allreduce.cuh"

#include <algorithm>

#include "kernels/common/bf16.h"
#include "kernels/ops/rmsnorm_row.cuh"
#include "kernels/parallel/tp_push.h"

namespace kvfuse::gpu {
namespace {

constexpr int kMaxRanks = kPeerMaxRanks;
constexpr int kThreads = kPeerBlockThreads;
constexpr int64_t kVecBytes = kPeerVecBytes;
// A waiting thread reads the abort word and the clock once per this many polls of its flag:
// the abort word is host memory (a PCIe read), and a peer that is on time answers sooner.
constexpr uint32_t kPollsPerCheck = 256;
static_assert(kPushNormMaxCols == kNormVecMaxCols, "the pushed norm takes the norm's vector path");

// bf16 (as raw bits) or f32 elements: widened exactly, rounded once (kernels/common/bf16.h, the
// CPU communicator's conversion).
template <class T>
struct Elem;
template <>
struct Elem<uint16_t> {
  static KVFUSE_DEVICE float widen(uint16_t x) { return bf16_to_f32(x); }
  static KVFUSE_DEVICE uint16_t narrow(float x) { return f32_to_bf16(x); }
};
template <>
struct Elem<float> {
  static KVFUSE_DEVICE float widen(float x) { return x; }
  static KVFUSE_DEVICE float narrow(float x) { return x; }
};

template <class T>
struct Vec {
  static constexpr int kN = int(kVecBytes / sizeof(T));
  T e[kN];
};

// Plain loads, not the read-only path: peers' staging is written while this kernel runs.
template <class T>
KVFUSE_DEVICE Vec<T> load_vec(const T* p) {
  return __builtin_bit_cast(Vec<T>, *reinterpret_cast<const uint4*>(p));
}

// Elements [begin, end) of this rank's input into its staging buffer.
template <class T>
KVFUSE_DEVICE void copy_in(const PeerAllReduceArgs& a, T* staging, int64_t begin, int64_t end) {
  const T* in = static_cast<const T*>(a.buf);
  constexpr int kN = Vec<T>::kN;
  int64_t scalar_from = begin;
  if (a.vectors) {
    scalar_from = begin + (end - begin) / kN * kN;
    for (int64_t i = begin + int64_t(threadIdx.x) * kN; i < scalar_from; i += int64_t(kThreads) * kN) {
      store_16B(staging + i, *reinterpret_cast<const uint4*>(in + i));
    }
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) staging[i] = in[i];
}

// Elements [begin, end) of the sum over ranks, in rank order, written over the input.
// This rank's addend is read from its input (the same values as its staging copy).
template <class T>
KVFUSE_DEVICE void reduce(const PeerAllReduceArgs& a, int parity, int64_t begin, int64_t end) {
  T* out = static_cast<T*>(a.buf);
  const T* src[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    src[q] = q == a.rank ? out : static_cast<const T*>(a.staging[q < a.ranks ? q : 0][parity]);
  }
  constexpr int kN = Vec<T>::kN;
  int64_t scalar_from = begin;
  if (a.vectors) {
    scalar_from = begin + (end - begin) / kN * kN;
    for (int64_t i = begin + int64_t(threadIdx.x) * kN; i < scalar_from; i += int64_t(kThreads) * kN) {
      Vec<T> x[kMaxRanks];
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q < a.ranks) x[q] = load_vec(src[q] + i);  // every load issued before any is used
      }
      float acc[kN];
#pragma unroll
      for (int j = 0; j < kN; ++j) acc[j] = Elem<T>::widen(x[0].e[j]);  // not 0 + x: keeps -0
#pragma unroll
      for (int q = 1; q < kMaxRanks; ++q) {
        if (q < a.ranks) {
#pragma unroll
          for (int j = 0; j < kN; ++j) acc[j] += Elem<T>::widen(x[q].e[j]);
        }
      }
      Vec<T> y;
#pragma unroll
      for (int j = 0; j < kN; ++j) y.e[j] = Elem<T>::narrow(acc[j]);
      store_16B(out + i, __builtin_bit_cast(uint4, y));
    }
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
    float acc = Elem<T>::widen(src[0][i]);
#pragma unroll
    for (int q = 1; q < kMaxRanks; ++q) {
      if (q < a.ranks) acc += Elem<T>::widen(src[q][i]);
    }
    out[i] = Elem<T>::narrow(acc);
  }
}

// Polls `flag` until it reaches `call`. False when the group was aborted or the wait timed
// out; a timeout is recorded for status() and aborts the group.
KVFUSE_DEVICE bool wait_for(const PeerAllReduceArgs& a, const uint64_t* flag, uint64_t call, int peer) {
  if (load_relaxed_system(flag) >= call) return true;
  const uint64_t t0 = wall_clock();
  for (uint32_t polls = 1;; ++polls) {
    if (load_relaxed_system(flag) >= call) return true;
    if (polls % kPollsPerCheck != 0) continue;
    if (load_relaxed_system(&a.host->abort) != 0) return false;
    if (wall_clock() - t0 > a.timeout_ticks) {
      PeerHostSignals::Timeout& t = a.host->timeouts[a.rank];
      store_release_system(&t.peer, uint64_t(peer));
      store_release_system(&t.call, call);
      store_release_system(&t.timed_out, 1);
      store_release_system(&a.host->abort, 2);
      return false;
    }
  }
}

// One call on one rank; block b owns elements [b * chunk, (b + 1) * chunk). The protocol
// and why it is safe: src/parallel/peer_allreduce.h. Nothing is touched before the
// programmatic-launch wait, so everything before it in the stream (the input, and this
// rank's previous call) has completed whether it was launched as a dependent or not.
template <class T>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1) peer_all_reduce_kernel(PeerAllReduceArgs a) {
  grid_dependency_wait();
  __shared__ uint64_t call_s;
  const int b = int(blockIdx.x);
  // The rank's call number, one copy per block index so that no block waits for another:
  // block b advances copy b, and block 0 also the copies of the blocks this call does not
  // launch, so every copy is the number of calls so far and all blocks agree on it (and on
  // the staging buffer, by its parity). Calls are stream-ordered: no two launches race.
  if (threadIdx.x == 0) {
    call_s = a.calls[b] + 1;
    a.calls[b] = call_s;
  }
  if (b == 0) {
    for (int i = int(gridDim.x) + int(threadIdx.x); i < kPeerMaxBlocks; i += kThreads) ++a.calls[i];
  }
  __syncthreads();
  const uint64_t call = call_s;
  const int parity = int(call & 1);
  const int64_t begin = int64_t(b) * a.chunk;
  const int64_t end = begin + a.chunk < a.count ? begin + a.chunk : a.count;
  copy_in(a, static_cast<T*>(const_cast<void*>(a.staging[a.rank][parity])), begin, end);
  __syncthreads();  // the block's staging writes, then (cumulative) release of the flags
  bool failed = false;
  if (int(threadIdx.x) < a.ranks) {
    const int p = int(threadIdx.x);
    uint64_t* peer_flags = a.flags[0];  // a.flags[p], selected without indexing the parameters
#pragma unroll
    for (int q = 1; q < kMaxRanks; ++q) peer_flags = q == p ? a.flags[q] : peer_flags;
    store_release_system(peer_flags + b * kMaxRanks + a.rank, call);  // rank p's flags[b][rank]
    failed = !wait_for(a, a.flags[a.rank] + b * kMaxRanks + p, call, p);
    if (!failed) fence_acquire_system();
  }
  if (__syncthreads_or(failed)) return;  // aborted: no result
  launch_dependents();                   // every peer's chunk is in: the next kernel may launch
  reduce<T>(a, parity, begin, end);
}

// --- Pushed partial sums (src/parallel/peer_allreduce.h, "Pushed partial sums") ------------

KVFUSE_DEVICE bool has_empty(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool empty = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) empty = empty || (w[i] & 0xffffu) == kPushEmpty || (w[i] >> 16) == kPushEmpty;
  return empty;
}

// Polls the 16-byte chunk at p until none of its elements is kPushEmpty, its value in v.
// False when the group was aborted or the wait timed out (recorded, and the group aborted).
KVFUSE_DEVICE bool wait_chunk(const PeerPushNormArgs& a, const uint16_t* p, int peer, uint4& v) {
  v = load_volatile_16B(p);
  if (!has_empty(v)) return true;
  const uint64_t t0 = wall_clock();
  for (uint32_t polls = 1;; ++polls) {
    v = load_volatile_16B(p);
    if (!has_empty(v)) return true;
    if (polls % kPollsPerCheck != 0) continue;
    if (load_relaxed_system(&a.host->abort) != 0) return false;
    if (wall_clock() - t0 > a.timeout_ticks) {
      PeerHostSignals::Timeout& t = a.host->timeouts[a.rank];
      store_release_system(&t.peer, uint64_t(peer));
      store_release_system(&t.call, uint64_t(a.call));
      store_release_system(&t.timed_out, 1);
      store_release_system(&a.host->abort, 2);
      return false;
    }
  }
}

// One block per row (kNormThreads threads, the norm's vector path). First every thread
// gathers its chunks of the row's sum: each rank's partial in rank order (its own from
// `partial`, the others polled from the inbox, which it then resets to kPushEmpty), summed
// in fp32 and rounded once, as peer_all_reduce_kernel's reduce(); then the row is
// add_rmsnorm's (rmsnorm_row_vec, the same code as the backend's kernel). A thread whose
// wait failed goes on with what it read (the group is stopped; the result is undefined).
__global__ void KVFUSE_LAUNCH_BOUNDS(kNormThreads, 1) push_add_rmsnorm_kernel(PeerPushNormArgs a) {
  __shared__ float partial[kNormThreads / kWarpSize + 1];
  uint4 wvec[kNormVec];
  load_norm_weight(a.w, a.cols, wvec);  // the model's weight: before the wait
  grid_dependency_wait();               // PDL: this rank's partial comes from the kernel before
  if (a.early_dependents) launch_dependents();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.cols;
    uint4 sum[kNormVec];
#pragma unroll
    for (int k = 0; k < kNormVec; ++k) {
      const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
      if (c >= a.cols) continue;
      Vec<uint16_t> v[kMaxRanks];
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q >= a.ranks) continue;
        uint4 got;
        if (q == a.rank) {
          got = *reinterpret_cast<const uint4*>(a.partial + base + c);
        } else {
          (void)wait_chunk(a, a.inbox[q] + base + c, q, got);
          store_16B(a.inbox[q] + base + c, make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu));
        }
        v[q] = __builtin_bit_cast(Vec<uint16_t>, got);
      }
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = Elem<uint16_t>::widen(v[0].e[j]);  // not 0 + x: keeps -0
#pragma unroll
      for (int q = 1; q < kMaxRanks; ++q) {
        if (q < a.ranks) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += Elem<uint16_t>::widen(v[q].e[j]);
        }
      }
      Vec<uint16_t> y;
#pragma unroll
      for (int j = 0; j < 8; ++j) y.e[j] = Elem<uint16_t>::narrow(acc[j]);
      sum[k] = __builtin_bit_cast(uint4, y);
    }
    if (!a.early_dependents && row == blockIdx.x) launch_dependents();  // every peer's part is in
    rmsnorm_row_vec<true>(
        a.x + base, [&](int k, int64_t) { return sum[k]; }, wvec, a.cols, a.eps, a.out + base, partial);
    __syncthreads();  // partial[] is reused by the next row
  }
}
}  // namespace

cudaError_t launch_peer_all_reduce(const PeerAllReduceArgs& a, bool f32, cudaStream_t stream, bool pdl) {
  if (a.count <= 0) return cudaSuccess;
  if (a.chunk <= 0 || a.ranks < 2 || a.ranks > kMaxRanks || a.rank < 0 || a.rank >= a.ranks) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (a.count + a.chunk - 1) / a.chunk;
  if (blocks > kPeerMaxBlocks) return cudaErrorInvalidValue;
  return f32 ? launch_kernel(peer_all_reduce_kernel<float>, unsigned(blocks), kThreads, stream, pdl, a)
             : launch_kernel(peer_all_reduce_kernel<uint16_t>, unsigned(blocks), kThreads, stream, pdl, a);
}

cudaError_t launch_push_add_rmsnorm(const PeerPushNormArgs& a, cudaStream_t stream, bool pdl) {
  if (a.rows <= 0) return cudaSuccess;
  const unsigned grid = unsigned(std::min<int64_t>(a.rows, 65535));
  return launch_kernel(push_add_rmsnorm_kernel, grid, kNormThreads, stream, pdl, a);
}

cudaError_t load_peer_all_reduce(int* blocks_per_sm) {
  // An occupancy query references the kernel, as a launch would.
  int bf16 = 0, f32 = 0, push = 0;
  cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bf16, peer_all_reduce_kernel<uint16_t>, kThreads, 0);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f32, peer_all_reduce_kernel<float>, kThreads, 0);
  }
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&push, push_add_rmsnorm_kernel, kNormThreads, 0);
  }
  *blocks_per_sm = std::min(bf16, f32);
  return err;
}

}  // namespace kvfuse::gpu
