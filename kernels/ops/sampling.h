// Token sampling shared by the CPU reference (kernels/cpu/ops/sampling.cc) and the GPU kernel
// (kernels/ops/sampling.cu): the same candidate sets and the same fixed-point arithmetic, so
// that both pick the same token from the same logits and the same uniform draw.
//
// A row samples from softmax(logits / T) restricted to
//   top-k: the k largest logits (ties broken by the lower token id, as a sort by
//          (logit descending, id ascending) would), then
//   top-p: the shortest prefix of those, in the same order, whose probability reaches p;
//   min-p: of those, the tokens whose weight is at least min_p times the maximum's
//          (sampling_min_p_floor: the most likely token always stays);
// by inverse CDF over the kept tokens in token-id order: token = the first kept id whose
// cumulative weight exceeds u x (total kept weight). Weights are exp((l - max) / T),
// held as 40-bit fixed point (exact, order-independent integer sums: the GPU's
// parallel sums equal the CPU's sequential ones, and a seed reproduces its tokens).
// T = 0 is greedy (the first index of the maximum).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace kvfuse {

struct RowSampling {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0 or >= vocab: no limit
  float top_p = 1.0f;        // (0, 1]; 1: no limit
  float min_p = 0.0f;        // [0, 1]; 0: no limit
  double u = 0.0;            // the row's uniform draw in [0, 1)
};

// Order-preserving map of a float to an unsigned key (larger float, larger key).
KVFUSE_HD uint32_t sampling_key(float x) {
  const uint32_t b = f32_bits(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

constexpr double kSamplingWeightOne = 1099511627776.0;  // 2^40: the weight of the maximum

// exp((logit - max) / T) in 40-bit fixed point (inv_t = 1 / T in double); the maximum
// weighs exactly 2^40. Computed in double and truncated to 2^-40: the CPU's and the GPU's
// exp differ in the last bits of a double at most, which truncation removes except in
// the rare case that straddles a 2^-40 step (one unit in 2^40 of one weight).
KVFUSE_HD uint64_t sampling_weight(float logit, float max_logit, double inv_t) {
  const double w = exp((double(logit) - double(max_logit)) * inv_t);
  return uint64_t(w * kSamplingWeightOne);
}

// The least weight min-p keeps: min_p x 2^40, truncated (the maximum weighs 2^40).
KVFUSE_HD uint64_t sampling_min_p_floor(float min_p) { return uint64_t(double(min_p) * kSamplingWeightOne); }

// Weight of the top-p target: ceil(p x total), at least 1.
KVFUSE_HD uint64_t sampling_top_p_target(float top_p, uint64_t total) {
  const double t = ceil(double(top_p) * double(total));
  const uint64_t r = t < 1.0 ? 1 : uint64_t(t);
  return r > total ? total : r;
}

// The draw's position in the kept weight: floor(u x total), below total.
KVFUSE_HD uint64_t sampling_draw(double u, uint64_t total) {
  const uint64_t s = uint64_t(u * double(total));
  return s >= total ? total - 1 : s;
}

// ---- Logit processors ------------------------------------------------------------------
// Before the greedy pick and the sampler, a row's logit processors change the logits of
// a few tokens each, given as entries (src/runtime/logit_processors.h builds them), at
// most one per token of a row:
//   x = l + bias;  x = x > 0 ? x / rep : x * rep (rep != 1 only);  x = x - sub
// each operation rounded on its own (no multiply-add), so that every backend writes the
// same bits. `apply` keeps the raw logit in `saved`; `restore` writes it back after the
// tokens are chosen, so that logprobs and the logits a caller reads are the model's raw
// ones (kvfuse.v1's contract).
struct LogitAdjust {
  int32_t token = 0;
  float bias = 0.0f;
  float rep = 1.0f;
  float sub = 0.0f;    // frequency_penalty x count + presence_penalty
  float saved = 0.0f;  // written by apply
};

// ---- Logprobs ------------------------------------------------------------------------
// The log-probability of a token under the model's raw distribution: log-softmax of the
// row's logits over the full vocabulary, at temperature 1 and before top-k / top-p,
// whatever parameters chose the token:
//   logprob(t) = l_t - m - log(sum_i exp(l_i - m)),   m = max_i l_i.
// The top-n tokens of a row are its n largest logits, in the order of a sort by (logit
// descending, id ascending) on sampling_key, as top-k takes them.

constexpr int32_t kMaxTopLogprobs = 20;

// What one logits row asks for. top_n < 0: nothing (the row is skipped); top_n >= 0:
// the logprob of `target` and the top_n most likely tokens. target < 0: the row's chosen
// token (its sampled token when its RowSampling temperature is > 0, else its greedy one).
struct LogprobRow {
  int32_t target = -1;
  int32_t top_n = -1;
};

struct LogprobOut {
  int32_t token = 0;  // the target, resolved
  float logprob = 0.0f;
  int32_t top_n = 0;
  int32_t reserved = 0;
  int32_t top_ids[kMaxTopLogprobs] = {};
  float top_logprobs[kMaxTopLogprobs] = {};
};

// True if (a, ia) comes before (b, ib) in the top-n order.
KVFUSE_HD bool logprob_ranks_before(float a, int32_t ia, float b, int32_t ib) {
  const uint32_t ka = sampling_key(a), kb = sampling_key(b);
  return ka > kb || (ka == kb && ia < ib);
}

}  // namespace kvfuse
