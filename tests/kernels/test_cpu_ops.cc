// Tests of the CPU elementwise/row ops (kernels/cpu/ops/ops.h) against double-precision
// references (the GEMM: test_cpu_gemm.cc).
//
// Every op rounds its fp32 result to bf16 once. bf16 keeps 8 significant bits, so the
// rounding alone is up to half an ulp (2^-8 relative); the tolerances below allow one
// ulp (2^-7 relative) plus whatever fp32 error the op's own arithmetic can add.
#include "tests/util/catch.h"
#include "tests/util/random_bf16.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/ops/ops.h"

namespace {

using namespace kvfuse;

double bf(bf16_t b) { return kvfuse::bf16_to_f32(b); }

using kvfuse::testing::random_bf16;

// |x| in [2^(e-1), 2^e): one bf16 ulp is 2^(e-8).
double bf16_ulp(double x) {
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);
  return std::ldexp(1.0, e - 8);
}

}  // namespace

TEST_CASE("ops: embedding copies the table rows of the ids", "[ops]") {
  const int64_t vocab = 50, hidden = 24;
  const std::vector<bf16_t> table = random_bf16(size_t(vocab * hidden), -1.0f, 1.0f, 1);
  const std::vector<int32_t> ids = {0, 49, 7, 7, 23};
  std::vector<bf16_t> out(ids.size() * size_t(hidden), 0);
  cpu::embedding(ids.data(), int64_t(ids.size()), table.data(), hidden, out.data());
  int64_t bad = 0;
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t c = 0; c < hidden; ++c)
      bad += out[i * size_t(hidden) + size_t(c)] != table[size_t(ids[i] * hidden + c)];
  CHECK(bad == 0);
}

