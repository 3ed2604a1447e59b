// CPU reference of token sampling (kernels/sampling.h describes the rule).
#pragma once

#include <cstdint>

#include "kernels/sampling.h"

namespace kvfuse::cpu {

// The token row `logits[vocab]` samples under `p` (temperature 0: the first index of
// the maximum).
int32_t sample_row(const float* logits, int64_t vocab, const RowSampling& p);

}  // namespace kvfuse::cpu
