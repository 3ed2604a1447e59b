// Split path, last launch: merges the partial results of a decode row's split-KV
// partitions (attention_split.cu) into its output row (merge_partitions,
// kernels/attention/attention_params.h).
#pragma once

#include "kernels/attention/attention_tile.cuh"

namespace kvfuse::gpu::attention_detail {

// A 32-lane group per (sequence, query head), D/32 dimensions per lane.
template <int D>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    attention_merge_kernel(AttnArgs a, const float* part_o, const float* part_ml, int32_t part_len,
                           int32_t num_parts) {
  grid_dependency_wait();
  launch_dependents();
  const int32_t head_blocks = (a.num_q_heads + kGroups - 1) / kGroups;
  const int32_t seq = int32_t(blockIdx.x) / head_blocks;
  const int32_t qh = (int32_t(blockIdx.x) % head_blocks) * kGroups + group_id();
  if (qh >= a.num_q_heads) return;
  constexpr int kPer = D / kMmaLanes;
  merge_partitions<D, kPer>(a, part_o, part_ml, part_len, num_parts, seq, qh, glane() * kPer);
}

}  // namespace kvfuse::gpu::attention_detail
