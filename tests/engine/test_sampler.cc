// Sampling: greedy ties, top-k/top-p/min-p truncation, the distribution, determinism;
// the logit processors against their plain definition, alone and through the engine.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <random>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/cpu/ops/sampling.h"
#include "src/runtime/logit_processors.h"
#include "src/runtime/sampler.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/forwarding_backend.h"
#include "tests/util/reference_processors.h"

using namespace kvfuse;

TEST_CASE("sampler: greedy takes the largest logit, ties to the lowest id", "[sampler]") {
  std::vector<float> lg = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  Rng rng(1);
  CHECK(sample_token(lg.data(), 5, SamplingParams{}, rng) == 1);
  SamplingParams k1 = SamplingParams::sampled(1.0f, 1, 1.0f, 7);
  CHECK(sample_token(lg.data(), 5, k1, rng) == 1);  // top_k = 1 is greedy
  SamplingParams p_small = SamplingParams::sampled(1.0f, 0, 1e-6f, 7);
  CHECK(sample_token(lg.data(), 5, p_small, rng) == 1);  // a tiny nucleus is greedy
}

TEST_CASE("sampler: temperature sampling follows softmax(logits / T)", "[sampler]") {
  const std::vector<float> lg = {1.0f, 0.0f, 2.0f, -1.0f};
  const float T = 0.7f;
  std::vector<double> p(4);
  double z = 0;
  for (size_t i = 0; i < 4; ++i) z += p[i] = std::exp(lg[i] / T);
  Rng rng(42);
  SamplingParams sp = SamplingParams::sampled(T, 0, 1.0f, 0);
  const int n = 40000;
  std::vector<int> hits(4);
  for (int i = 0; i < n; ++i) ++hits[size_t(sample_token(lg.data(), 4, sp, rng))];
  for (size_t i = 0; i < 4; ++i) {
    const double expect = p[i] / z;
    const double sigma = std::sqrt(expect * (1 - expect) / n);
    CAPTURE(i, expect, hits[i]);
    CHECK(std::fabs(double(hits[i]) / n - expect) < 5 * sigma);  // 5 sigma: flaky once in ~10^6
  }
}

TEST_CASE("sampler: top-k and top-p never return excluded tokens", "[sampler]") {
  const std::vector<float> lg = {3.0f, 2.5f, 2.0f, 0.0f, -1.0f, 1.0f};
  Rng rng(3);
  SamplingParams k2 = SamplingParams::sampled(1.0f, 2, 1.0f, 0);
  for (int i = 0; i < 2000; ++i) {
    const int t = sample_token(lg.data(), 6, k2, rng);
    CHECK((t == 0 || t == 1));
  }
  // softmax(3, 2.5, 2, ...) puts ~0.44 on token 0 and ~0.27 on token 1: top_p 0.6 keeps both.
  SamplingParams p6 = SamplingParams::sampled(1.0f, 0, 0.6f, 0);
  for (int i = 0; i < 2000; ++i) {
    const int t = sample_token(lg.data(), 6, p6, rng);
    CHECK((t == 0 || t == 1));
  }
}

