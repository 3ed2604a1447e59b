// Paged attention on the GPU (CUDA and HIP from one source) over a mixed batch of
// prefill chunks and decode tokens, with the CPU reference's contract
// (kernels/cpu/attention.h, kernels/kv_types.h AttnArgs): GQA, causal, optional sliding
// window (keys p-W+1 .. p), FP8 dequantised as float(stored) * scale, fp32 softmax and
// accumulation, the output rounded to bf16 once.
//
// - unified: one launch; a block per (query token, KV head) holds all query heads of
//   the KV head, its warps share the visible keys with an online softmax each, and the
//   warps' states merge at the end.
// - split: the same blocks cut each row's visible keys into partitions of
//   `partition_size` keys (split-KV), each writing (max, sum, partial output) to
//   scratch; a second kernel merges the partitions by log-sum-exp.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/gpu.h"
#include "kernels/kv_types.h"

namespace kvfuse::gpu {

constexpr int kAttnMaxGroup = 8;  // query heads per KV head

// Empty if the kernels support `args`, else a message naming the whole tuple.
std::string attention_unsupported(const AttnArgs& args);

cudaError_t launch_attention_unified(const AttnArgs& args, cudaStream_t stream);

// Scratch bytes of the split path for `num_tokens` rows up to `max_context_len` keys.
size_t attention_split_scratch_bytes(int64_t num_tokens, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_context_len, int32_t partition_size);
cudaError_t launch_attention_split(const AttnArgs& args, void* scratch, int32_t partition_size,
                                   cudaStream_t stream);

}  // namespace kvfuse::gpu
