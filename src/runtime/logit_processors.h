// A sequence's logit processors (SamplingParams: logit_bias and the repetition, frequency
// and presence penalties) as the entries the backends apply (kernels/ops/sampling.h):
// one per token the processors touch, kept up to date as the sequence grows, so that a
// step copies them instead of recounting the sequence's tokens.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kernels/ops/sampling.h"
#include "src/runtime/sampler.h"

namespace kvfuse {

class LogitProcessors {
 public:
  LogitProcessors() = default;
  // `p` validated (validate_sampling); `prompt`: the sequence's tokens so far.
  LogitProcessors(const SamplingParams& p, const std::vector<int32_t>& prompt);

  bool active() const { return active_; }
  // Tokens that are not output (a further prompt chunk, a token a router appends): the
  // repetition penalty counts them, the frequency and presence penalties do not.
  void add_prompt_tokens(const int32_t* tokens, size_t n);
  // A token the sequence generated.
  void add_output_token(int32_t token);
  // The entries, one per token, in no particular order.
  const std::vector<LogitAdjust>& entries() const { return entries_; }

 private:
  // The index of `token`'s entry, added if it has none.
  size_t entry(int32_t token);

  bool active_ = false;
  bool penalties_ = false;  // the output tokens count (a logit_bias alone needs no counts)
  float rep_ = 1.0f, freq_ = 0.0f, presence_ = 0.0f;
  std::vector<LogitAdjust> entries_;
  std::vector<int32_t> output_count_;       // per entry
  std::unordered_map<int32_t, size_t> at_;  // token -> its entry
};

}  // namespace kvfuse
