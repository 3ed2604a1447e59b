// Decode-sized GEMM (kernels/gemm/gemv.cuh).
#include "kernels/common/gpu.h"

#include "kernels/gemm/gemv.cuh"

#include <climits>

#include "kernels/common/bf16x8.cuh"
#include "kernels/gemm/gemv_tiling.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/parallel/tp_push.cuh"

namespace kvfuse::gpu {
namespace {

// Where the kernel also stores its results (launch_gemv_push_bf16), and how: staged, the
// results of 2 to 8 token rows go a token row at a time through shared memory (the tilings of
// one warp per row group); else, as always for one token row and the split tiling, lane 0 of
// each warp stores its group's kRows results of a token row, adjacent columns, as one vector
// where `vector` allows (kRows x 2 bytes: 4 or 8), else one at a time. The same bits every
// way. On an H200 with two ranks sharing it the staged stores took 2 us off a layer at 8 rows
// and cost 0.8 us at 1 (bench/journal/2026-12-03.md).
struct Push {
  PushTargets targets;  // count 0: none
  bool staged = false;
  // Every target 16-byte aligned and n a multiple of 8: a group's kRows columns of a token
  // row (kRows 2 or 4, the group's first column a multiple of kRows) are then aligned to
  // their size in every target.
  bool vector = false;
};

// The kRows results of a group's token row as push_bits, packed for one store (zeroed,
// then each result set once).
template <int kRows>
struct PushWords {
  static_assert(kRows == 2 || kRows == 4, "a 4- or 8-byte store");
  uint32_t w[kRows / 2];
  KVFUSE_DEVICE void set(int r, uint16_t bits) { w[r / 2] |= uint32_t(bits) << (16 * (r % 2)); }
  KVFUSE_DEVICE void store(uint16_t* dst) const {
    if constexpr (kRows == 2) {
      *reinterpret_cast<uint32_t*>(dst) = w[0];
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    }
  }
};

// a . b over the 8 bf16 of two 16-byte words, added to acc in element order.
KVFUSE_DEVICE float dot8(const uint4& a, const float (&b)[8], float acc) {
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(w[i] << 16), b[2 * i], acc);
    acc = fmaf(__uint_as_float(w[i] & 0xffff0000u), b[2 * i + 1], acc);
  }
  return acc;
}

