// CPU reference of paged attention over a mixed batch of prefill chunks and decode
// tokens: GQA, causal, optional sliding window (Hugging Face convention: a query at
// position p sees keys p-W+1 .. p), FP8 keys and values dequantised with the layer's
// scales (x = float(stored) * scale). fp32 arithmetic throughout; the output is
// rounded to bf16 once.
//
// Batch-invariant: a query row's output depends only on its own query, position and
// keys, never on the other rows of its batch or chunk (key tiles and split partitions are
// aligned to absolute positions, and every row of a path takes the same arithmetic).
#pragma once

#include "kernels/common/kv_types.h"

namespace kvfuse::cpu {

// `unified`: one pass per (sequence, KV head) over key tiles of 32 positions with an
// online softmax, all query heads of the KV head handled together.
void attention_unified(const AttnArgs& args);

// `split`: split-KV for every row (a decode row, and each row of a prefill chunk alike):
// the row's keys are cut into partitions of `partition_size` positions, each yields
// (max, sum, partial output), merged by log-sum-exp.
void attention_split(const AttnArgs& args, int32_t partition_size = 256);

}  // namespace kvfuse::cpu
