// Sampling and logprobs on the GPU against the CPU backend: greedy argmax and the
// finiteness flag, the logit processors, seeded temperature/top-k/top-p/min-p sampling,
// and logprobs and top-n on
// N(0, 3) rows (below); first, logprobs of rows whose logits lie near +1000 or -1000. A
// log-softmax must take the row's maximum out before the exponentials (exp(1000)
// overflows even a double, and exp(-1000) underflows to 0), which N(0, 3) rows never come
// near: the GPU's logprobs_rows against the CPU reference (cpu::logprobs_row, through the
// CPU backend), compared as the parity test below compares, and both against the exact
// value of the shifted three-token row. In a build without a GPU backend, or on a machine
// without a GPU, every test here says so and passes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

TEST_CASE("gpu backend: greedy argmax and the finiteness flag equal the CPU's on every row",
          "[gpu][sampling]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // Rows of random logits with planted cases: ties of the maximum (the lowest index
  // wins), the maximum in the first and last column, +inf, -inf, NaN (flagged not
  // finite), all equal, and vocabularies that are not multiples of the block size; 31 and
  // 4099 (not multiples of 4) start rows at every offset from a 16-byte boundary.
  for (int64_t vocab : {int64_t(1), int64_t(31), int64_t(1000), int64_t(4099), int64_t(128256)}) {
    CAPTURE(vocab);
    const int64_t rows = 12;
    std::mt19937 rng{uint32_t(vocab)};
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> lg(size_t(rows * vocab));
    for (auto& v : lg) v = dist(rng);
    auto row = [&](int64_t r) { return lg.data() + r * vocab; };
    const int64_t last = vocab - 1, mid = vocab / 2;
    row(0)[mid] = 50.0f;
    row(0)[last] = 50.0f;  // tie: mid wins (or 0 when vocab is 1)
    row(1)[0] = 60.0f;
    row(2)[last] = 60.0f;
    row(3)[mid] = INFINITY;
    row(4)[mid] = -INFINITY;
    row(5)[last] = NAN;
    std::fill(row(6), row(6) + vocab, 1.5f);  // all equal: token 0
    std::fill(row(7), row(7) + vocab, -INFINITY);
    for (int64_t c = 0; c < vocab; c += 3) row(8)[c] = 20.0f;  // many ties: token 0
    auto run = [&](Backend& b) {
      Mirror<float> in(b, lg);
      Mirror<int32_t> tok(b, size_t(rows)), fin(b, size_t(rows));
      REQUIRE(b.argmax_rows(in.ptr(), rows, vocab, tok.ptr(), fin.ptr()).ok());
      return std::make_pair(tok.read(b), fin.read(b));
    };
    const auto [ct, cf] = run(*cpu);
    const auto [gt, gf] = run(*gpu);
    CHECK(cf == gf);
    for (int64_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      if (cf[size_t(r)]) CHECK(ct[size_t(r)] == gt[size_t(r)]);  // a flagged row's token is not used
    }
    CHECK(cf[3] == 0);
    CHECK(cf[5] == 0);
    CHECK(cf[7] == 0);
    CHECK(cf[0] == 1);
    if (vocab > 2) CHECK(gt[0] == int32_t(mid));
    CHECK(gt[1] == 0);
    CHECK(gt[2] == int32_t(last));
    CHECK(gt[6] == 0);
    CHECK(gt[8] == 0);
  }
}

