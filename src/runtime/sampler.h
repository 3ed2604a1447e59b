// Token sampling: greedy, and seeded temperature / top-k / top-p. Deterministic: the
// same logits, parameters and seed give the same token on every machine (the RNG and
// the arithmetic are our own, not the standard library's distributions).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace kvfuse {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // (0, 1]
  uint64_t seed = 0;
};

absl::Status validate_sampling(const SamplingParams& p, int32_t vocab);

// xoshiro256** seeded through splitmix64.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next();
  double uniform();  // [0, 1), 53 bits

 private:
  uint64_t s_[4];
};

// Greedy ties go to the lowest token id; otherwise one draw of `rng` and the rule of
// kernels/ops/sampling.h (the GPU backend's kernel picks the same token for the same draw).
// NaN logits are the caller's to reject.
int32_t sample_token(const float* logits, int32_t vocab, const SamplingParams& p, Rng& rng);
int32_t argmax(const float* logits, int32_t vocab);

}  // namespace kvfuse
