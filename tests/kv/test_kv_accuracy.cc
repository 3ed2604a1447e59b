// How much an FP8 KV cache costs in accuracy on the tiny model, against a bf16 cache.
#include <cmath>
#include <cstdio>
#include <functional>

#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

struct Agreement {
  double max_abs_err = 0;  // largest |logit(fp8) - logit(bf16)| over all positions and tokens
  double mean_abs_err = 0;
  double logit_std = 0;  // spread of the bf16 logits, the scale errors are judged against
  int positions = 0;
  int top1_agree = 0;       // teacher-forced: same argmax at the same position
  int free_run_prefix = 0;  // free-running greedy: tokens equal before the first divergence
  int free_run_total = 0;
};

Agreement measure(const char* dtype, int prompts, int tokens) {
  auto ref = make_engine({{"kv_cache_dtype", "bf16"}});
  auto fp8 = make_engine({{"kv_cache_dtype", dtype}});
  const int32_t vocab = ref->spec().vocab;
  Agreement a;
  double sum_err = 0, sum_sq = 0, sum = 0;
  int64_t count = 0;
  for (int p = 0; p < prompts; ++p) {
    const auto prompt = prompt_of(40 + 17 * p, 100 + p, vocab);
    const auto want = greedy(*ref, 1, prompt, tokens);
    const auto got = greedy(*fp8, 1, prompt, tokens);
    int prefix = 0;
    while (prefix < tokens && want[size_t(prefix)] == got[size_t(prefix)]) ++prefix;
    a.free_run_prefix += prefix;
    a.free_run_total += tokens;
    const auto lr = teacher_forced_logits(*ref, 2, prompt, want);
    const auto lf = teacher_forced_logits(*fp8, 2, prompt, want);
    for (size_t i = 0; i < lr.size(); ++i) {
      ++a.positions;
      a.top1_agree += argmax(lr[i].data(), vocab) == argmax(lf[i].data(), vocab);
      for (int32_t v = 0; v < vocab; ++v) {
        const double e = std::fabs(double(lf[i][size_t(v)]) - double(lr[i][size_t(v)]));
        a.max_abs_err = std::max(a.max_abs_err, e);
        sum_err += e;
        sum += lr[i][size_t(v)];
        sum_sq += double(lr[i][size_t(v)]) * lr[i][size_t(v)];
        ++count;
      }
    }
  }
  a.mean_abs_err = sum_err / double(count);
  a.logit_std = std::sqrt(sum_sq / double(count) - (sum / double(count)) * (sum / double(count)));
  std::printf(
      "kv accuracy %s vs bf16: %d positions, max |dlogit| %.4f, mean %.5f, logit std %.3f, teacher-forced "
      "top-1 "
      "%d/%d, free-running greedy prefix %d/%d\n",
      dtype, a.positions, a.max_abs_err, a.mean_abs_err, a.logit_std, a.top1_agree, a.positions,
      a.free_run_prefix, a.free_run_total);
  return a;
}

}  // namespace

// Thresholds. e4m3 keeps 3 mantissa bits: each stored K/V element carries a relative
// error of at most 2^-4 (half an ulp); e5m2 keeps 2 bits, twice that. Attention averages
// many such errors, so the logits move by a small fraction of their spread. Measured on
// this model (4 prompts x 96 tokens, logit std 3.0): e4m3 mean |dlogit| 0.025 (0.8% of
// the std), max 0.19 (6.5%), teacher-forced top-1 agreement 96.6%; e5m2 mean 0.038
// (1.3%), max 0.29 (9.5%), top-1 97.7%. The bounds leave about 2x headroom on the
// errors and are an order of magnitude below what a wrong scale or format produces
// (a scale applied twice, or FNUZ bytes read as OCP, moves logits by about their std).
// Free-running greedy agreement is printed, not asserted: this random-weights model has
// near-tied top-2 logits at many positions, so one flip makes the rest of the sequence
// differ without saying anything more about the cache.
// The bounds on one FP8 format's logits against bf16 KV, as fractions of the logit std.
static void check_agreement(const char* dtype, double mean_frac, double max_frac) {
  const Agreement a = measure(dtype, 4, 96);
  CHECK(a.mean_abs_err < mean_frac * a.logit_std);
  CHECK(a.max_abs_err < max_frac * a.logit_std);
  CHECK(a.top1_agree >= int(0.93 * a.positions));
}

TEST_CASE("kv accuracy fp8_e4m3 vs bf16 KV: logit error and greedy agreement over 96 tokens",
          "[engine][fp8]") {
  check_agreement("fp8_e4m3", 0.02, 0.15);
}

TEST_CASE("kv accuracy fp8_e5m2 vs bf16 KV: logit error and greedy agreement over 96 tokens",
          "[engine][fp8][e5m2]") {
  check_agreement("fp8_e5m2", 0.03, 0.2);
}