TEST_CASE("sampler: the same seed gives the same stream, and parameters are validated", "[sampler]") {
  Rng a(99), b(99), c(100);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.next();
    CHECK(x == b.next());
    differs |= x != c.next();
  }
  CHECK(differs);
  CHECK(validate_sampling(SamplingParams::sampled(0.0f, 0, 1.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(-0.1f, 0, 1.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(NAN, 0, 1.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(1.0f, 11, 1.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(1.0f, -1, 1.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(1.0f, 0, 0.0f, 0), 10).ok());
  CHECK_FALSE(validate_sampling(SamplingParams::sampled(1.0f, 0, 1.5f, 0), 10).ok());
}

namespace {

// The rule of kernels/ops/sampling.h written the obvious way: sort by (logit desc, id asc),
// take the top-k prefix, then the shortest prefix reaching ceil(p x weight), then walk
// the kept tokens in id order.
int32_t brute_force_sample(const std::vector<float>& lg, const RowSampling& p) {
  const int64_t v = int64_t(lg.size());
  std::vector<int64_t> order(lg.size());
  for (int64_t i = 0; i < v; ++i) order[size_t(i)] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lg[size_t(a)] > lg[size_t(b)] || (lg[size_t(a)] == lg[size_t(b)] && a < b);
  });
  if (p.temperature == 0.0f) return int32_t(order[0]);
  const float mx = lg[size_t(order[0])];
  const double inv_t = 1.0 / double(p.temperature);
  size_t keep = (p.top_k > 0 && p.top_k < v) ? size_t(p.top_k) : size_t(v);
  uint64_t total = 0;
  for (size_t j = 0; j < keep; ++j) total += sampling_weight(lg[size_t(order[j])], mx, inv_t);
  if (p.top_p < 1.0f) {
    const uint64_t target = sampling_top_p_target(p.top_p, total);
    uint64_t acc = 0;
    for (size_t j = 0; j < keep; ++j) {
      acc += sampling_weight(lg[size_t(order[j])], mx, inv_t);
      if (acc >= target) {
        keep = j + 1;
        break;
      }
    }
  }
  // min-p: of those, the tokens at least min_p times as heavy as the maximum (2^40).
  std::vector<bool> kept(lg.size(), false);
  uint64_t k_total = 0;
  for (size_t j = 0; j < keep; ++j) {
    const uint64_t w = sampling_weight(lg[size_t(order[j])], mx, inv_t);
    if (double(w) < double(p.min_p) * 1099511627776.0) continue;
    kept[size_t(order[j])] = true;
    k_total += w;
  }
  const uint64_t s = sampling_draw(p.u, k_total);
  uint64_t acc = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (!kept[size_t(i)]) continue;
    acc += sampling_weight(lg[size_t(i)], mx, inv_t);
    if (acc > s) return int32_t(i);
  }
  return -1;
}

}  // namespace

TEST_CASE("sampler: the radix-select sampler equals a sort-based reference of the same rule - min-p too",
          "[sampler]") {
  // Random rows, rows with many exact ties (logits on a coarse grid, so top-k and top-p
  // boundaries fall inside runs of equal logits), every parameter mix, many draws.
  std::mt19937 gen(11);
  int checked = 0;
  for (int64_t vocab : {int64_t(1), int64_t(7), int64_t(300), int64_t(5000)}) {
    for (int coarse = 0; coarse < 2; ++coarse) {
      std::vector<float> lg(static_cast<size_t>(vocab));
      std::normal_distribution<float> dist(0.0f, 2.0f);
      for (auto& x : lg) x = coarse ? std::round(dist(gen)) : dist(gen);
      for (float t : {0.0f, 0.3f, 1.0f, 2.5f}) {
        for (int32_t k : {0, 1, 2, 5, 64}) {
          for (float tp : {1.0f, 0.9f, 0.5f, 1e-6f}) {
            for (int d = 0; d < 8; ++d) {
              RowSampling p;
              p.temperature = t;
              p.top_k = k;
              p.top_p = tp;
              p.min_p = d % 4 == 0 ? 0.0f : (d % 4 == 1 ? 0.01f : (d % 4 == 2 ? 0.2f : 1.0f));
              p.u = std::uniform_real_distribution<double>(0.0, 1.0)(gen);
              CAPTURE(vocab, coarse, t, k, tp, p.min_p, p.u);
              REQUIRE(cpu::sample_row(lg.data(), vocab, p) == brute_force_sample(lg, p));
              ++checked;
            }
          }
        }
      }
    }
  }
  CHECK(checked == 4 * 2 * 4 * 5 * 4 * 8);
}

TEST_CASE("sampler: logprobs are the log-softmax of the raw logits - top-n is the sorted head",
          "[sampler][logprobs]") {
  std::mt19937 gen(3);
  for (int64_t vocab : {int64_t(1), int64_t(4), int64_t(999), int64_t(50000)}) {
    for (int coarse = 0; coarse < 2; ++coarse) {
      std::normal_distribution<float> dist(0.0f, 4.0f);
      std::vector<float> lg(static_cast<size_t>(vocab));
      for (auto& x : lg) x = coarse ? std::round(dist(gen)) : dist(gen);
      if (vocab > 3) lg[2] = -INFINITY;
      // Reference: long double log-sum-exp and a full sort by (logit desc, id asc).
      long double mx = -INFINITY, z = 0;
      for (float x : lg) mx = std::max<long double>(mx, x);
      for (float x : lg) z += std::exp((long double)x - mx);
      const long double lse = mx + std::log(z);
      std::vector<int32_t> order(static_cast<size_t>(vocab));
      for (int32_t i = 0; i < int32_t(vocab); ++i) order[size_t(i)] = i;
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return lg[size_t(a)] > lg[size_t(b)]; });
      for (int32_t top_n : {0, 1, 7, kMaxTopLogprobs}) {
        const int32_t target = int32_t(gen() % uint32_t(vocab));
        LogprobOut out;
        cpu::logprobs_row(lg.data(), vocab, target, top_n, out);
        CAPTURE(vocab, coarse, top_n, target);
        CHECK(out.token == target);
        if (std::isinf(lg[size_t(target)])) {
          CHECK(out.logprob == -INFINITY);
        } else {
          CHECK(std::abs(double(out.logprob) - double((long double)lg[size_t(target)] - lse)) <= 1e-5);
        }
        REQUIRE(out.top_n == std::min<int64_t>(top_n, vocab));
        for (int32_t j = 0; j < out.top_n; ++j) {
          CHECK(out.top_ids[j] == order[size_t(j)]);
          CHECK(out.top_logprobs[j] <= 0.0f);
          if (j > 0) CHECK(out.top_logprobs[j] <= out.top_logprobs[j - 1]);
        }
      }
    }
  }
  // The probabilities sum to one.
  std::vector<float> lg = {0.5f, -2.0f, 3.0f, 3.0f, 1.0f};
  double total = 0;
  for (int32_t t = 0; t < 5; ++t) {
    LogprobOut out;
    cpu::logprobs_row(lg.data(), 5, t, 5, out);
    total += std::exp(double(out.logprob));
    CHECK(out.top_ids[0] == 2);  // the tie of 3.0 goes to the lower id
    CHECK(out.top_ids[1] == 3);
  }
  CHECK(std::abs(total - 1.0) < 1e-6);
}

