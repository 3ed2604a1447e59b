// The split-KV decode path (attention.cuh): partitions sized from the multiprocessor
// count, the decode blocks of the block kernel (kModeDecode) writing per-partition
// partial results, the prefill rows through the block kernel (kModePrefill), and the
// log-sum-exp merge (attention_merge.cuh).
#include "kernels/gpu.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>

#include "kernels/attention_merge.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/dispatch.cuh"

namespace kvfuse::gpu {
namespace {

using namespace attention_detail;

// Fixed cost of a decode block (Q, first loads, merge of its groups, partial output and
// its share of the merge kernel), in keys: fitted on the H200 (batch 64 x 4096, e4m3fn,
// partitions of 512..4096 keys took waves x (keys + 180) to within 1.2%;
// bench/results/attention_h200.txt).
constexpr int64_t kBlockOverheadKeys = 180;

int32_t device_sms(int32_t forced) {
  if (forced > 0) return forced;
  constexpr int kMaxDevices = 64;
  static std::atomic<int32_t> cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 132;
  int32_t n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    cudaDeviceProp prop{};
    n = cudaGetDeviceProperties(&prop, dev) == cudaSuccess && prop.multiProcessorCount > 0
            ? prop.multiProcessorCount
            : 132;
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int32_t split_parts(int32_t max_context_len, int32_t len) {
  return max_context_len <= len ? 1 : int32_t((int64_t(max_context_len) + len - 1) / len);
}

}  // namespace

int32_t attention_split_partition(const AttnArgs& a, int32_t partition_size, const AttnLaunch& l) {
  const int64_t min_len = round_up(std::max(partition_size, 1), kTileKeys);
  if (l.split_partition > 0) return int32_t(std::max(min_len, round_up(l.split_partition, kTileKeys)));
  // Blocks of one partition run as waves over the multiprocessors; a block costs its keys
  // plus a fixed overhead. Pick the partition count that minimises waves x (keys per
  // block + overhead): more partitions only pay while they fill idle multiprocessors.
  const int64_t max_ctx = std::max(a.batch.max_context_len, 1);
  const int64_t blocks_per_part = int64_t(std::max(a.batch.num_seqs, 1)) * std::max(a.cache.num_kv_heads, 1);
  const int64_t per_sm = a.cache.head_dim == 256 ? kBlocksPerSm<256> : kBlocksPerSm<128>;
  const int64_t slots = int64_t(device_sms(l.num_sms)) * per_sm;
  const int64_t max_parts =
      std::min<int64_t>((max_ctx + min_len - 1) / min_len, 4 * slots / blocks_per_part + 1);
  int64_t best_len = round_up(max_ctx, kTileKeys), best_cost = INT64_MAX;
  for (int64_t parts = 1; parts <= std::max<int64_t>(max_parts, 1); ++parts) {
    const int64_t len = std::max(min_len, round_up((max_ctx + parts - 1) / parts, kTileKeys));
    const int64_t real_parts = (max_ctx + len - 1) / len;
    const int64_t waves = (real_parts * blocks_per_part + slots - 1) / slots;
    const int64_t cost = waves * (std::min(len, max_ctx) + kBlockOverheadKeys);
    if (cost < best_cost) {
      best_cost = cost;
      best_len = len;
    }
  }
  return int32_t(std::min<int64_t>(best_len, INT32_MAX / 2));
}

size_t attention_split_scratch_bytes(int64_t num_tokens, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_context_len, int32_t partition_size) {
  // The launcher never uses fewer keys per partition than partition_size, so at most
  // this many partitions.
  const int32_t parts = split_parts(max_context_len, std::max(partition_size, 1));
  return size_t(num_tokens) * size_t(num_q_heads) * size_t(parts) * size_t(head_dim + 2) * sizeof(float);
}

LaunchStatus launch_attention_split(const AttnArgs& a, void* scratch, int32_t partition_size,
                                    cudaStream_t stream, const AttnLaunch& l) {
  if (std::string why = attention_unsupported(a); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (partition_size <= 0) {
    return LaunchStatus::refused("attention split: partition_size " + std::to_string(partition_size) +
                                 " must be positive");
  }
  if (a.batch.num_tokens <= 0 || a.batch.num_seqs <= 0) return cudaSuccess;
  const int32_t len = attention_split_partition(a, partition_size, l);
  const int32_t parts = split_parts(a.batch.max_context_len, len);
  if (parts > 1 && scratch == nullptr) {
    return LaunchStatus::refused("attention split: " + std::to_string(parts) + " partitions of " +
                                 std::to_string(len) + " keys need scratch (attention_split_scratch_bytes)");
  }
  Params p = base_params(a);
  p.mode = kModeDecode;
  // The partition count comes from the longest context; each sequence then spreads its
  // own keys over it (split_range), never fewer than partition_size per partition.
  p.part_len = int32_t(round_up(std::max(partition_size, 1), kTileKeys));
  p.num_parts = parts;
  p.part_o = static_cast<float*>(scratch);
  p.part_ml = p.part_o == nullptr
                  ? nullptr
                  : p.part_o + a.batch.num_tokens * a.num_q_heads * int64_t(parts) * a.cache.head_dim;
  const int64_t decode_blocks = int64_t(parts) * a.batch.num_seqs * a.cache.num_kv_heads;
  const bool any_prefill = a.batch.max_query_len != 1;
  KVFUSE_GPU_RETURN_IF_ERROR(launch_attention_blocks(p, decode_blocks, l, stream));
  if (any_prefill) {
    Params q = p;
    q.mode = kModePrefill;
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_attention_blocks(q, a.batch.num_tokens * a.cache.num_kv_heads, l, stream));
  }
  if (parts == 1) return cudaSuccess;
  const int64_t blocks = int64_t(a.batch.num_seqs) * ((a.num_q_heads + kGroups - 1) / kGroups);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_head_dim(a.cache.head_dim, [&](auto hd) {
    return launch_kernel(attention_merge_kernel<decltype(hd)::value>, unsigned(blocks), kThreads, stream,
                         l.pdl, a, static_cast<const float*>(p.part_o), static_cast<const float*>(p.part_ml),
                         p.part_len, parts);
  });
}

}  // namespace kvfuse::gpu