// kRows rows of w per group of kSplit warps (kSplit = 1: a warp per row group; more:
// split-K inside the block, the group's warps taking interleaved 16-byte chunks of the
// same rows and their sums meeting in shared memory, added in warp order: long rows,
// the down projection's k = 14336, then spread over more warps at the same bytes); each
// lane loads kUnroll 16-byte chunks of each of its rows per step, and the loads of step
// s + 1 are issued before the multiplies of step s (software pipelining: up to 2 x kRows
// x kUnroll loads in flight per lane, as the latency-bound small shapes need). The first
// chunks of w are loaded before the PDL wait: the weights do not come from the kernel
// before, so under programmatic launch their first round trip overlaps that kernel's
// tail; only x waits. The sums are in chunk order whatever the pipelining.
//
// kSilu: w is [gate rows; up rows] (n = 2 x inter) and out is act [m, inter] =
// silu_mul(x . w^T): a group's rows are gate rows j.. and up rows inter + j.., each
// summed exactly as without kSilu, rounded to bf16 and combined by launch_silu_mul's
// formula, so the bits are the GEMV's and then silu_mul's.
//
// kStream: w is loaded with load_stream_16B (read once a step: no L1 allocation, evicted
// first from L2), which leaves L1 to x, read by every warp; else with load_ro_16B, as x.
// The same bits either way.
//
// push (bf16 out without kSilu only; no targets elsewhere): each result is also stored, as
// push_bits (kernels/parallel/tp_push.cuh), at the same index of every target (the peers' inboxes of
// a tensor-parallel reduction), staged or not (Push above); uniform branches at the end, so
// no instance of its own.
template <int M, bool kF32, int kRows, int kUnroll, int kSplit, bool kSilu, bool kStream>
__global__ void KVFUSE_LAUNCH_BOUNDS(kGemvThreads, 4)
    gemv_kernel(const bf16_t* x, const bf16_t* w, int64_t n, int64_t k, void* out, Push push) {
  static_assert(kSplit >= 1 && (kGemvThreads / kWarpSize) % kSplit == 0, "kSplit divides the block's warps");
  static_assert(!kSilu || (kRows % 2 == 0 && !kF32), "kSilu pairs rows and writes bf16");
  constexpr int kOuts = kSilu ? kRows / 2 : kRows;  // output columns per group
  const int64_t n_out = kSilu ? n / 2 : n;
  const int part = warp_id() % kSplit;  // this warp's share of the group's chunks
  const int lane = lane_id() + part * kWarpSize;
  const int64_t row0 = (int64_t(blockIdx.x) * (kGemvThreads / kWarpSize / kSplit) + int64_t(warp_id() / kSplit)) * kOuts;
  // Row r of the group: output column row0 + r % kOuts; with kSilu the second half are
  // the up rows.
  const auto w_row = [&](int r) -> int64_t { return kSilu && r >= kOuts ? n_out + row0 + r - kOuts : row0 + r; };
  const int64_t chunks = k / 8;
  constexpr int64_t kStride = int64_t(kUnroll) * kWarpSize * kSplit;
  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  const bool full = row0 + kOuts <= n_out;
  uint4 wv[kUnroll][kRows];
  const uint64_t policy = kStream ? l2_evict_first_policy() : 0;
  const auto load_w_16B = [&](const bf16_t* p) {
    return kStream ? load_stream_16B(p, policy) : load_ro_16B(p);
  };
  auto load_w = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t(u) * kWarpSize * kSplit;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        wv[u][r] = c < chunks && (full || row0 + r % kOuts < n_out) ? load_w_16B(w + w_row(r) * k + c * 8)
                                                                    : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  if (lane < chunks) load_w(lane);
  grid_dependency_wait();  // PDL: x comes from the kernel before
  for (int64_t c0 = lane; c0 < chunks; c0 += kStride) {
    uint4 cur[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) cur[u][r] = wv[u][r];
    if (c0 + kStride < chunks) load_w(c0 + kStride);  // the next step's loads, before this step's math
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t(u) * kWarpSize * kSplit;
      if (c >= chunks) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        float xf[8];
        widen_bf16x8(load_ro_16B(x + int64_t(i) * k + c * 8), xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][i] = dot8(cur[u][r], xf, acc[r][i]);
      }
    }
  }
  launch_dependents();
  if (!gemv_reduce<M, kRows, kSplit>(acc, part)) return;
  if constexpr (kSplit == 1 && !kSilu && !kF32 && M >= 2) {
    if (push.targets.count > 0 && push.staged) {
      // The block's results gathered in shared memory, so that its threads store them into
      // the peers a token row at a time, consecutive columns from consecutive threads: one
      // request per row and peer over the links instead of one per result.
      constexpr int kCols = kGemvThreads / kWarpSize * kRows;  // the block's output columns
      __shared__ uint16_t stage[M][kCols];
      const int64_t col0 = int64_t(blockIdx.x) * kCols;
      if (lane_id() == 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int i = 0; i < M; ++i) {
            const bf16_t v = f32_to_bf16(acc[r][i]);
            if (row0 + r < n) static_cast<bf16_t*>(out)[int64_t(i) * n + row0 + r] = v;
            stage[i][warp_id() * kRows + r] = push_bits(v);
          }
        }
      }
      __syncthreads();
      for (int t = int(threadIdx.x); t < M * kCols; t += kGemvThreads) {
        const int i = t / kCols, c = t % kCols;
        if (col0 + c >= n) continue;
        const uint16_t v = stage[i][c];
#pragma unroll
        for (int p = 0; p < PushTargets::kMax; ++p) {
          if (p < push.targets.count) push.targets.dst[p][int64_t(i) * n + col0 + c] = v;
        }
      }
      return;
    }
  }
  if (lane != 0) return;
  if constexpr (kSilu) {
#pragma unroll
    for (int r = 0; r < kOuts; ++r) {
      if (row0 + r >= n_out) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float g = bf16_bits_to_f32(f32_to_bf16(acc[r][i]));
        const float u = bf16_bits_to_f32(f32_to_bf16(acc[r + kOuts][i]));
        static_cast<bf16_t*>(out)[int64_t(i) * n_out + row0 + r] = f32_to_bf16(silu_mul_f32(g, u));
      }
    }
  } else {
    if constexpr (!kF32 && (kRows == 2 || kRows == 4)) {
      if (push.targets.count > 0 && push.vector && full) {
        // A token row's kRows results: each to out, and as one store to every target.
#pragma unroll
        for (int i = 0; i < M; ++i) {
          PushWords<kRows> words{};
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const bf16_t v = f32_to_bf16(acc[r][i]);
            static_cast<bf16_t*>(out)[int64_t(i) * n + row0 + r] = v;
            words.set(r, push_bits(v));
          }
#pragma unroll
          for (int p = 0; p < PushTargets::kMax; ++p) {
            if (p < push.targets.count) words.store(push.targets.dst[p] + int64_t(i) * n + row0);
          }
        }
        return;
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= n) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const int64_t at = int64_t(i) * n + row0 + r;
        if constexpr (kF32) {
          static_cast<float*>(out)[at] = acc[r][i];
        } else {
          const bf16_t v = f32_to_bf16(acc[r][i]);
          static_cast<bf16_t*>(out)[at] = v;
          if (push.targets.count > 0) {
            const uint16_t pv = push_bits(v);
#pragma unroll
            for (int p = 0; p < PushTargets::kMax; ++p) {
              if (p < push.targets.count) push.targets.dst[p][at] = pv;
            }
          }
        }
      }
    }
  }
}

