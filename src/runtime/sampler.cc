#include "src/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops/sampling.h"

namespace kvfuse {

absl::Status validate_sampling(const SamplingParams& p, int32_t vocab) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f || p.temperature > 100.0f) {
    return absl::InvalidArgumentError(absl::StrCat("temperature ", p.temperature, " must be in [0, 100]"));
  }
  if (p.top_k < 0 || p.top_k > vocab) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", p.top_k, " must be in [0, ", vocab, "]"));
  }
  if (!std::isfinite(p.top_p) || p.top_p <= 0.0f || p.top_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat("top_p ", p.top_p, " must be in (0, 1]"));
  }
  if (!std::isfinite(p.min_p) || p.min_p < 0.0f || p.min_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat("min_p ", p.min_p, " must be in [0, 1]"));
  }
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0.0f || p.repetition_penalty > 2.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty ", p.repetition_penalty, " must be in (0, 2]"));
  }
  for (auto [name, v] : {std::pair{"frequency_penalty", p.frequency_penalty},
                         std::pair{"presence_penalty", p.presence_penalty}}) {
    if (!std::isfinite(v) || v < -2.0f || v > 2.0f) {
      return absl::InvalidArgumentError(absl::StrCat(name, " ", v, " must be in [-2, 2]"));
    }
  }
  if (p.logit_bias.size() > size_t(kMaxLogitBias)) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias: ", p.logit_bias.size(), " entries exceed the limit of ", kMaxLogitBias));
  }
  std::vector<int32_t> ids;
  ids.reserve(p.logit_bias.size());
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0 || token >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token ", token, " is outside the vocabulary [0, ", vocab, ")"));
    }
    if (!std::isfinite(bias) || bias < -100.0f || bias > 100.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: the bias ", bias, " of token ", token, " must be in [-100, 100]"));
    }
    ids.push_back(token);
  }
  std::sort(ids.begin(), ids.end());
  if (auto d = std::adjacent_find(ids.begin(), ids.end()); d != ids.end()) {
    return absl::InvalidArgumentError(absl::StrCat("logit_bias: token ", *d, " is given twice"));
  }
  return absl::OkStatus();
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }

int32_t argmax(const float* logits, int32_t vocab) {
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

int32_t sample_token(const float* logits, int32_t vocab, const SamplingParams& p, Rng& rng) {
  if (p.temperature == 0.0f) return argmax(logits, vocab);
  RowSampling row;
  row.temperature = p.temperature;
  row.top_k = p.top_k;
  row.top_p = p.top_p;
  row.min_p = p.min_p;
  row.u = rng.uniform();
  return cpu::sample_row(logits, vocab, row);
}

}  // namespace kvfuse