TEST_CASE("sampler: logprobs of logits near +-1000 are finite and exact - the maximum is taken out first",
          "[sampler][logprobs]") {
  // exp(1000) overflows even a double (and exp(-1000) underflows to 0), so a log-softmax
  // that sums the exponentials of the raw logits gives -inf (or +inf) here; the logits
  // drawn from N(0, 4) of the test above never get near. Shifting a row leaves its
  // log-softmax unchanged: 1000 - logsumexp(1000, 999, 998) = -log(1 + e^-1 + e^-2).
  constexpr double kTop = -0.407606;
  for (float shift : {1000.0f, -998.0f}) {
    CAPTURE(shift);
    const std::vector<float> lg = {shift, shift - 1, shift - 2};
    LogprobOut out;
    cpu::logprobs_row(lg.data(), 3, 0, 2, out);
    CHECK(out.token == 0);
    CHECK(std::isfinite(out.logprob));
    CHECK(double(out.logprob) == Approx(kTop).margin(1e-5));
    REQUIRE(out.top_n == 2);
    CHECK(out.top_ids[0] == 0);
    CHECK(out.top_ids[1] == 1);
    CHECK(double(out.top_logprobs[0]) == Approx(kTop).margin(1e-5));
    CHECK(double(out.top_logprobs[1]) == Approx(kTop - 1).margin(1e-5));
    cpu::logprobs_row(lg.data(), 3, 2, 0, out);
    CHECK(double(out.logprob) == Approx(kTop - 2).margin(1e-5));
  }
  // Whole rows around +1000, around -1000, and half of each, against a long double
  // reference on the same float logits (within 1e-5 relative: a logprob near -2000 is
  // a float of ulp 1.2e-4).
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  const int64_t vocab = 4099;
  const auto close = [](float got, long double want) {
    return std::abs(double(got) - double(want)) <= 1e-5 * std::max(1.0, std::abs(double(want)));
  };
  for (int kind = 0; kind < 3; ++kind) {
    CAPTURE(kind);
    std::vector<float> lg(static_cast<size_t>(vocab));
    for (size_t i = 0; i < lg.size(); ++i) {
      const float centre = kind == 0 ? 1000.0f : kind == 1 ? -1000.0f : i % 2 ? 1000.0f : -1000.0f;
      lg[i] = centre + dist(gen);
    }
    long double mx = -INFINITY, z = 0;
    for (float x : lg) mx = std::max<long double>(mx, x);
    for (float x : lg) z += std::exp((long double)x - mx);
    const long double lse = mx + std::log(z);
    for (int32_t target : {0, 1, 17, int32_t(vocab) - 1}) {
      CAPTURE(target);
      LogprobOut out;
      cpu::logprobs_row(lg.data(), vocab, target, kMaxTopLogprobs, out);
      REQUIRE(std::isfinite(out.logprob));
      CHECK(close(out.logprob, (long double)lg[size_t(target)] - lse));
      REQUIRE(out.top_n == kMaxTopLogprobs);
      for (int32_t j = 0; j < out.top_n; ++j) {
        CAPTURE(j, out.top_ids[j], out.top_logprobs[j]);
        CHECK(close(out.top_logprobs[j], (long double)lg[size_t(out.top_ids[j])] - lse));
      }
    }
  }
}

