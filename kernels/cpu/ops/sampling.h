// CPU reference of token sampling (kernels/ops/sampling.h describes the rule).
#pragma once

#include <cstdint>

#include "kernels/ops/sampling.h"

namespace kvfuse::cpu {

// The token row `logits[vocab]` samples under `p` (temperature 0: the first index of
// the maximum).
int32_t sample_row(const float* logits, int64_t vocab, const RowSampling& p);

// The logit processors of rows [0, rows) of logits[rows, vocab] (kernels/ops/sampling.h
// has the rule): row r's entries are entries[start[r] .. start[r + 1]). `restore` false
// applies them (keeping each raw logit in its entry's `saved`), true writes the raw
// logits back.
void adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                 bool restore);

}  // namespace kvfuse::cpu

namespace kvfuse::cpu {

// The log-softmax of row `logits[vocab]` at `target` (in [0, vocab)) and its `top_n`
// (0 .. kMaxTopLogprobs) most likely tokens (kernels/ops/sampling.h has the rule). The sum
// of exponentials is taken in double: the reference the GPU's fp32 sums are held to.
void logprobs_row(const float* logits, int64_t vocab, int32_t target, int32_t top_n, LogprobOut& out);

}  // namespace kvfuse::cpu
