// The end of the GEMV kernels' sums (kernels/gemm/gemv.cu, kernels/gemm/gemv_fp8.cu):
// each warp's lanes' partial sums meet in a butterfly; with kSplit warps sharing a group
// of rows, the group's first warp adds the others' sums in warp order. Device code only.
#pragma once

#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

// acc[r][i]: this lane's partial sums of kRows rows of w for M rows of x. Afterwards every
// lane of a warp holds its warp's sums, and with kSplit > 1 the group's first warp holds
// the group's. Returns false for the warps that are then done (the group's others): only
// the first goes on to the epilogue. `part`: this warp's index in its group.
template <int M, int kRows, int kSplit, int kThreads>
KVFUSE_DEVICE bool gemv_reduce(float (&acc)[kRows][M], int part) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = warp_reduce_sum(acc[r][i]);
  }
  if constexpr (kSplit > 1) {
    __shared__ float sums[kThreads / kWarpSize][kRows][M];
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