TEST_CASE("sampler: min-p keeps the tokens at least min_p times as likely as the most likely one",
          "[sampler]") {
  // Probabilities 0.4, 0.2, 0.15, 0.1, 0.1, 0.05 at T = 1; min_p 0.3 keeps p >= 0.12:
  // tokens 0, 1 and 2, drawn in proportion 0.4 : 0.2 : 0.15 by evenly spaced draws.
  const std::vector<double> prob{0.4, 0.2, 0.15, 0.1, 0.1, 0.05};
  std::vector<float> lg;
  for (double q : prob) lg.push_back(float(std::log(q)));
  RowSampling p;
  p.temperature = 1.0f;
  p.min_p = 0.3f;
  std::vector<int> hits(prob.size(), 0);
  const int n = 3000;
  for (int i = 0; i < n; ++i) {
    p.u = (double(i) + 0.5) / n;
    ++hits[size_t(cpu::sample_row(lg.data(), int64_t(lg.size()), p))];
  }
  CHECK(hits[3] + hits[4] + hits[5] == 0);
  for (size_t t = 0; t < 3; ++t) CHECK(std::abs(double(hits[t]) / n - prob[t] / 0.75) < 0.002);
  // min_p 1 keeps the most likely token only; 0 keeps all.
  p.min_p = 1.0f;
  for (double u : {0.0, 0.5, 0.999}) {
    p.u = u;
    CHECK(cpu::sample_row(lg.data(), int64_t(lg.size()), p) == 0);
  }
  p.min_p = 0.0f;
  p.u = 0.999;
  CHECK(cpu::sample_row(lg.data(), int64_t(lg.size()), p) == 5);
}

