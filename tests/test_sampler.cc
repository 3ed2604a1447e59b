// Sampling: greedy ties, top-k/top-p truncation, the distribution, determinism.
#include <cmath>
#include <vector>
#include "tests/catch.h"

#include "src/sampler.h"

using namespace kvfuse;

TEST_CASE("sampler: greedy takes the largest logit, ties to the lowest id", "[sampler]") {
  std::vector<float> lg = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  Rng rng(1);
  CHECK(sample_token(lg.data(), 5, SamplingParams{}, rng) == 1);
  SamplingParams k1{1.0f, 1, 1.0f, 7};
  CHECK(sample_token(lg.data(), 5, k1, rng) == 1);  // top_k = 1 is greedy
  SamplingParams p_small{1.0f, 0, 1e-6f, 7};
  CHECK(sample_token(lg.data(), 5, p_small, rng) == 1);  // a tiny nucleus is greedy
}

TEST_CASE("sampler: temperature sampling follows softmax(logits / T)", "[sampler]") {
  const std::vector<float> lg = {1.0f, 0.0f, 2.0f, -1.0f};
  const float T = 0.7f;
  std::vector<double> p(4);
  double z = 0;
  for (size_t i = 0; i < 4; ++i) z += p[i] = std::exp(lg[i] / T);
  Rng rng(42);
  SamplingParams sp{T, 0, 1.0f, 0};
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
  SamplingParams k2{1.0f, 2, 1.0f, 0};
  for (int i = 0; i < 2000; ++i) {
    const int t = sample_token(lg.data(), 6, k2, rng);
    CHECK((t == 0 || t == 1));
  }
  // softmax(3, 2.5, 2, ...) puts ~0.44 on token 0 and ~0.27 on token 1: top_p 0.6 keeps both.
  SamplingParams p6{1.0f, 0, 0.6f, 0};
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
  CHECK(validate_sampling({0.0f, 0, 1.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({-0.1f, 0, 1.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({NAN, 0, 1.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({1.0f, 11, 1.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({1.0f, -1, 1.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({1.0f, 0, 0.0f, 0}, 10).ok());
  CHECK_FALSE(validate_sampling({1.0f, 0, 1.5f, 0}, 10).ok());
}
