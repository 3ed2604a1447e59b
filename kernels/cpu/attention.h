// CPU reference of paged attention over a mixed batch of prefill chunks and decode
// tokens: GQA, causal, optional sliding window (Hugging Face convention: a query at
// position p sees keys p-W+1 .. p), FP8 keys and values dequantised with the layer's
// scales (x = float(stored) * scale). fp32 arithmetic throughout; the output is
// rounded to bf16 once.
#pragma once

#include "kernels/kv_types.h"

namespace kvfuse::cpu {

// `unified`: one pass per (sequence, KV head) over key tiles with an online softmax,
// all query heads of the KV head handled together.
void attention_unified(const AttnArgs& args);

// `split`: decode rows (query length 1) use split-KV: the context is cut into
// partitions of `partition_size` keys, each yields (max, sum, partial output), merged
// by log-sum-exp. Prefill rows (query length > 1) use a plain two-pass softmax.
void attention_split(const AttnArgs& args, int32_t partition_size = 256);

}  // namespace kvfuse::cpu