// out_kind: 0 bf16, 1 fp32, 2 silu_mul (bf16 act of half the columns).
template <int M, int kRows, int kUnroll, int kSplit, bool kStream>
cudaError_t launch_shape(const bf16_t* x, const bf16_t* w, int64_t n, int64_t k, void* out, int out_kind,
                         const Push& push, cudaStream_t stream, bool pdl) {
  const int64_t cols = out_kind == 2 ? n / 2 : n;
  constexpr int64_t kGroupsPerBlock = kGemvThreads / kWarpSize / kSplit;
  const int64_t per_block = kGroupsPerBlock * (out_kind == 2 ? kRows / 2 : kRows);  // output columns
  const int64_t blocks = (cols + per_block - 1) / per_block;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  if (out_kind == 2) {
    return launch_kernel(gemv_kernel<M, false, kRows, kUnroll, kSplit, true, kStream>, unsigned(blocks),
                         kGemvThreads, stream, pdl, x, w, n, k, out, Push{});
  }
  return out_kind == 1
             ? launch_kernel(gemv_kernel<M, true, kRows, kUnroll, kSplit, false, kStream>, unsigned(blocks),
                             kGemvThreads, stream, pdl, x, w, n, k, out, Push{})
             : launch_kernel(gemv_kernel<M, false, kRows, kUnroll, kSplit, false, kStream>, unsigned(blocks),
                             kGemvThreads, stream, pdl, x, w, n, k, out, push);
}

template <int M, bool kStream>
cudaError_t launch_tiling(const bf16_t* x, const bf16_t* w, int64_t n, int64_t k, void* out, int out_kind,
                          const Push& push, cudaStream_t stream, bool pdl, int variant) {
  return with_gemv_tiling<M>(variant, [&](auto t) {
    using T = decltype(t);
    return launch_shape<M, T::kRows, T::kUnroll, T::kSplit, kStream>(x, w, n, k, out, out_kind, push, stream,
                                                                      pdl);
  });
}

