// Tests of the CPU GEMM (kernels/cpu/gemm/gemm.h): its fixed summation order (every output is
// the fma chain over k in order, bit for bit), batch invariance (a row's bits do not
// depend on the other rows, the batch size or the row's place), the same bits from every
// kernel this CPU runs, and accuracy against a double-precision reference.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/gemm/gemm.h"
#include "tests/util/catch.h"
#include "tests/util/random_bf16.h"

namespace {

using namespace kvfuse;

using kvfuse::testing::random_bf16;

std::vector<cpu::GemmIsa> supported_isas() {
  std::vector<cpu::GemmIsa> out;
  for (cpu::GemmIsa isa : {cpu::GemmIsa::generic, cpu::GemmIsa::avx2, cpu::GemmIsa::avx512}) {
    if (cpu::gemm_isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

struct Problem {
  int64_t m, k, n;
  std::vector<bf16_t> x, w;
  std::vector<bf16_t> packed;
};

Problem make_problem(int64_t m, int64_t k, int64_t n, uint64_t seed) {
  Problem p{m,
            k,
            n,
            random_bf16(size_t(m * k), -2.0f, 2.0f, seed),
            random_bf16(size_t(n * k), -1.0f, 1.0f, seed + 1),
            {}};
  p.packed.resize(cpu::gemm_packed_elems(n, k));
  cpu::gemm_pack_weight(p.w.data(), n, k, p.packed.data());
  return p;
}

// y = x * w^T through linear_f32_out, rows [r0, r0 + rows) of the problem only.
std::vector<float> run_rows(const Problem& p, int64_t r0, int64_t rows, cpu::GemmIsa isa) {
  std::vector<float> scratch(cpu::gemm_scratch_floats(rows, p.k, p.n));
  std::vector<float> out(size_t(rows * p.n));
  cpu::linear_f32_out(p.x.data() + r0 * p.k, rows, p.k, p.packed.data(), p.n, out.data(), scratch.data(),
                      isa);
  return out;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The shapes: tails in every dimension (rows past a tile, columns past a panel, k past
// a k block), and decode/prefill-like sizes.
struct Shape {
  int64_t m, k, n;
};
constexpr Shape kShapes[] = {{1, 1, 1},     {1, 64, 96},   {3, 17, 5},     {5, 130, 37},  {7, 256, 48},
                             {9, 257, 100}, {13, 300, 31}, {16, 256, 512}, {33, 513, 70}, {64, 64, 1024}};

}  // namespace

TEST_CASE("cpu gemm: every output is the in-order fma chain over k, bit for bit", "[gemm][invariance]") {
  for (const Shape& s : kShapes) {
    const Problem p = make_problem(s.m, s.k, s.n, uint64_t(s.m * 1000 + s.k * 7 + s.n));
    for (cpu::GemmIsa isa : supported_isas()) {
      const std::vector<float> y = run_rows(p, 0, s.m, isa);
      int64_t bad = 0;
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < s.n; ++j) {
          float acc = 0.0f;
          for (int64_t q = 0; q < s.k; ++q)
            acc = std::fma(bf16_to_f32(p.x[size_t(i * s.k + q)]), bf16_to_f32(p.w[size_t(j * s.k + q)]), acc);
          bad += !same_bits(&acc, &y[size_t(i * s.n + j)], 1);
        }
      INFO("kernel " << cpu::gemm_isa_name(isa) << " m " << s.m << " k " << s.k << " n " << s.n);
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("cpu gemm: a row's bits do not depend on the batch size or its place in the batch",
          "[gemm][invariance]") {
  const Problem p = make_problem(19, 300, 77, 42);
  for (cpu::GemmIsa isa : supported_isas()) {
    INFO("kernel " << cpu::gemm_isa_name(isa));
    std::vector<std::vector<float>> alone(19);
    for (int64_t r = 0; r < 19; ++r) alone[size_t(r)] = run_rows(p, r, 1, isa);
    // Every window [r0, r0 + rows) of the batch: each of its rows equals the row alone.
    int64_t bad = 0;
    for (int64_t rows = 2; rows <= 19; ++rows)
      for (int64_t r0 = 0; r0 + rows <= 19; ++r0) {
        const std::vector<float> y = run_rows(p, r0, rows, isa);
        for (int64_t i = 0; i < rows; ++i)
          bad += !same_bits(&y[size_t(i * p.n)], alone[size_t(r0 + i)].data(), size_t(p.n));
      }
    CHECK(bad == 0);
  }
}

TEST_CASE("cpu gemm: every kernel this CPU runs gives the same bits", "[gemm][invariance]") {
  const std::vector<cpu::GemmIsa> isas = supported_isas();
  INFO(isas.size() << " kernels supported here");
  for (const Shape& s : kShapes) {
    const Problem p = make_problem(s.m, s.k, s.n, uint64_t(s.n * 31 + s.k));
    const std::vector<float> ref = run_rows(p, 0, s.m, cpu::GemmIsa::generic);
    for (cpu::GemmIsa isa : isas) {
      INFO("kernel " << cpu::gemm_isa_name(isa) << " m " << s.m << " k " << s.k << " n " << s.n);
      CHECK(same_bits(run_rows(p, 0, s.m, isa).data(), ref.data(), ref.size()));
    }
  }
}

TEST_CASE("cpu gemm: linear_bf16 matches a double reference within fp32 accumulation and one bf16 ulp",
          "[gemm]") {
  for (const Shape& s : {Shape{1, 64, 96}, Shape{5, 130, 37}, Shape{16, 256, 512}}) {
    for (bool with_bias : {false, true}) {
      const Problem p = make_problem(s.m, s.k, s.n, uint64_t(s.m * 100 + s.k));
      std::vector<float> bias(size_t(s.n));
      for (int64_t j = 0; j < s.n; ++j) bias[size_t(j)] = float(j % 7) * 0.25f - 0.75f;
      const float* b = with_bias ? bias.data() : nullptr;
      constexpr float kGuard = -12345.0f;  // the op must stay inside its scratch
      const size_t need = cpu::gemm_scratch_floats(s.m, s.k, s.n);
      std::vector<float> scratch(need + 16, kGuard);
      std::vector<bf16_t> out(size_t(s.m * s.n));
      cpu::linear_bf16(p.x.data(), s.m, s.k, p.packed.data(), s.n, b, out.data(), scratch.data(),
                       supported_isas().back());
      int64_t bad = 0;
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < s.n; ++j) {
          double ref = b ? double(b[j]) : 0.0, mag = b ? std::fabs(double(b[j])) : 0.0;
          for (int64_t q = 0; q < s.k; ++q) {
            const double t =
                double(bf16_to_f32(p.x[size_t(i * s.k + q)])) * double(bf16_to_f32(p.w[size_t(j * s.k + q)]));
            ref += t;
            mag += std::fabs(t);
          }
          // One bf16 ulp, plus the fp32 accumulation bound k * 2^-24 * sum |x w|.
          const double tol = std::ldexp(std::fabs(ref), -7) + double(s.k + 1) * std::ldexp(mag, -24);
          bad += !(std::fabs(double(bf16_to_f32(out[size_t(i * s.n + j)])) - ref) <= tol);
        }
      INFO("m " << s.m << " k " << s.k << " n " << s.n << " bias " << with_bias);
      CHECK(bad == 0);
      int64_t guard_changed = 0;
      for (size_t i = need; i < scratch.size(); ++i) guard_changed += scratch[i] != kGuard;
      CHECK(guard_changed == 0);
    }
  }
}

TEST_CASE("cpu gemm: empty batch is a no-op and k = 0 gives zeros", "[gemm]") {
  const Problem p = make_problem(1, 32, 64, 5);
  std::vector<float> scratch(16, -1.0f);
  bf16_t out_sentinel = 0x1234;
  cpu::linear_bf16(nullptr, 0, 32, p.packed.data(), 64, nullptr, &out_sentinel, scratch.data(),
                   cpu::GemmIsa::generic);
  CHECK(out_sentinel == 0x1234);
  std::vector<float> y(2 * 16, 7.0f);
  cpu::gemm_f32(nullptr, 2, 0, nullptr, 5, y.data(), 16, cpu::GemmIsa::generic);
  for (float v : y) CHECK(v == 0.0f);
}

TEST_CASE("cpu gemm: KVFUSE_CPU_GEMM picks the kernel, a bad name is an error naming the variable",
          "[gemm]") {
  cpu::GemmIsa isa = cpu::GemmIsa::avx512;
  std::string error;
  ::setenv("KVFUSE_CPU_GEMM", "generic", 1);
  CHECK(cpu::gemm_isa_from_env(isa, error));
  CHECK(isa == cpu::GemmIsa::generic);
  ::setenv("KVFUSE_CPU_GEMM", "sse9", 1);
  CHECK_FALSE(cpu::gemm_isa_from_env(isa, error));
  CHECK(error.find("KVFUSE_CPU_GEMM=sse9") != std::string::npos);
  ::unsetenv("KVFUSE_CPU_GEMM");
  CHECK(cpu::gemm_isa_from_env(isa, error));
  CHECK(cpu::gemm_isa_supported(isa));
}
