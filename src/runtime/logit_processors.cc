#include "src/runtime/logit_processors.h"

namespace kvfuse {

LogitProcessors::LogitProcessors(const SamplingParams& p, const std::vector<int32_t>& prompt)
    : active_(p.has_processors()),
      penalties_(p.has_penalties()),
      rep_(p.repetition_penalty),
      freq_(p.frequency_penalty),
      presence_(p.presence_penalty) {
  if (!active_) return;
  for (const auto& [token, bias] : p.logit_bias) entries_[entry(token)].bias = bias;
  add_prompt_tokens(prompt.data(), prompt.size());
}

size_t LogitProcessors::entry(int32_t token) {
  auto [it, fresh] = at_.try_emplace(token, entries_.size());
  if (fresh) {
    LogitAdjust a;
    a.token = token;
    entries_.push_back(a);
    output_count_.push_back(0);
  }
  return it->second;
}

void LogitProcessors::add_prompt_tokens(const int32_t* tokens, size_t n) {
  if (!active_ || rep_ == 1.0f) return;  // only the repetition penalty reads the prompt
  for (size_t i = 0; i < n; ++i) entries_[entry(tokens[i])].rep = rep_;
}

void LogitProcessors::add_output_token(int32_t token) {
  if (!penalties_) return;
  const size_t at = entry(token);
  LogitAdjust& a = entries_[at];
  a.rep = rep_;
  const int32_t count = ++output_count_[at];
  // frequency x count + presence, in float as every backend reads it.
  a.sub = freq_ * float(count) + presence_;
}

}  // namespace kvfuse
