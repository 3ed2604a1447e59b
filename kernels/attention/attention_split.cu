// The split-KV decode path (attention.cuh): partitions sized from the multiprocessor
// count, the decode blocks of the block kernel (kModeDecode) writing per-partition
// partial results, the prefill rows through the block kernel (kModePrefill), and the
// log-sum-exp merge (attention_merge.cuh).
#include "kernels/common/gpu.h"

#include <algorithm>
#include <climits>
#include <string>

#include "kernels/attention/attention_merge.cuh"
#include "kernels/attention/attention_tile.cuh"
#include "kernels/common/dispatch.cuh"

namespace kvfuse::gpu {
namespace {

using namespace attention_detail;

int32_t device_sms(int32_t forced) {
  if (forced > 0) return forced;
  return once_per_device<1>(0, 132, [] {
    int dev = 0;
    cudaDeviceProp prop{};
    return cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess &&
                   prop.multiProcessorCount > 0
               ? int32_t(prop.multiProcessorCount)
               : int32_t(132);
  });
}

}  // namespace

int32_t attention_split_partition(const AttnArgs& a, int32_t partition_size, const AttnLaunch& l) {
  return split_partition_keys(a, partition_size, l.split_partition,
                              int64_t(device_sms(l.num_sms)) *
                                  attention_blocks_per_sm(a.cache.head_dim, a.cache.format,
                                                          a.cache.page_size % kTileKeys == 0));
}

size_t attention_split_scratch_bytes(int64_t num_tokens, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_context_len, int32_t partition_size) {
  // The launcher never uses fewer keys per partition than partition_size, so at most
  // this many partitions.
  const int32_t parts = split_parts(max_context_len, std::max(partition_size, 1));
  return size_t(num_tokens) * size_t(num_q_heads) * size_t(parts) * size_t(head_dim + 2) * sizeof(float);
}

size_t attention_split_scratch_bytes(const AttnArgs& a, int32_t partition_size, const AttnLaunch& l) {
  if (a.batch.num_tokens <= 0 || a.batch.num_seqs <= 0 || partition_size <= 0) return 0;
  const int32_t parts = split_parts(a.batch.max_context_len, attention_split_partition(a, partition_size, l));
  if (parts <= 1) return 0;
  return size_t(a.batch.num_tokens) * size_t(a.num_q_heads) * size_t(parts) * size_t(a.cache.head_dim + 2) *
         sizeof(float);
}

int64_t attention_split_merge_counters(const AttnArgs& a) {
  return std::max<int64_t>(a.batch.num_tokens, 0) * std::max<int32_t>(a.cache.num_kv_heads, 0);
}

LaunchStatus launch_attention_split(const AttnArgs& a, void* scratch, int32_t partition_size,
                                    cudaStream_t stream, const AttnLaunch& l, int32_t* merge_counters,
                                    const KvWriteRopeArgs* rope) {
  if (std::string why = attention_unsupported(a); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (partition_size <= 0) {
    return LaunchStatus::refused("attention split: partition_size " + std::to_string(partition_size) +
                                 " must be positive");
  }
  if (rope != nullptr) {
    if (std::string why = attention_rope_unsupported(a, *rope, l); !why.empty()) {
      return LaunchStatus::refused(std::move(why));
    }
  }
  if (a.batch.num_tokens <= 0 || a.batch.num_seqs <= 0) return cudaSuccess;
  const int32_t len = attention_split_partition(a, partition_size, l);
  const int32_t parts = split_parts(a.batch.max_context_len, len);
  if (parts > 1 && scratch == nullptr) {
    return LaunchStatus::refused("attention split: " + std::to_string(parts) + " partitions of " +
                                 std::to_string(len) + " keys need scratch (attention_split_scratch_bytes)");
  }
  Params p = split_decode_params(a, partition_size, parts, static_cast<float*>(scratch));
  // The tile kernel's decode blocks merge the partitions themselves (the last block of a
  // row and KV head to finish); the CDNA kernel's leave it to the merge kernel.
  const bool merge_in_blocks = parts > 1 && kWarpSize == 32 && merge_counters != nullptr;
  if (merge_in_blocks) p.part_done = merge_counters;
  take_rope(rope, p);
  const int64_t decode_blocks = int64_t(parts) * a.batch.num_seqs * a.cache.num_kv_heads;
  const bool any_prefill = a.batch.max_query_len != 1;
  KVFUSE_GPU_RETURN_IF_ERROR(launch_attention_blocks(p, decode_blocks, l, stream));
  if (any_prefill) {
    Params q = p;
    q.mode = kModePrefill;
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_attention_blocks(q, a.batch.num_tokens * a.cache.num_kv_heads, l, stream));
  }
  if (parts == 1 || merge_in_blocks) return cudaSuccess;
  const int64_t blocks = int64_t(a.batch.num_seqs) * ((a.num_q_heads + kGroups - 1) / kGroups);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_head_dim(a.cache.head_dim, [&](auto hd) {
    return launch_kernel(attention_merge_kernel<decltype(hd)::value>, unsigned(blocks), kThreads, stream,
                         l.pdl, a, static_cast<const float*>(p.part_o), static_cast<const float*>(p.part_ml),
                         p.part_len, parts);
  });
}

}  // namespace kvfuse::gpu