TEST_CASE("sampler: the logit processors' entries give the plain definition's logits, and restore the raw ones",
          "[sampler]") {
  std::mt19937 gen(3);
  const int32_t vocab = 64;
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  int checked = 0;
  for (int c = 0; c < 64; ++c) {
    SamplingParams sp;
    if (c % 2) sp.repetition_penalty = c % 4 == 1 ? 1.4f : 0.8f;
    if (c % 3) sp.frequency_penalty = c % 3 == 1 ? 0.5f : -0.7f;
    if (c % 5) sp.presence_penalty = c % 5 < 3 ? 1.5f : -2.0f;
    if (c % 7) {
      for (int32_t t = c % 7; t < vocab; t += 9) sp.logit_bias.emplace_back(t, float(t % 11) * 9.0f - 50.0f);
    }
    REQUIRE(validate_sampling(sp, vocab).ok());
    std::vector<int32_t> prompt(static_cast<size_t>(5 + c % 13)), output;
    for (auto& t : prompt) t = tok(gen);
    LogitProcessors proc(sp, prompt);
    CHECK(proc.active() == sp.has_processors());
    for (int step = 0; step < 12; ++step) {
      if (step == 6) {  // a router's appended tokens count as prompt
        const std::vector<int32_t> more{tok(gen), tok(gen)};
        prompt.insert(prompt.end(), more.begin(), more.end());
        proc.add_prompt_tokens(more.data(), more.size());
      }
      std::vector<float> raw(static_cast<size_t>(vocab));
      for (auto& x : raw) x = dist(gen);
      const std::vector<float> want = testing::reference_processed(raw.data(), vocab, sp, prompt, output);
      std::vector<float> lg = raw;
      std::vector<LogitAdjust> entries = proc.entries();
      const int32_t start[2] = {0, int32_t(entries.size())};
      cpu::adjust_rows(lg.data(), 1, vocab, start, entries.data(), false);
      for (int32_t i = 0; i < vocab; ++i) {
        CAPTURE(c, step, i);
        REQUIRE(lg[size_t(i)] == want[size_t(i)]);
      }
      cpu::adjust_rows(lg.data(), 1, vocab, start, entries.data(), true);
      REQUIRE(std::memcmp(lg.data(), raw.data(), raw.size() * 4) == 0);
      const int32_t t = tok(gen);
      output.push_back(t);
      proc.add_output_token(t);
      ++checked;
    }
  }
  CHECK(checked == 64 * 12);
  // Unset, there is nothing to apply.
  const LogitProcessors none(SamplingParams{}, {1, 2, 3});
  CHECK_FALSE(none.active());
  CHECK(none.entries().empty());
}

TEST_CASE("sampler: bad min_p, penalties and logit_bias are refused naming the field", "[sampler]") {
  const auto msg = [](auto edit) {
    SamplingParams sp;
    edit(sp);
    const absl::Status st = validate_sampling(sp, 100);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    return std::string(st.message());
  };
  using S = SamplingParams;
  CHECK_THAT(msg([](S& s) { s.min_p = 1.5f; }), Catch::Matchers::ContainsSubstring("min_p"));
  CHECK_THAT(msg([](S& s) { s.min_p = NAN; }), Catch::Matchers::ContainsSubstring("min_p"));
  CHECK_THAT(msg([](S& s) { s.repetition_penalty = 0.0f; }), Catch::Matchers::ContainsSubstring("repetition_penalty"));
  CHECK_THAT(msg([](S& s) { s.repetition_penalty = 2.5f; }), Catch::Matchers::ContainsSubstring("repetition_penalty"));
  CHECK_THAT(msg([](S& s) { s.frequency_penalty = -2.5f; }), Catch::Matchers::ContainsSubstring("frequency_penalty"));
  CHECK_THAT(msg([](S& s) { s.presence_penalty = INFINITY; }), Catch::Matchers::ContainsSubstring("presence_penalty"));
  CHECK_THAT(msg([](S& s) { s.logit_bias = {{100, 1.0f}}; }), Catch::Matchers::ContainsSubstring("logit_bias: token 100"));
  CHECK_THAT(msg([](S& s) { s.logit_bias = {{-1, 1.0f}}; }), Catch::Matchers::ContainsSubstring("logit_bias: token -1"));
  CHECK_THAT(msg([](S& s) { s.logit_bias = {{5, 101.0f}}; }), Catch::Matchers::ContainsSubstring("logit_bias"));
  CHECK_THAT(msg([](S& s) { s.logit_bias = {{5, 1.0f}, {5, 2.0f}}; }), Catch::Matchers::ContainsSubstring("given twice"));
  CHECK_THAT(msg([](S& s) { s.logit_bias.assign(size_t(kMaxLogitBias) + 1, {1, 0.0f}); }),
             Catch::Matchers::ContainsSubstring("exceed the limit"));
}