// HIP has no streaming hint here (load_stream_16B is a plain load): one instance.
template <int M>
cudaError_t launch_m(const bf16_t* x, const bf16_t* w, int64_t n, int64_t k, void* out, int out_kind,
                     const Push& push, cudaStream_t stream, bool pdl, int variant, bool stream_w) {
  if (kWarpSize == 32 && stream_w) {
    return launch_tiling<M, kWarpSize == 32>(x, w, n, k, out, out_kind, push, stream, pdl, variant);
  }
  return launch_tiling<M, false>(x, w, n, k, out, out_kind, push, stream, pdl, variant);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

int gemv_variants(int64_t m) { return m <= 2 ? kGemvVariants : 3; }

std::string gemv_unsupported(const void* x, int64_t m, const void* w, int64_t n, int64_t k, const void* out) {
  if (m < 1 || m > kGemvMaxRows)
    return "gemv: m " + std::to_string(m) + " outside 1.." + std::to_string(kGemvMaxRows);
  if (n < 1 || k < 8 || k % 8 != 0)
    return "gemv: n " + std::to_string(n) + ", k " + std::to_string(k) + " (k a positive multiple of 8)";
  if (!aligned16(x) || !aligned16(w) || !aligned16(out)) return "gemv: x, w and out must be 16-byte aligned";
  return {};
}

namespace {

LaunchStatus launch_any(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k, void* out,
                        int out_kind, const Push& push, cudaStream_t stream, bool pdl, int variant,
                        bool stream_w) {
  if (std::string why = gemv_unsupported(x, m, w, n, k, out); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (variant < 0 || variant >= gemv_variants(m)) {
    return LaunchStatus::refused("gemv: variant " + std::to_string(variant) + " of " +
                                 std::to_string(gemv_variants(m)) + " for m " + std::to_string(m));
  }
  return with_gemv_rows(m, [&](auto rows) {
    return launch_m<decltype(rows)::value>(x, w, n, k, out, out_kind, push, stream, pdl, variant, stream_w);
  });
}

}  // namespace

LaunchStatus launch_gemv_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k, void* out,
                              bool out_f32, cudaStream_t stream, bool pdl, int variant, bool stream_w) {
  return launch_any(x, m, w, n, k, out, out_f32 ? 1 : 0, Push{}, stream, pdl, variant, stream_w);
}

LaunchStatus launch_gemv_push_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                   bf16_t* out, const PushTargets& push, cudaStream_t stream, bool pdl,
                                   int variant, bool stream_w, bool staged) {
  if (push.count < 0 || push.count > PushTargets::kMax) {
    return LaunchStatus::refused("gemv push: " + std::to_string(push.count) + " targets (0.." +
                                 std::to_string(PushTargets::kMax) + ")");
  }
  for (int p = 0; p < push.count; ++p) {
    if (push.dst[p] == nullptr)
      return LaunchStatus::refused("gemv push: target " + std::to_string(p) + " is null");
  }
  bool vector = n % 8 == 0;
  for (int p = 0; p < push.count; ++p) vector = vector && reinterpret_cast<uintptr_t>(push.dst[p]) % 16 == 0;
  return launch_any(x, m, w, n, k, out, 0, Push{push, staged, vector}, stream, pdl, variant, stream_w);
}

LaunchStatus launch_gemv_silu_mul_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                       bf16_t* act, cudaStream_t stream, bool pdl, int variant,
                                       bool stream_w) {
  if (n % 2 != 0) {
    return LaunchStatus::refused("gemv silu_mul: n " + std::to_string(n) + " must be even (gate rows, then up rows)");
  }
  return launch_any(x, m, w, n, k, act, 2, Push{}, stream, pdl, variant, stream_w);
}

}  // namespace kvfuse::gpu