namespace {

// rmsnorm of `rows` random rows against double; returns the number of elements off by
// more than one bf16 ulp.
int64_t rmsnorm_errors(int64_t rows, int64_t cols, float eps, uint64_t seed) {
  std::vector<bf16_t> x = random_bf16(size_t(rows * cols), -3.0f, 3.0f, seed);
  // The second-to-last row is tiny, so eps matters; the last is large.
  for (int64_t c = 0; c < cols && rows >= 2; ++c) {
    bf16_t& tiny = x[size_t((rows - 2) * cols + c)];
    bf16_t& large = x[size_t((rows - 1) * cols + c)];
    tiny = kvfuse::f32_to_bf16(float(bf(tiny)) * 1e-3f);
    large = kvfuse::f32_to_bf16(float(bf(large)) * 1e3f);
  }
  const std::vector<bf16_t> w = random_bf16(size_t(cols), 0.5f, 1.5f, seed + 1);
  std::vector<bf16_t> out(x.size());
  cpu::rmsnorm(x.data(), w.data(), rows, cols, eps, out.data());
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) ss += bf(x[size_t(r * cols + c)]) * bf(x[size_t(r * cols + c)]);
    const double inv = 1.0 / std::sqrt(ss / double(cols) + double(eps));
    for (int64_t c = 0; c < cols; ++c) {
      const double ref = bf(x[size_t(r * cols + c)]) * inv * bf(w[size_t(c)]);
      bad += !(std::fabs(bf(out[size_t(r * cols + c)]) - ref) <= std::ldexp(std::fabs(ref), -7) + 1e-12);
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("ops: rmsnorm matches a double-precision reference", "[ops]") {
  CHECK(rmsnorm_errors(7, 1000, 1e-5f, 2) == 0);
  CHECK(rmsnorm_errors(5, 8, 1e-6f, 3) == 0);  // short rows: the mean's divisor matters
  CHECK(rmsnorm_errors(3, 4096, 1e-5f, 4) == 0);
}

namespace {

// theta^(-2i/D) in double: plain RoPE's frequencies.
std::vector<double> plain_freq(double theta, int32_t D) {
  std::vector<double> f(size_t(D / 2));
  for (int32_t i = 0; i < D / 2; ++i) f[size_t(i)] = std::pow(theta, -2.0 * i / D);
  return f;
}

// The fp32 table the op takes.
std::vector<float> table_of(const std::vector<double>& freq) {
  return std::vector<float>(freq.begin(), freq.end());
}

struct RopeCase {
  int32_t q_heads, kv_heads, head_dim;
  std::vector<double> freq;  // [head_dim / 2]; the op gets them rounded to fp32
  double scaling;            // multiplies cos and sin
  std::vector<int32_t> positions;
};

void check_rope_against_double(const RopeCase& rc) {
  const int64_t n = int64_t(rc.positions.size());
  const int32_t D = rc.head_dim, half = D / 2;
  REQUIRE(rc.freq.size() == size_t(half));
  const std::vector<float> inv_freq = table_of(rc.freq);
  // Token strides larger than the rows, as for views into a fused QKV projection.
  const int64_t q_stride = int64_t(rc.q_heads) * D + 9, k_stride = int64_t(rc.kv_heads) * D + 4;
  std::vector<bf16_t> q = random_bf16(size_t(n * q_stride), -2.0f, 2.0f, 10);
  std::vector<bf16_t> k = random_bf16(size_t(n * k_stride), -2.0f, 2.0f, 11);
  const std::vector<bf16_t> q0 = q, k0 = k;
  cpu::rope_neox(q.data(), q_stride, rc.q_heads, k.data(), k_stride, rc.kv_heads, D, rc.positions.data(), n,
                 inv_freq.data(), float(rc.scaling));
  int64_t bad = 0, pad_changed = 0;
  const auto check = [&](const std::vector<bf16_t>& before, const std::vector<bf16_t>& after, int64_t stride,
                         int32_t heads) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = int64_t(heads) * D; e < stride; ++e)
        pad_changed += after[size_t(t * stride + e)] != before[size_t(t * stride + e)];
      for (int32_t h = 0; h < heads; ++h)
        for (int32_t i = 0; i < half; ++i) {
          const size_t i0 = size_t(t * stride + int64_t(h) * D + i), i1 = i0 + size_t(half);
          const double a = bf(before[i0]), b = bf(before[i1]);
          const double angle = double(rc.positions[size_t(t)]) * rc.freq[size_t(i)];
          const double c = rc.scaling * std::cos(angle), s = rc.scaling * std::sin(angle);
          const double r0 = a * c - b * s;
          const double r1 = b * c + a * s;
          // The kernel's angle is the fp32 product pos * float(inv_freq): off by up to
          // ~|angle| * 2^-23, which moves the outputs by that times the pair's norm
          // (scaled as the outputs are).
          const double norm = std::hypot(a, b) * rc.scaling;
          const double slack = (std::fabs(angle) * std::ldexp(1.0, -22) + std::ldexp(1.0, -20)) * norm;
          bad += !(std::fabs(bf(after[i0]) - r0) <= bf16_ulp(r0) / 2 + slack);
          bad += !(std::fabs(bf(after[i1]) - r1) <= bf16_ulp(r1) / 2 + slack);
        }
    }
  };
  check(q0, q, q_stride, rc.q_heads);
  check(k0, k, k_stride, rc.kv_heads);
  CHECK(bad == 0);
  CHECK(pad_changed == 0);
}

}  // namespace

TEST_CASE("ops: rope_neox matches a double-precision formula", "[ops]") {
  check_rope_against_double({4, 2, 64, plain_freq(10000.0, 64), 1.0, {0, 1, 2, 17, 100, 1023, 4095}});
  check_rope_against_double({8, 1, 128, plain_freq(500000.0, 128), 1.0, {3, 8191, 31, 2047}});
  check_rope_against_double({2, 2, 256, plain_freq(1000000.0, 256), 1.0, {5, 123456}});
}