TEST_CASE("sampler: the engine applies the processors before greedy and sampled picks, logprobs stay raw",
          "[sampler][engine]") {
  auto e = testing::make_engine();
  const int32_t vocab = e->spec().vocab;
  for (const SamplingParams& sp : testing::processor_cases(vocab)) {
    CAPTURE(sp.temperature, sp.min_p, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty,
            sp.logit_bias.size());
    const auto [equal, n] = testing::sampled_tokens_match_reference(*e, sp, 24);
    CHECK(equal == n);
  }
  // A +100 bias on one token makes it every greedy pick; the logprobs stay the model's.
  SamplingParams sp;
  sp.logit_bias = {{7, 100.0f}};
  REQUIRE(e->add_sequence(5, testing::prompt_of(20, 2, vocab), sp).ok());
  int32_t pending = 20;
  for (int i = 0; i < 6; ++i) {
    StepItem it{5, pending, true, true};
    it.logprobs = true;
    auto r = e->step({it});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    CHECK(*(*r)[0].token == 7);
    const float* lg = e->last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab);
    LogprobOut raw;
    cpu::logprobs_row(lg, vocab, 7, 0, raw);
    REQUIRE((*r)[0].logprob.has_value());
    CHECK((*r)[0].logprob->logprob == raw.logprob);
    CHECK(raw.logprob < 0.0f);
    pending = 1;
  }
  REQUIRE(e->release(5).ok());
}

namespace {
// The CPU backend, counting the logit processors' launches.
class ProcessorCountingBackend final : public testing::ForwardingBackend {
 public:
  ProcessorCountingBackend() : ForwardingBackend(make_cpu_backend()) {}
  int applied = 0, restored = 0;
  absl::Status adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                           bool restore) override {
    ++(restore ? restored : applied);
    return inner().adjust_rows(logits, rows, vocab, start, entries, restore);
  }
};
}  // namespace

TEST_CASE("sampler: a step without logit processors runs none of their kernels - with them, one to apply, one to restore",
          "[sampler][engine]") {
  auto cfg = config_from_json(nlohmann::json::object());
  REQUIRE(cfg.ok());
  auto backend = std::make_unique<ProcessorCountingBackend>();
  ProcessorCountingBackend* b = backend.get();
  auto e = Engine::create(*cfg, std::move(backend));
  REQUIRE(e.ok());
  const int32_t vocab = (*e)->spec().vocab;
  // Sampled and greedy rows with top-k, top-p and min-p but no processor.
  SamplingParams plain = SamplingParams::sampled(0.8f, 10, 0.9f, 1);
  plain.min_p = 0.1f;
  REQUIRE((*e)->add_sequence(1, testing::prompt_of(12, 1, vocab), plain).ok());
  REQUIRE((*e)->add_sequence(2, testing::prompt_of(12, 2, vocab), SamplingParams{}).ok());
  REQUIRE((*e)->step({StepItem{1, 12, true}, StepItem{2, 12, true}}).ok());
  for (int i = 0; i < 3; ++i) REQUIRE((*e)->step({StepItem{1, 1, true}, StepItem{2, 1, true}}).ok());
  CHECK(b->applied == 0);
  CHECK(b->restored == 0);
  // One row with a processor: each step applies and restores once, for the whole batch.
  SamplingParams rep;
  rep.repetition_penalty = 1.2f;
  REQUIRE((*e)->add_sequence(3, testing::prompt_of(12, 3, vocab), rep).ok());
  REQUIRE((*e)->step({StepItem{3, 12, true}}).ok());
  for (int i = 0; i < 3; ++i) {
    REQUIRE((*e)->step({StepItem{1, 1, true}, StepItem{2, 1, true}, StepItem{3, 1, true}}).ok());
  }
  CHECK(b->applied == 4);
  CHECK(b->restored == 4);
}
