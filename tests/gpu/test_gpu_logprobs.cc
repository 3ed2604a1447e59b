// Logprobs on the GPU of rows whose logits lie near +1000 or -1000. A log-softmax must
// take the row's maximum out before the exponentials (exp(1000) overflows even a double,
// and exp(-1000) underflows to 0); the N(0, 3) rows of the logprobs parity test in
// test_gpu_backend.cc never come near. The GPU's logprobs_rows against the CPU reference
// (cpu::logprobs_row, through the CPU backend), compared as that test compares, and both
// against the exact value of the shifted three-token row. In a build without a GPU
// backend, or on a machine without a GPU, the test says so and passes.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>
#include "tests/util/catch.h"

#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"
#include "tests/util/gpu_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// Logit i of a row of the given kind (see the test), with `noise` drawn from N(0, 3).
float logit(int64_t kind, int64_t i, float noise) {
  if (kind == 0) return i < 3 ? 1000.0f - float(i) : -1000.0f;
  if (kind == 1) return i < 3 ? -998.0f - float(i) : -3000.0f;
  if (kind == 2) return 1000.0f + noise;
  if (kind == 3) return -1000.0f + noise;
  if (kind == 4) return (i % 2 ? 1000.0f : -1000.0f) + noise;
  return 1000.0f + std::round(noise);
}

}  // namespace

TEST_CASE("gpu backend: logprobs of logits near +-1000 are finite and match the CPU reference",
          "[gpu][sampling][logprobs]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // 1000 - logsumexp(1000, 999, 998) = -log(1 + e^-1 + e^-2); the same for any shift.
  constexpr double kTop = -0.407606;
  std::mt19937 gen(17);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  int64_t checked = 0;
  for (int64_t vocab : {int64_t(3), int64_t(1000), int64_t(32000), int64_t(128256)}) {
    // Row kinds (logit()): 0: 1000, 999, 998, then -1000s; 1: -998, -999, -1000, then
    // -3000s (the rest is e^-2000 below the head: the head's exact values hold for any
    // vocab); 2: 1000 + N(0, 3); 3: -1000 + N(0, 3); 4: alternately +-1000 + N(0, 3);
    // 5: 1000 + N(0, 3) rounded to integers (ties, to the lower id). Two rows of each.
    const int64_t kinds = 6, rows = 2 * kinds;
    std::vector<float> lg(static_cast<size_t>(rows * vocab));
    std::vector<LogprobRow> req(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t kind = r % kinds;
      float* row = lg.data() + r * vocab;
      for (int64_t i = 0; i < vocab; ++i) row[i] = logit(kind, i, dist(gen));
      req[size_t(r)].target = kind < 2 ? 0 : int32_t(gen() % uint32_t(vocab));
      req[size_t(r)].top_n = kind < 2 ? 2 : r < kinds ? 5 : kMaxTopLogprobs;
    }
    const std::vector<int32_t> unused(static_cast<size_t>(rows), 0);  // every row names its target
    const std::vector<RowSampling> params(static_cast<size_t>(rows));
    auto run = [&](Backend& b) {
      Mirror<float> in(b, lg);
      Mirror<LogprobRow> rq(b, req);
      Mirror<int32_t> gr(b, unused), sa(b, unused);
      Mirror<RowSampling> pr(b, params);
      Mirror<LogprobOut> out(b, size_t(rows));
      REQUIRE(b.logprobs_rows(in.ptr(), rows, vocab, rq.ptr(), gr.ptr(), sa.ptr(), pr.ptr(), out.ptr()).ok());
      return out.read(b);
    };
    const auto co = run(*cpu);
    const auto go = run(*gpu);
    // The GPU sums in fp32, the CPU in double: within 1e-4 as in the parity test, relative
    // here, since a logprob near -2000 (kind 4) is a float of ulp 1.2e-4.
    const auto close = [](float g, float c) {
      return std::abs(double(g) - double(c)) <= 1e-4 * std::max(1.0, std::abs(double(c)));
    };
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t kind = r % kinds;
      CAPTURE(vocab, r, kind);
      const LogprobOut &c = co[size_t(r)], &g = go[size_t(r)];
      CHECK(c.token == req[size_t(r)].target);
      CHECK(g.token == req[size_t(r)].target);
      REQUIRE(std::isfinite(c.logprob));
      REQUIRE(std::isfinite(g.logprob));
      CAPTURE(c.logprob, g.logprob);
      CHECK(close(g.logprob, c.logprob));
      REQUIRE(c.top_n == std::min<int64_t>(req[size_t(r)].top_n, vocab));
      REQUIRE(g.top_n == c.top_n);
      for (int32_t j = 0; j < c.top_n; ++j) {
        CAPTURE(j, c.top_logprobs[j], g.top_logprobs[j]);
        CHECK(g.top_ids[j] == c.top_ids[j]);
        CHECK(std::isfinite(g.top_logprobs[j]));
        CHECK(close(g.top_logprobs[j], c.top_logprobs[j]));
      }
      if (kind < 2) {
        // The head 1000, 999, 998 (or -998, -999, -1000): target 0 and the top 2 exactly.
        for (const LogprobOut* o : {&c, &g}) {
          CHECK(double(o->logprob) == Approx(kTop).margin(1e-5));
          CHECK(o->top_ids[0] == 0);
          CHECK(o->top_ids[1] == 1);
          CHECK(double(o->top_logprobs[0]) == Approx(kTop).margin(1e-5));
          CHECK(double(o->top_logprobs[1]) == Approx(kTop - 1).margin(1e-5));
        }
      }
      ++checked;
    }
  }
  CHECK(checked == 4 * 12);
}