TEST_CASE("ops: rope_neox with a scaled table and attention scaling matches a double-precision formula",
          "[ops][rope]") {
  // Llama 3.1's table (theta 5e5, factor 8, low 1, high 4, original 8192), computed here
  // from the formula: long wavelengths divided by 8, short ones kept, the band between
  // interpolated. Positions far beyond the original context.
  std::vector<double> llama3 = plain_freq(500000.0, 128);
  for (double& f : llama3) {
    const double wavelen = 2.0 * M_PI / f;
    if (wavelen > 8192.0) {
      f /= 8.0;
    } else if (wavelen >= 8192.0 / 4.0) {
      const double s = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      f = (1.0 - s) * f / 8.0 + s * f;
    }
  }
  check_rope_against_double({8, 2, 128, llama3, 1.0, {0, 5, 8191, 8192, 40000, 131071}});
  // Linear x4 with yarn's attention factor for factor 4 (0.1 ln 4 + 1 = 1.1386...): the
  // op multiplies cos and sin, whatever the table.
  std::vector<double> linear = plain_freq(1000000.0, 128);
  for (double& f : linear) f /= 4.0;
  check_rope_against_double({4, 1, 128, linear, 0.1 * std::log(4.0) + 1.0, {1, 77, 32767, 131000}});
  check_rope_against_double({2, 2, 64, plain_freq(10000.0, 64), 0.75, {3, 4095}});
}

TEST_CASE("ops: rope_neox with attention_scaling 1 is bit-identical to the unscaled rotation",
          "[ops][rope]") {
  // cos * 1.0f and sin * 1.0f are exact: the same bytes as a rotation without the factor,
  // checked against a pair rotated here with the op's own fp32 steps.
  const int32_t D = 64, qh = 2, kh = 1;
  const int64_t n = 4;
  std::vector<bf16_t> q = random_bf16(size_t(n * qh * D), -3.0f, 3.0f, 40);
  std::vector<bf16_t> k = random_bf16(size_t(n * kh * D), -3.0f, 3.0f, 41);
  const std::vector<bf16_t> q0 = q;
  const std::vector<int32_t> pos = {0, 9, 500, 70000};
  const std::vector<float> inv = table_of(plain_freq(10000.0, D));
  cpu::rope_neox(q.data(), qh * D, qh, k.data(), kh * D, kh, D, pos.data(), n, inv.data(), 1.0f);
  int64_t differ = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int32_t h = 0; h < qh; ++h)
      for (int32_t i = 0; i < D / 2; ++i) {
        const size_t i0 = size_t((t * qh + h) * D + i), i1 = i0 + D / 2;
        const float angle = float(pos[size_t(t)]) * inv[size_t(i)];
        const float c = std::cos(angle), s = std::sin(angle);
        const float a = kvfuse::bf16_to_f32(q0[i0]), b = kvfuse::bf16_to_f32(q0[i1]);
        differ += q[i0] != kvfuse::f32_to_bf16(a * c - b * s);
        differ += q[i1] != kvfuse::f32_to_bf16(b * c + a * s);
      }
  CHECK(differ == 0);
}

TEST_CASE("ops: rope_neox at position 0 is the identity", "[ops]") {
  const int32_t D = 128, qh = 4, kh = 2;
  const int64_t n = 3;
  std::vector<bf16_t> q = random_bf16(size_t(n * qh * D), -5.0f, 5.0f, 20);
  std::vector<bf16_t> k = random_bf16(size_t(n * kh * D), -5.0f, 5.0f, 21);
  const std::vector<bf16_t> q0 = q, k0 = k;
  const std::vector<int32_t> pos(size_t(n), 0);
  const std::vector<float> inv = table_of(plain_freq(10000.0, D));
  cpu::rope_neox(q.data(), qh * D, qh, k.data(), kh * D, kh, D, pos.data(), n, inv.data(), 1.0f);
  CHECK((q == q0));
  CHECK((k == k0));
}

