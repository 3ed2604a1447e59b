// Split path, last launch: merges the partial results of a decode row's split-KV
// partitions (attention_split.cu) into its output row.
#pragma once

#include <cmath>

#include "kernels/attention_tile.cuh"

namespace kvfuse::gpu::attention_detail {

// Split path: merges a decode row's partitions, out = sum_p o_p 2^(m_p - M) / sum_p l_p
// 2^(m_p - M). A 32-lane group per (sequence, query head), D/32 dimensions per lane.
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
  const int32_t q0 = a.batch.query_start[seq];
  if (a.batch.query_start[seq + 1] - q0 != 1) return;
  const int32_t pos = a.batch.context_len[seq] - 1;
  const int32_t lo = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const SplitRange r = split_range(lo, pos, num_parts, part_len);
  const int32_t first = 0, last = r.last;
  if (last == 0) return;  // written by the decode kernel directly
  const int64_t base = (int64_t(q0) * a.num_q_heads + qh) * num_parts;
  float mx = -INFINITY;
  for (int32_t pp = first; pp <= last; ++pp) mx = fmaxf(mx, part_ml[2 * (base + pp)]);
  constexpr int kPer = D / kMmaLanes;
  float o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = 0.0f;
  float total = 0.0f;
  const int l = glane();
  for (int32_t pp = first; pp <= last; ++pp) {
    const float f = exp2f(part_ml[2 * (base + pp)] - mx);
    total += part_ml[2 * (base + pp) + 1] * f;
    const float* po = part_o + (base + pp) * D + l * kPer;
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] += po[i] * f;
  }
  bf16_t* out = a.out + int64_t(q0) * a.out_token_stride + int64_t(qh) * D + l * kPer;
#pragma unroll
  for (int i = 0; i < kPer; ++i) out[i] = f32_to_bf16(o[i] / total);
}

}  // namespace kvfuse::gpu::attention_detail