TEST_CASE("gpu backend: seeded temperature, top-k, top-p and min-p sampling picks the CPU's tokens",
          "[gpu][sampling]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // Both run the rule of kernels/ops/sampling.h with integer (fixed-point) sums, so they
  // agree exactly unless the two exp implementations straddle a 2^-40 step of a weight
  // and that moves a boundary: expected never in this many rows; >= 99% is asserted and
  // the count printed. Greedy rows are left unwritten by both.
  std::mt19937 gen(5);
  int64_t rows_total = 0, equal = 0;
  for (int64_t vocab : {int64_t(3), int64_t(1000), int64_t(4099), int64_t(32000), int64_t(128256)}) {
    for (int coarse = 0; coarse < 2; ++coarse) {
      const int64_t rows = 48;
      std::normal_distribution<float> dist(0.0f, 3.0f);
      std::vector<float> lg(static_cast<size_t>(rows * vocab));
      for (auto& x : lg) x = coarse ? std::round(dist(gen)) : dist(gen);
      std::vector<RowSampling> params(static_cast<size_t>(rows));
      const float temps[] = {0.0f, 0.5f, 1.0f, 1.7f};
      const int32_t ks[] = {0, 1, 40, 2000};
      const float ps[] = {1.0f, 0.95f, 0.6f, 1e-6f};
      for (int64_t r = 0; r < rows; ++r) {
        RowSampling& p = params[size_t(r)];
        p.temperature = temps[r % 4];
        p.top_k = ks[(r / 4) % 4];
        p.top_p = ps[(r / 16) % 3 + (r % 7 == 0 ? 1 : 0)];
        p.min_p = (r % 3 == 0) ? 0.0f : (r % 3 == 1 ? 0.05f : 0.3f);
        p.u = std::uniform_real_distribution<double>(0.0, 1.0)(gen);
      }
      auto run = [&](Backend& b) {
        Mirror<float> in(b, lg);
        Mirror<RowSampling> pr(b, params);
        Mirror<int32_t> tok(b, std::vector<int32_t>(static_cast<size_t>(rows), -7));
        REQUIRE(b.sample_rows(in.ptr(), rows, vocab, pr.ptr(), tok.ptr()).ok());
        return tok.read(b);
      };
      const auto ct = run(*cpu);
      const auto gt = run(*gpu);
      for (int64_t r = 0; r < rows; ++r) {
        CAPTURE(vocab, coarse, r);
        if (params[size_t(r)].temperature == 0.0f) {
          CHECK(gt[size_t(r)] == -7);
          CHECK(ct[size_t(r)] == -7);
          continue;
        }
        CHECK(gt[size_t(r)] >= 0);
        CHECK(gt[size_t(r)] < vocab);
        ++rows_total;
        equal += gt[size_t(r)] == ct[size_t(r)] ? 1 : 0;
      }
    }
  }
  std::printf("gpu sampling: %lld of %lld sampled rows equal to the CPU's token\n", (long long)equal,
              (long long)rows_total);
  CHECK(double(equal) >= 0.99 * double(rows_total));
}

TEST_CASE("gpu backend: logprobs and top-n match the CPU reference", "[gpu][sampling][logprobs]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // The GPU sums exponentials in fp32 (per thread, then across the block); the CPU
  // reference in double: logprobs agree within 1e-4. The top-n ids are a selection on
  // the logits' bits with ties to the lower id: equal exactly, ties included (the
  // coarse rows are rounded to integers, so most of their logits tie). Rows with
  // top_n < 0 are not written; a target < 0 resolves to the sampled token where the
  // row's temperature is > 0, else the greedy one.
  std::mt19937 gen(11);
  int64_t checked = 0;
  for (int64_t vocab : {int64_t(3), int64_t(1000), int64_t(4099), int64_t(32000), int64_t(128256)}) {
    for (int coarse = 0; coarse < 2; ++coarse) {
      const int64_t rows = 24;
      std::normal_distribution<float> dist(0.0f, 3.0f);
      std::vector<float> lg(static_cast<size_t>(rows * vocab));
      for (auto& x : lg) x = coarse ? std::round(dist(gen)) : dist(gen);
      for (int64_t r = 0; r < rows; r += 5) lg[size_t(r * vocab + (r % vocab))] = -INFINITY;
      std::vector<LogprobRow> req(static_cast<size_t>(rows));
      std::vector<RowSampling> params(static_cast<size_t>(rows));
      std::vector<int32_t> greedy(static_cast<size_t>(rows)), sampled(static_cast<size_t>(rows));
      const int32_t tops[] = {-1, 0, 1, 5, 20, 20};
      for (int64_t r = 0; r < rows; ++r) {
        req[size_t(r)].top_n = tops[r % 6];
        req[size_t(r)].target = r % 3 == 0 ? -1 : int32_t(gen() % uint32_t(vocab));
        params[size_t(r)].temperature = r % 2 ? 0.7f : 0.0f;
        greedy[size_t(r)] = int32_t(gen() % uint32_t(vocab));
        sampled[size_t(r)] = int32_t(gen() % uint32_t(vocab));
      }
      auto run = [&](Backend& b) {
        Mirror<float> in(b, lg);
        Mirror<LogprobRow> rq(b, req);
        Mirror<int32_t> gr(b, greedy), sa(b, sampled);
        Mirror<RowSampling> pr(b, params);
        LogprobOut sentinel;
        sentinel.token = -7;
        Mirror<LogprobOut> out(b, std::vector<LogprobOut>(static_cast<size_t>(rows), sentinel));
        REQUIRE(b.logprobs_rows(in.ptr(), rows, vocab, rq.ptr(), gr.ptr(), sa.ptr(), pr.ptr(), out.ptr()).ok());
        return out.read(b);
      };
      const auto co = run(*cpu);
      const auto go = run(*gpu);
      for (int64_t r = 0; r < rows; ++r) {
        CAPTURE(vocab, coarse, r);
        const LogprobOut &c = co[size_t(r)], &g = go[size_t(r)];
        if (req[size_t(r)].top_n < 0) {
          CHECK(c.token == -7);
          CHECK(g.token == -7);
          continue;
        }
        const int32_t want = req[size_t(r)].target >= 0 ? req[size_t(r)].target
                             : params[size_t(r)].temperature > 0.0f ? sampled[size_t(r)]
                                                                    : greedy[size_t(r)];
        CHECK(c.token == want);
        CHECK(g.token == want);
        if (std::isinf(c.logprob)) {
          CHECK(g.logprob == c.logprob);
        } else {
          CHECK(std::abs(g.logprob - c.logprob) <= 1e-4f);
        }
        REQUIRE(g.top_n == c.top_n);
        CHECK(c.top_n == std::min<int64_t>(req[size_t(r)].top_n, vocab));
        for (int32_t j = 0; j < c.top_n; ++j) {
          CAPTURE(j);
          CHECK(g.top_ids[j] == c.top_ids[j]);
          if (std::isinf(c.top_logprobs[j])) {
            CHECK(g.top_logprobs[j] == c.top_logprobs[j]);  // a -inf logit among the top n
          } else {
            CHECK(std::abs(g.top_logprobs[j] - c.top_logprobs[j]) <= 1e-4f);
          }
        }
        ++checked;
      }
    }
  }
  std::printf("gpu logprobs: %lld rows equal to the CPU's within 1e-4\n", (long long)checked);
}

