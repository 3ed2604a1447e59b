// The logit processors written plainly from their definition (src/runtime/sampler.h)
// over a sequence's token lists: the reference the engine's incremental entries
// (src/runtime/logit_processors.h) and the backends' kernels are tested against.
#pragma once

#include <cstdint>
#include <vector>

#include "src/runtime/sampler.h"

namespace kvfuse::testing {

// `raw` [vocab] after logit_bias, then the repetition penalty over `prompt` and `output`,
// then the frequency and presence penalties over `output`.
inline std::vector<float> reference_processed(const float* raw, int32_t vocab, const SamplingParams& sp,
                                              const std::vector<int32_t>& prompt,
                                              const std::vector<int32_t>& output) {
  std::vector<float> l(raw, raw + vocab);
  for (const auto& [token, bias] : sp.logit_bias) l[size_t(token)] += bias;
  if (sp.repetition_penalty != 1.0f) {
    std::vector<bool> seen(size_t(vocab), false);
    for (int32_t t : prompt) seen[size_t(t)] = true;
    for (int32_t t : output) seen[size_t(t)] = true;
    for (int32_t i = 0; i < vocab; ++i) {
      if (!seen[size_t(i)]) continue;
      float& x = l[size_t(i)];
      x = x > 0.0f ? x / sp.repetition_penalty : x * sp.repetition_penalty;
    }
  }
  std::vector<int32_t> count(size_t(vocab), 0);
  for (int32_t t : output) ++count[size_t(t)];
  for (int32_t i = 0; i < vocab; ++i) {
    if (count[size_t(i)] == 0) continue;
    l[size_t(i)] -= sp.frequency_penalty * float(count[size_t(i)]) + sp.presence_penalty;
  }
  return l;
}

}  // namespace kvfuse::testing
