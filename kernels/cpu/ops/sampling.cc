#include "kernels/cpu/ops/sampling.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace kvfuse::cpu {
namespace {

// The largest key t with weight(key >= t among `in`) >= need, found a byte at a time
// from the top, as the GPU kernel does: `weight(i)` is 1 for counts, the fixed-point
// weight for mass.
template <class In, class W>
uint32_t radix_threshold(int64_t vocab, const uint32_t* keys, In in, W weight, uint64_t need) {
  uint32_t prefix = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    std::array<uint64_t, 256> hist{};
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int64_t i = 0; i < vocab; ++i) {
      if (!in(i) || (keys[i] & high_mask) != prefix) continue;
      hist[(keys[i] >> shift) & 0xffu] += weight(i);
    }
    uint64_t acc = 0;
    for (int d = 255; d >= 0; --d) {
      if (acc + hist[size_t(d)] >= need || d == 0) {
        need -= acc;
        prefix |= uint32_t(d) << shift;
        break;
      }
      acc += hist[size_t(d)];
    }
  }
  return prefix;
}

// The first index i (in id order) among `in` where the running weight reaches `need`.
template <class In, class W>
int64_t first_reaching(int64_t vocab, In in, W weight, uint64_t need) {
  uint64_t acc = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!in(i)) continue;
    acc += weight(i);
    if (acc >= need) return i;
  }
  return vocab - 1;
}

}  // namespace

int32_t sample_row(const float* lg, int64_t vocab, const RowSampling& p) {
  if (vocab <= 0) return 0;
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (lg[i] > lg[best]) best = i;
  }
  if (p.temperature == 0.0f) return int32_t(best);
  const float max_logit = lg[best];
  const double inv_t = 1.0 / double(p.temperature);
  std::vector<uint32_t> keys(static_cast<size_t>(vocab));
  std::vector<uint64_t> w(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    keys[size_t(i)] = sampling_key(lg[i]);
    w[size_t(i)] = sampling_weight(lg[i], max_logit, inv_t);
  }
  const uint32_t* k = keys.data();
  const auto all = [](int64_t) { return true; };
  const auto one = [](int64_t) { return uint64_t(1); };
  const auto mass = [&](int64_t i) { return w[size_t(i)]; };

  // top-k: keys above the k-th largest, then its ties by id.
  uint32_t tau_k = 0;
  int64_t cut_k = vocab;
  if (p.top_k > 0 && p.top_k < vocab) {
    tau_k = radix_threshold(vocab, k, all, one, uint64_t(p.top_k));
    uint64_t above = 0;
    for (int64_t i = 0; i < vocab; ++i) above += k[i] > tau_k ? 1 : 0;
    cut_k = first_reaching(vocab, [&](int64_t i) { return k[i] == tau_k; }, one, uint64_t(p.top_k) - above);
  }
  const auto in_k = [&](int64_t i) { return k[i] > tau_k || (k[i] == tau_k && i <= cut_k); };

  // top-p: the shortest (logit desc, id asc) prefix of the top-k set reaching the target.
  uint32_t tau_p = 0;
  int64_t cut_p = vocab;
  if (p.top_p < 1.0f) {
    uint64_t total = 0;
    for (int64_t i = 0; i < vocab; ++i) total += in_k(i) ? w[size_t(i)] : 0;
    const uint64_t target = sampling_top_p_target(p.top_p, total);
    tau_p = radix_threshold(vocab, k, in_k, mass, target);
    uint64_t above = 0;
    for (int64_t i = 0; i < vocab; ++i) above += (in_k(i) && k[i] > tau_p) ? w[size_t(i)] : 0;
    cut_p = first_reaching(vocab, [&](int64_t i) { return in_k(i) && k[i] == tau_p; }, mass, target - above);
  }
  const uint64_t min_w = sampling_min_p_floor(p.min_p);
  const auto kept = [&](int64_t i) {
    return in_k(i) && (k[i] > tau_p || (k[i] == tau_p && i <= cut_p)) && w[size_t(i)] >= min_w;
  };

  uint64_t total = 0;
  for (int64_t i = 0; i < vocab; ++i) total += kept(i) ? w[size_t(i)] : 0;
  const uint64_t s = sampling_draw(p.u, total);
  return int32_t(first_reaching(vocab, kept, mass, s + 1));
}

void adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                 bool restore) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t j = start[r]; j < start[r + 1]; ++j) {
      LogitAdjust& a = entries[j];
      float& l = logits[r * vocab + a.token];
      if (restore) {
        l = a.saved;
        continue;
      }
      a.saved = l;
      float x = l + a.bias;
      if (a.rep != 1.0f) x = x > 0.0f ? x / a.rep : x * a.rep;
      l = x - a.sub;
    }
  }
}

void logprobs_row(const float* logits, int64_t vocab, int32_t target, int32_t top_n, LogprobOut& out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, logits[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - double(m));
  const double lse = double(m) + std::log(sum);
  const auto lp = [&](int64_t i) { return float(double(logits[i]) - lse); };
  out.token = target;
  out.logprob = lp(target);
  // Selection of the top_n by insertion, in (key descending, id ascending) order.
  const int32_t n = int32_t(std::min<int64_t>(std::clamp(top_n, 0, kMaxTopLogprobs), vocab));
  int32_t have = 0;
  for (int64_t i = 0; n > 0 && i < vocab; ++i) {
    if (have == n && !logprob_ranks_before(logits[i], int32_t(i), logits[out.top_ids[n - 1]], out.top_ids[n - 1]))
      continue;
    int32_t at = have < n ? have++ : n - 1;
    while (at > 0 && logprob_ranks_before(logits[i], int32_t(i), logits[out.top_ids[at - 1]], out.top_ids[at - 1])) {
      out.top_ids[at] = out.top_ids[at - 1];
      --at;
    }
    out.top_ids[at] = int32_t(i);
  }
  out.top_n = n;
  for (int32_t j = 0; j < n; ++j) out.top_logprobs[j] = lp(out.top_ids[j]);
}

}  // namespace kvfuse::cpu
