// What the two GEMVs (kernels/gemm/gemv.cu for bf16 weights, kernels/gemm/gemv_fp8.cu for
// FP8 ones) share: the block size, the tilings the tuner chooses among
// (kernels/gemm/gemv.cuh, gemv_variants), the dispatch of m and of a variant to template
// arguments (through kernels/common/dispatch.cuh), and the end of the sums.
#pragma once

#include "kernels/common/gpu.h"

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/common/dispatch.cuh"
#include "kernels/gemm/gemv.cuh"

namespace kvfuse::gpu {

constexpr int kGemvThreads = 128;
// Split-K over the block's warps: 4 on NVIDIA, 2 on CDNA (128 threads either way).
constexpr int kGemvBlockSplit = kGemvThreads / kWarpSize;

// A tiling: kRows rows of w per warp, kUnroll 16-byte chunks in flight per row, kSplit
// warps per row group.
template <int kRowsT, int kUnrollT, int kSplitT>
struct GemvTiling {
  static constexpr int kRows = kRowsT, kUnroll = kUnrollT, kSplit = kSplitT;
};

// The row counts the GEMVs are instantiated for, 1 .. kGemvMaxRows.
inline constexpr std::array<int, 8> kGemvRowCounts = {1, 2, 3, 4, 5, 6, 7, 8};
static_assert(kGemvRowCounts.size() == kGemvMaxRows && kGemvRowCounts.back() == kGemvMaxRows);

// f(std::integral_constant<int, m>{}) through kernels/common/dispatch.cuh's one_of (the
// callers check m first).
template <class Fn>
auto with_gemv_rows(int64_t m, Fn&& f) {
  return dispatch_detail::one_of<kGemvRowCounts>(int(m), f, std::make_index_sequence<kGemvRowCounts.size()>{});
}

// f(GemvTiling<...>{}) for variant 0 .. gemv_variants(M) - 1: 0: 2 rows x 2 chunks; for
// m <= 2 also 1: 2 rows x 4 chunks, 2: 4 rows x 2 chunks (more bytes in flight for the
// latency-bound small shapes); then, for every m: 2 rows x 1 chunk (shorter steps: the
// first GEMV's loop, which the long-k down projection preferred); last, for every m: 2
// rows x 2 chunks split over the block's warps (a block per row pair: long rows on more
// warps).
template <int M, class Fn>
auto with_gemv_tiling(int variant, Fn&& f) {
  if constexpr (M <= 2) {
    if (variant == 1) return f(GemvTiling<2, 4, 1>{});
    if (variant == 2) return f(GemvTiling<4, 2, 1>{});
  }
  if (variant == gemv_variants(M) - 1) return f(GemvTiling<2, 2, kGemvBlockSplit>{});
  if (variant == gemv_variants(M) - 2) return f(GemvTiling<2, 1, 1>{});
  return f(GemvTiling<2, 2, 1>{});
}

// The end of the sums: each warp's lanes' partial sums meet in a butterfly; with kSplit
// warps sharing a group of rows, the group's first warp adds the others' sums in warp order.

// acc[r][i]: this lane's partial sums of kRows rows of w for M rows of x. Afterwards every
// lane of a warp holds its warp's sums, and with kSplit > 1 the group's first warp holds
// the group's. Returns false for the warps that are then done (the group's others): only
// the first goes on to the epilogue. `part`: this warp's index in its group.
template <int M, int kRows, int kSplit>
KVFUSE_DEVICE bool gemv_reduce(float (&acc)[kRows][M], int part) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = warp_reduce_sum(acc[r][i]);
  }
  if constexpr (kSplit > 1) {
    __shared__ float sums[kGemvThreads / kWarpSize][kRows][M];
    if (lane_id() == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) sums[warp_id()][r][i] = acc[r][i];
    }
    __syncthreads();
    if (part != 0) return false;
#pragma unroll
    for (int s = 1; s < kSplit; ++s)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) acc[r][i] += sums[warp_id() + s][r][i];
  }
  return true;
}

}  // namespace kvfuse::gpu
