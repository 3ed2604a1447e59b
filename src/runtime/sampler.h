// Token sampling: greedy, and seeded temperature / top-k / top-p / min-p, after the
// logit processors (logit bias, repetition, frequency and presence penalties).
// Deterministic: the same logits, parameters and seed give the same token on every
// machine (the RNG and the arithmetic are our own, not the standard library's
// distributions).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace kvfuse {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // (0, 1]
  uint64_t seed = 0;
  // Sampled rows keep only tokens whose probability is at least min_p times the most
  // likely token's (after temperature, top-k and top-p). [0, 1]; 0: off.
  float min_p = 0.0f;
  // The logit processors (kernels/ops/logit_adjust.h has the rule), applied to the
  // logits before the greedy pick and the sampler, in this order:
  //   logit_bias          added to its tokens' logits; each bias in [-100, 100]
  //   repetition_penalty  over the prompt's and the output's tokens: a positive logit is
  //                       divided by it, another multiplied (HF / vLLM); (0, 2]; 1: off
  //   frequency_penalty   times the token's count in the output, subtracted (OpenAI);
  //   presence_penalty    subtracted once from every token in the output (OpenAI);
  //                       each in [-2, 2]; 0: off
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, bias), distinct tokens
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;

  // Temperature sampling with top-k and top-p, no other processor.
  static SamplingParams sampled(float temperature, int32_t top_k, float top_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = seed;
    return p;
  }
  // Whether any logit processor is set (a row without one costs nothing).
  bool has_processors() const {
    return !logit_bias.empty() || repetition_penalty != 1.0f || frequency_penalty != 0.0f ||
           presence_penalty != 0.0f;
  }
  // Whether the processors need the sequence's token counts.
  bool has_penalties() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

// The most logit_bias entries one request may set.
inline constexpr int32_t kMaxLogitBias = 1024;

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
// NaN logits are the caller's to reject; `logits` are as the logit processors leave them
// (the engine applies them; sample_token does not).
int32_t sample_token(const float* logits, int32_t vocab, const SamplingParams& p, Rng& rng);
int32_t argmax(const float* logits, int32_t vocab);

}  // namespace kvfuse