TEST_CASE("ops: rope_neox preserves the norm of each rotated pair", "[ops]") {
  const int32_t D = 64, qh = 2, kh = 1;
  const int64_t n = 5;
  std::vector<bf16_t> q = random_bf16(size_t(n * qh * D), -4.0f, 4.0f, 30);
  std::vector<bf16_t> k = random_bf16(size_t(n * kh * D), -4.0f, 4.0f, 31);
  const std::vector<bf16_t> q0 = q;
  const std::vector<int32_t> pos = {1, 10, 333, 2000, 65535};
  const std::vector<float> inv = table_of(plain_freq(10000.0, D));
  cpu::rope_neox(q.data(), qh * D, qh, k.data(), kh * D, kh, D, pos.data(), n, inv.data(), 1.0f);
  int64_t bad = 0, moved = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int32_t h = 0; h < qh; ++h)
      for (int32_t i = 0; i < D / 2; ++i) {
        const size_t i0 = size_t((t * qh + h) * D + i), i1 = i0 + D / 2;
        const double before = std::hypot(bf(q0[i0]), bf(q0[i1]));
        const double after = std::hypot(bf(q[i0]), bf(q[i1]));
        // Each component is rounded to bf16: the norm moves by at most ~2^-8 relative.
        bad += !(std::fabs(after - before) <= std::ldexp(before, -7) + 1e-30);
        moved += q[i0] != q0[i0];
      }
  CHECK(bad == 0);
  CHECK(moved > n * qh * D / 4);  // it did rotate
}

TEST_CASE("ops: silu_mul matches a double-precision reference", "[ops]") {
  const int64_t n = 4, inter = 300;
  std::vector<bf16_t> gu = random_bf16(size_t(n * 2 * inter), -8.0f, 8.0f, 40);
  gu[0] = kvfuse::f32_to_bf16(-100.0f);  // exp(100) overflows to inf: silu must give -0, not NaN
  gu[1] = kvfuse::f32_to_bf16(100.0f);
  gu[2] = 0;
  std::vector<bf16_t> out(size_t(n * inter));
  cpu::silu_mul(gu.data(), n, inter, out.data());
  int64_t bad = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < inter; ++i) {
      const double g = bf(gu[size_t(t * 2 * inter + i)]), u = bf(gu[size_t(t * 2 * inter + inter + i)]);
      const double ref = g / (1.0 + std::exp(-g)) * u;
      bad += !(std::fabs(bf(out[size_t(t * inter + i)]) - ref) <= std::ldexp(std::fabs(ref), -7) + 1e-30);
    }
  CHECK(bad == 0);
}

TEST_CASE("ops: residual_add rounds the fp32 sum once", "[ops]") {
  std::vector<bf16_t> x = random_bf16(1000, -10.0f, 10.0f, 50);
  const std::vector<bf16_t> y = random_bf16(1000, -10.0f, 10.0f, 51);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even gives 1.
  x[0] = kvfuse::f32_to_bf16(1.0f);
  std::vector<bf16_t> y2 = y;
  y2[0] = kvfuse::f32_to_bf16(0.00390625f);
  const std::vector<bf16_t> x0 = x;
  cpu::residual_add(x.data(), y2.data(), int64_t(x.size()));
  CHECK(x[0] == kvfuse::f32_to_bf16(1.0f));
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i)  // the fp32 sum of two such bf16 values is exact
    bad += x[i] != kvfuse::f32_to_bf16(float(bf(x0[i]) + bf(y2[i])));
  CHECK(bad == 0);
}

TEST_CASE("ops: bulk bf16/f32 conversions match the scalar ones", "[ops]") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> f = {0.0f,   -0.0f,   1.0f, 1.00390625f, 1.01171875f, -3.14159f,
                          1e-40f, 3.4e38f, inf,  -inf,        nan};
  std::vector<bf16_t> b(f.size());
  cpu::f32_to_bf16(f.data(), int64_t(f.size()), b.data());
  for (size_t i = 0; i < f.size(); ++i) CHECK(b[i] == kvfuse::f32_to_bf16(f[i]));
  CHECK(b[3] == 0x3f80);  // tie to even: 1 + 2^-8 -> 1
  CHECK(b[4] == 0x3f82);  // 1 + 3*2^-8 -> 1 + 2^-6 (tie, rounds up to even)
  std::vector<float> back(f.size());
  cpu::bf16_to_f32(b.data(), int64_t(b.size()), back.data());
  for (size_t i = 0; i + 1 < f.size(); ++i) CHECK(back[i] == kvfuse::bf16_to_f32(b[i]));
  CHECK(std::isnan(back.back()));
}