TEST_CASE("gpu backend: the logit processors write the CPU's bits and restore the raw logits",
          "[gpu][sampling]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  std::mt19937 gen(11);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int64_t rows = 9, vocab = 32000;
  std::vector<float> lg(static_cast<size_t>(rows * vocab));
  for (auto& x : lg) x = dist(gen);
  // Row r has r * 300 entries (row 0 none) on distinct tokens, with every mix of bias,
  // repetition (a penalty and a reward) and subtraction.
  std::vector<int32_t> start{0};
  std::vector<LogitAdjust> entries;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> ids(static_cast<size_t>(vocab));
    for (int32_t i = 0; i < int32_t(vocab); ++i) ids[size_t(i)] = i;
    std::shuffle(ids.begin(), ids.end(), gen);
    for (int64_t j = 0; j < r * 300; ++j) {
      LogitAdjust a;
      a.token = ids[size_t(j)];
      a.bias = j % 3 == 0 ? 0.0f : std::uniform_real_distribution<float>(-100.0f, 100.0f)(gen);
      a.rep = j % 4 == 0 ? 1.0f : (j % 4 == 1 ? 1.3f : (j % 4 == 2 ? 0.7f : 2.0f));
      a.sub = j % 5 == 0 ? 0.0f : std::uniform_real_distribution<float>(-6.0f, 6.0f)(gen);
      entries.push_back(a);
    }
    start.push_back(int32_t(entries.size()));
  }
  auto run = [&](Backend& b) {
    Mirror<float> in(b, lg);
    Mirror<int32_t> st(b, start);
    Mirror<LogitAdjust> en(b, entries);
    REQUIRE(b.adjust_rows(in.ptr(), rows, vocab, st.ptr(), en.ptr(), false).ok());
    const std::vector<float> applied = in.read(b);
    REQUIRE(b.adjust_rows(in.ptr(), rows, vocab, st.ptr(), en.ptr(), true).ok());
    return std::pair{applied, in.read(b)};
  };
  const auto [c_applied, c_restored] = run(*cpu);
  const auto [g_applied, g_restored] = run(*gpu);
  REQUIRE(c_applied.size() == lg.size());
  REQUIRE(g_applied.size() == lg.size());
  int64_t changed = 0;
  for (size_t i = 0; i < lg.size(); ++i) changed += std::memcmp(&c_applied[i], &lg[i], 4) != 0 ? 1 : 0;
  CHECK(changed > int64_t(entries.size()) / 2);  // the processors did change the logits
  CHECK(std::memcmp(g_applied.data(), c_applied.data(), lg.size() * 4) == 0);
  CHECK(std::memcmp(c_restored.data(), lg.data(), lg.size() * 4) == 0);
  CHECK(std::memcmp(g_restored.data(), lg.data(), lg.size() * 4) == 0);
}
