// The launchers of the all-reduce over peer memory (kernels/parallel/peer_allreduce.h: the
// arguments; src/parallel/peer_allreduce.h: the protocol and the group that calls them).
// CUDA and HIP from one source.
#pragma once

#include "kernels/common/gpu.h"

#include <cstdint>

#include "kernels/parallel/peer_allreduce.h"

namespace kvfuse::gpu {

// The widest row push_add_rmsnorm takes: the norm's vector path (kernels/ops/rmsnorm_row.cuh).
inline constexpr int64_t kPushNormMaxCols = 8192;

// One rank's all-reduce call: buf (a.count bf16 elements, or f32 with `f32`) = the rank-ordered
// sum over the ranks' inputs, rounded once. The grid is a.count / a.chunk blocks (rounded
// up), the same on every rank. pdl: launched as a programmatic dependent (it waits in-kernel
// before touching memory). Asynchronous on `stream`, graph-safe. A block that waits for a
// peer past a.timeout_ticks, or sees the abort word set, ends without a result.
cudaError_t launch_peer_all_reduce(const PeerAllReduceArgs& a, bool f32, cudaStream_t stream, bool pdl);

// One rank's pushed call: sum = the rank-ordered fp32 sum of a.partial and the peers'
// partials as they arrive in a.inbox (each element reset to kPushEmpty once read), rounded
// once; then x = bf16(x + sum) and out = rmsnorm(x) * w. One block per row (up to 65535
// blocks), cols a multiple of 8 up to kPushNormMaxCols. Asynchronous on `stream`, graph-safe.
cudaError_t launch_push_add_rmsnorm(const PeerPushNormArgs& a, cudaStream_t stream, bool pdl);

// Loads the kernels above on the current device now (the runtime otherwise loads a kernel at
// its first launch, which may wait for the device's running kernels: a peer's kernel waiting
// for this rank's call among them), and gives how many blocks of an all-reduce call a
// multiprocessor holds at once (the smaller of its bf16 and f32 instances; the pushed norm's
// are not counted: one per row, not a grid of kPeerMaxBlocks).
cudaError_t load_peer_all_reduce(int* blocks_per_sm);

}  // namespace kvfuse::gpu
