// Tests of the CPU FP8-weight GEMM (kernels/cpu/gemm/gemm_fp8.h): every output equals a
// scalar reference written here (the in-order fma chain of the dequantized operands, then
// the bias and one bf16 rounding) bit for bit on every kernel this CPU runs; batch
// invariance; the activation quantizer's bytes (saturation, zero rows, -0, ties); and
// e4m3fnuz weights against the same values stored as e4m3fn.
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "kernels/cpu/gemm/gemm_fp8.h"
#include "tests/util/catch.h"
#include "tests/util/random_bf16.h"

namespace {

using namespace kvfuse;
using cpu::GemmIsa;

std::vector<GemmIsa> supported_isas() {
  std::vector<GemmIsa> out;
  std::ostringstream skipped;
  for (GemmIsa isa : {GemmIsa::generic, GemmIsa::avx2, GemmIsa::avx512}) {
    if (cpu::gemm_isa_supported(isa)) {
      out.push_back(isa);
    } else {
      skipped << ' ' << cpu::gemm_isa_name(isa);
    }
  }
  if (!skipped.str().empty()) WARN("kernels this CPU cannot run, not tested:" << skipped.str());
  return out;
}

bool fp8_nan(uint8_t c, Fp8Format f) { return f == Fp8Format::e4m3fnuz ? c == 0x80 : (c & 0x7f) == 0x7f; }

std::vector<uint8_t> random_fp8(size_t n, Fp8Format f, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& c : v) {
    do {
      c = uint8_t(rng() & 0xff);
    } while (fp8_nan(c, f));
  }
  return v;
}

using kvfuse::testing::random_bf16;

std::vector<float> random_scales(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(0.001f, 0.1f);
  std::vector<float> v(n);
  for (auto& s : v) s = uni(rng);
  return v;
}

// The scalar reference of the activation quantizer, from the header's formulas.
void ref_quantize(const bf16_t* x, int64_t m, int64_t k, Fp8Act act, float s_static, Fp8Format f, uint8_t* q,
                  float* scales) {
  for (int64_t i = 0; i < m; ++i) {
    float s = s_static;
    if (act == Fp8Act::dynamic_token) {
      float amax = 0.0f;
      for (int64_t p = 0; p < k; ++p) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[i * k + p])));
      s = std::fmax(amax / fp8_max_finite(f), kFp8MinActScale);
    }
    scales[i] = s;
    const float inv = 1.0f / s;
    for (int64_t p = 0; p < k; ++p) q[i * k + p] = fp8_encode(bf16_to_f32(x[i * k + p]) * inv, f);
  }
}

struct Case {
  int64_t m, k, n;
  Fp8Format w_fmt, a_fmt;
  Fp8Act act;
  float s_static;
  std::vector<bf16_t> x;
  std::vector<uint8_t> w, packed;
  std::vector<float> w_scale, bias;
};

Case make_case(int64_t m, int64_t k, int64_t n, Fp8Format w_fmt, Fp8Format a_fmt, Fp8Act act, uint64_t seed) {
  Case c{m, k, n, w_fmt, a_fmt, act, 0.01f, {}, {}, {}, {}, {}};
  c.x = random_bf16(size_t(m * k), -4.0f, 4.0f, seed);
  // Spread the rows' magnitudes, so that per-row scales differ.
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      bf16_t& e = c.x[size_t(i * k + p)];
      e = f32_to_bf16(bf16_to_f32(e) * std::ldexp(1.0f, int(i % 5) - 2));
    }
  c.w = random_fp8(size_t(n * k), w_fmt, seed + 1);
  c.w_scale = random_scales(size_t(n), seed + 2);
  c.bias = random_scales(size_t(n), seed + 3);
  for (size_t j = 0; j < c.bias.size(); j += 2) c.bias[j] = -c.bias[j];
  c.packed.resize(cpu::gemm_packed_fp8_bytes(n, k));
  cpu::gemm_pack_weight_fp8(c.w.data(), n, k, c.packed.data());
  return c;
}

cpu::Fp8Weight weight_of(const Case& c) { return {c.packed.data(), c.w_scale.data(), c.w_fmt}; }
cpu::Fp8ActQuant act_of(const Case& c) { return {c.act, c.s_static, c.a_fmt}; }

// The reference chains (fp32) of rows [r0, r0 + rows): dequantize both operands by the
// header's formulas (fp8_decode, not the kernel's table), then the fma chain in order.
std::vector<float> ref_chains(const Case& c, int64_t r0, int64_t rows) {
  const int64_t k = c.k;
  std::vector<float> xd(size_t(rows * k));
  if (c.act == Fp8Act::none) {
    for (int64_t e = 0; e < rows * k; ++e) xd[size_t(e)] = bf16_to_f32(c.x[size_t(r0 * k + e)]);
  } else {
    std::vector<uint8_t> q(size_t(rows * k));
    std::vector<float> s(static_cast<size_t>(rows));
    ref_quantize(c.x.data() + r0 * k, rows, k, c.act, c.s_static, c.a_fmt, q.data(), s.data());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t p = 0; p < k; ++p)
        xd[size_t(i * k + p)] = fp8_decode(q[size_t(i * k + p)], c.a_fmt) * s[size_t(i)];
  }
  std::vector<float> out(size_t(rows * c.n));
  for (int64_t j = 0; j < c.n; ++j) {
    std::vector<float> wd(static_cast<size_t>(k));
    for (int64_t p = 0; p < k; ++p)
      wd[size_t(p)] = fp8_decode(c.w[size_t(j * k + p)], c.w_fmt) * c.w_scale[size_t(j)];
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) acc = std::fma(xd[size_t(i * k + p)], wd[size_t(p)], acc);
      out[size_t(i * c.n + j)] = acc;
    }
  }
  return out;
}

std::vector<float> run_f32(const Case& c, int64_t r0, int64_t rows, GemmIsa isa) {
  std::vector<float> scratch(cpu::gemm_fp8_scratch_floats(rows, c.k, c.n));
  std::vector<float> out(size_t(rows * c.n));
  cpu::linear_fp8_f32_out(c.x.data() + r0 * c.k, rows, c.k, weight_of(c), c.n, act_of(c), out.data(),
                          scratch.data(), isa);
  return out;
}

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

const char* act_name(Fp8Act a) {
  return a == Fp8Act::none ? "none" : a == Fp8Act::static_tensor ? "static_tensor" : "dynamic_token";
}

constexpr Fp8Act kActs[] = {Fp8Act::none, Fp8Act::static_tensor, Fp8Act::dynamic_token};

}  // namespace

TEST_CASE("cpu fp8 gemm: every output is the in-order fma chain of the dequantized operands, bit for bit",
          "[gemm][fp8][invariance]") {
  const std::vector<GemmIsa> isas = supported_isas();
  int64_t cases = 0, bad_f32 = 0, bad_bf16 = 0, guard_changed = 0;
  uint64_t seed = 1;
  for (int64_t n : {1, 15, 16, 17, 40, 100})
    for (int64_t k : {1, 7, 64, 255, 256, 300, 600})
      for (int64_t m : {1, 2, 5, 9, 17})
        for (Fp8Act act : kActs) {
          ++seed;
          const Fp8Format w_fmt = seed % 2 ? Fp8Format::e4m3fn : Fp8Format::e4m3fnuz;
          const Fp8Format a_fmt = seed % 3 ? Fp8Format::e4m3fn : Fp8Format::e4m3fnuz;
          const Case c = make_case(m, k, n, w_fmt, a_fmt, act, seed * 7919);
          const std::vector<float> ref = ref_chains(c, 0, m);
          std::vector<bf16_t> ref_bf16(ref.size());
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              ref_bf16[size_t(i * n + j)] = f32_to_bf16(ref[size_t(i * n + j)] + c.bias[size_t(j)]);
          for (GemmIsa isa : isas) {
            ++cases;
            const std::vector<float> y = run_f32(c, 0, m, isa);
            const bool ok_f32 = same_bits(y.data(), ref.data(), ref.size() * sizeof(float));
            // linear_fp8_bf16 with the bias, inside a scratch with a guard band after it.
            constexpr float kGuard = -12345.0f;
            const size_t need = cpu::gemm_fp8_scratch_floats(m, k, n);
            std::vector<float> scratch(need + 16, kGuard);
            std::vector<bf16_t> out(size_t(m * n));
            cpu::linear_fp8_bf16(c.x.data(), m, k, weight_of(c), n, act_of(c), c.bias.data(), out.data(),
                                 scratch.data(), isa);
            const bool ok_bf16 = same_bits(out.data(), ref_bf16.data(), out.size() * sizeof(bf16_t));
            for (size_t i = need; i < scratch.size(); ++i) guard_changed += scratch[i] != kGuard;
            if (!ok_f32 || !ok_bf16) {
              UNSCOPED_INFO("kernel " << cpu::gemm_isa_name(isa) << " m " << m << " k " << k << " n " << n
                                      << " act " << act_name(act) << " f32 " << ok_f32 << " bf16 "
                                      << ok_bf16);
            }
            bad_f32 += !ok_f32;
            bad_bf16 += !ok_bf16;
          }
        }
  INFO(cases << " (shape, activation, kernel) cases");
  CHECK(cases == int64_t(6 * 7 * 5 * 3 * isas.size()));
  CHECK(bad_f32 == 0);
  CHECK(bad_bf16 == 0);
  CHECK(guard_changed == 0);
}

TEST_CASE("cpu fp8 gemm: a row's bits do not depend on the batch size or its place in the batch",
          "[gemm][fp8][invariance]") {
  for (Fp8Act act : kActs) {
    const Case c = make_case(12, 300, 40, Fp8Format::e4m3fn, Fp8Format::e4m3fn, act, 4242);
    for (GemmIsa isa : supported_isas()) {
      INFO("kernel " << cpu::gemm_isa_name(isa) << " act " << act_name(act));
      std::vector<std::vector<float>> alone(12);
      for (int64_t r = 0; r < 12; ++r) alone[size_t(r)] = run_f32(c, r, 1, isa);
      int64_t bad = 0, checked = 0;
      for (int64_t rows = 2; rows <= 12; ++rows)
        for (int64_t r0 = 0; r0 + rows <= 12; ++r0) {
          const std::vector<float> y = run_f32(c, r0, rows, isa);
          for (int64_t i = 0; i < rows; ++i, ++checked)
            bad += !same_bits(&y[size_t(i * c.n)], alone[size_t(r0 + i)].data(), size_t(c.n) * sizeof(float));
        }
      CHECK(checked == 352);  // the sum over rows = 2..12 of rows * (13 - rows)
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("cpu fp8 gemm: quantize_rows_fp8 bytes equal the scalar reference", "[gemm][fp8]") {
  const int64_t m = 9, k = 333;
  std::vector<bf16_t> x = random_bf16(size_t(m * k), -3.0f, 3.0f, 77);
  for (int64_t p = 0; p < k; ++p)
    x[size_t(4 * k + p)] = f32_to_bf16(bf16_to_f32(x[size_t(4 * k + p)]) * 1e-30f);
  for (Fp8Format f : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz})
    for (Fp8Act act : {Fp8Act::static_tensor, Fp8Act::dynamic_token}) {
      INFO("format " << int(f) << " act " << act_name(act));
      std::vector<uint8_t> q(size_t(m * k)), q_ref(q.size());
      std::vector<float> s(static_cast<size_t>(m)), s_ref(s.size());
      cpu::quantize_rows_fp8(x.data(), m, k, act, 0.004f, f, q.data(), s.data());
      ref_quantize(x.data(), m, k, act, 0.004f, f, q_ref.data(), s_ref.data());
      CHECK(q == q_ref);
      CHECK(same_bits(s.data(), s_ref.data(), s.size() * sizeof(float)));
      if (act == Fp8Act::dynamic_token) {
        CHECK(s[4] == kFp8MinActScale);  // the tiny row takes the smallest scale
        // Elsewhere the row's largest magnitude lands on the largest finite code, with
        // its sign.
        for (int64_t i = 0; i < m; ++i) {
          if (i == 4) continue;
          int64_t arg = 0;
          for (int64_t p = 1; p < k; ++p)
            if (std::fabs(bf16_to_f32(x[size_t(i * k + p)])) > std::fabs(bf16_to_f32(x[size_t(i * k + arg)])))
              arg = p;
          const uint8_t top =
              uint8_t(fp8_spec(f).max_code | (bf16_to_f32(x[size_t(i * k + arg)]) < 0 ? 0x80 : 0));
          CHECK(q[size_t(i * k + arg)] == top);
        }
      }
    }
}

TEST_CASE("cpu fp8 gemm: quantize_rows_fp8 saturates, and zero rows and -0 are well defined", "[gemm][fp8]") {
  for (Fp8Format f : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz}) {
    INFO("format " << int(f));
    const uint8_t max_code = uint8_t(fp8_spec(f).max_code);
    const bool fnuz = f == Fp8Format::e4m3fnuz;
    // Static scale 1: values far beyond the largest finite value, and the infinities.
    const bf16_t big[6] = {f32_to_bf16(1e30f),   f32_to_bf16(-1e30f), f32_to_bf16(1000.0f),
                           f32_to_bf16(-500.0f), 0x7f80 /* +inf */,   0xff80 /* -inf */};
    uint8_t q[6];
    float s = 0;
    cpu::quantize_rows_fp8(big, 1, 6, Fp8Act::static_tensor, 1.0f, f, q, &s);
    CHECK(s == 1.0f);
    const uint8_t want[6] = {max_code, uint8_t(0x80 | max_code), max_code, uint8_t(0x80 | max_code),
                             max_code, uint8_t(0x80 | max_code)};
    for (int e = 0; e < 6; ++e) CHECK(int(q[e]) == int(want[e]));
    // A far smaller static scale saturates ordinary values too.
    const bf16_t two[2] = {f32_to_bf16(2.0f), f32_to_bf16(-2.0f)};
    cpu::quantize_rows_fp8(two, 1, 2, Fp8Act::static_tensor, 1e-3f, f, q, &s);
    CHECK(int(q[0]) == int(max_code));
    CHECK(int(q[1]) == int(0x80 | max_code));
    // An all-zero row (+0 and -0): scale kFp8MinActScale, +0 -> 0x00, -0 -> 0x80 (e4m3fn)
    // or 0x00 (e4m3fnuz, which has no -0).
    const bf16_t zeros[4] = {0x0000, 0x8000, 0x0000, 0x8000};
    uint8_t qz[8];
    float sz[2] = {0, 0};
    const bf16_t two_rows[8] = {0x0000, 0x0000, 0x0000, 0x0000, 0x8000, 0x8000, 0x8000, 0x8000};
    cpu::quantize_rows_fp8(two_rows, 2, 4, Fp8Act::dynamic_token, 0.0f, f, qz, sz);
    CHECK(sz[0] == kFp8MinActScale);
    CHECK(sz[1] == kFp8MinActScale);
    for (int e = 0; e < 4; ++e) CHECK(int(qz[e]) == 0);
    for (int e = 4; e < 8; ++e) CHECK(int(qz[e]) == (fnuz ? 0x00 : 0x80));
    cpu::quantize_rows_fp8(zeros, 1, 4, Fp8Act::static_tensor, 0.5f, f, qz, sz);
    CHECK(int(qz[1]) == (fnuz ? 0x00 : 0x80));
    CHECK(int(qz[3]) == (fnuz ? 0x00 : 0x80));
    // A NaN is skipped by amax and encodes to the format's NaN.
    const bf16_t with_nan[3] = {0x7fc0, f32_to_bf16(-2.0f), f32_to_bf16(1.0f)};
    cpu::quantize_rows_fp8(with_nan, 1, 3, Fp8Act::dynamic_token, 0.0f, f, qz, sz);
    CHECK(sz[0] == 2.0f / fp8_max_finite(f));
    CHECK(int(qz[0]) == int(fp8_spec(f).nan_code));
    CHECK(int(qz[1]) == int(0x80 | max_code));
    // Through the GEMM: an all -0 row gives +0 outputs (the chain starts at +0).
    const int64_t n = 3, k = 4;
    const std::vector<uint8_t> w = random_fp8(size_t(n * k), Fp8Format::e4m3fn, 9);
    std::vector<uint8_t> packed(cpu::gemm_packed_fp8_bytes(n, k));
    cpu::gemm_pack_weight_fp8(w.data(), n, k, packed.data());
    const std::vector<float> ws = {0.5f, 0.25f, 2.0f};
    for (Fp8Act act : kActs) {
      std::vector<float> scratch(cpu::gemm_fp8_scratch_floats(1, k, n));
      std::vector<bf16_t> out(size_t(n), 0x1234);
      cpu::linear_fp8_bf16(two_rows + 4, 1, k, {packed.data(), ws.data(), Fp8Format::e4m3fn}, n,
                           {act, 0.5f, f}, nullptr, out.data(), scratch.data(), GemmIsa::generic);
      for (bf16_t o : out) CHECK(int(o) == 0);
    }
  }
}

TEST_CASE("cpu fp8 gemm: quantize_rows_fp8 rounds bf16 ties to even", "[gemm][fp8]") {
  // Scale 1/2 (inv = 2, exact) for e4m3fn: each input times 2 lies halfway between two
  // neighbouring codes. Expected codes worked out by hand: 1.0 = 0x38, 1.125 = 0x39,
  // 1.25 = 0x3a; subnormal unit 2^-9; 448 = 0x7e is the largest finite value.
  struct Tie {
    float x2;  // the input times 2
    uint8_t fn, fnuz;
  };
  // e4m3fnuz: the same grid halved, so 1.0 = 0x40, 1.125 = 0x41, 1.25 = 0x42, subnormal
  // unit 2^-10, largest 240 = 0x7f.
  const Tie ties[] = {
      {1.0625f, 0x38, 0x40},                 // 1 + 1/16: between 1 and 1.125 -> even 1.0
      {1.1875f, 0x3a, 0x42},                 // between 1.125 and 1.25 -> even 1.25
      {-1.0625f, 0xb8, 0xc0},                // the sign does not change the choice
      {std::ldexp(1.0f, -10), 0x00, 0x01},   // fn: half the smallest subnormal -> 0
      {std::ldexp(3.0f, -10), 0x02, 0x03},   // fn: 1.5 units -> 2 units
      {std::ldexp(5.0f, -10), 0x02, 0x05},   // fn: 2.5 units -> 2 units
      {std::ldexp(-1.0f, -10), 0x80, 0x81},  // fn: -0 (the sign kept), fnuz exact
      {std::ldexp(1.0f, -11), 0x00, 0x00},   // fnuz: half its smallest subnormal -> 0
      {std::ldexp(-1.0f, -11), 0x80, 0x00},  // fnuz has no -0
      {std::ldexp(3.0f, -11), 0x01, 0x02},   // fn: 0.75 units -> 1; fnuz: 1.5 units -> 2
      {232.0f, 0x76, 0x7e},                  // between 224 and 240 -> even 224 (both)
      {464.0f, 0x7e, 0x7f},                  // fn: between 448 and 480 (no such code) -> 448;
                                             // fnuz: past 240, saturates
  };
  for (const Tie& t : ties) {
    const bf16_t x = f32_to_bf16(t.x2 * 0.5f);
    REQUIRE(bf16_to_f32(x) * 2.0f == t.x2);  // the tie is exactly representable in bf16
    uint8_t q = 0;
    float s = 0;
    INFO("x * 2 = " << t.x2);
    cpu::quantize_rows_fp8(&x, 1, 1, Fp8Act::static_tensor, 0.5f, Fp8Format::e4m3fn, &q, &s);
    CHECK(int(q) == int(t.fn));
    cpu::quantize_rows_fp8(&x, 1, 1, Fp8Act::static_tensor, 0.5f, Fp8Format::e4m3fnuz, &q, &s);
    CHECK(int(q) == int(t.fnuz));
  }
}

TEST_CASE("cpu fp8 gemm: e4m3fnuz weights with twice the scale equal the e4m3fn weights", "[gemm][fp8]") {
  CHECK(int(fp8_e4m3fn_to_fnuz(0x80)) == 0x00);
  CHECK(int(fp8_e4m3fn_to_fnuz(0x7f)) == 0x80);
  CHECK(int(fp8_e4m3fn_to_fnuz(0xff)) == 0x80);
  CHECK(int(fp8_e4m3fn_to_fnuz(0x7e)) == 0x7e);
  // Every code: the same dequantized value (bits, except -0 which becomes +0).
  int64_t bad = 0;
  for (float s : {1.0f, 0.0123f, 3.7e-3f, 250.0f})
    for (int c = 0; c < 256; ++c) {
      if (fp8_nan(uint8_t(c), Fp8Format::e4m3fn)) {
        bad += !fp8_nan(fp8_e4m3fn_to_fnuz(uint8_t(c)), Fp8Format::e4m3fnuz);
        continue;
      }
      const float a = fp8_decode(uint8_t(c), Fp8Format::e4m3fn) * s;
      const float b = fp8_decode(fp8_e4m3fn_to_fnuz(uint8_t(c)), Fp8Format::e4m3fnuz) * (2.0f * s);
      bad += c == 0x80 ? !(b == 0.0f && !std::signbit(b)) : !same_bits(&a, &b, sizeof a);
    }
  CHECK(bad == 0);
  // Through the GEMM, every activation kind and kernel: the same output bits.
  for (Fp8Act act : kActs) {
    Case fn = make_case(7, 300, 37, Fp8Format::e4m3fn, Fp8Format::e4m3fn, act, 555);
    fn.w[3] = 0x80;  // a -0 weight among them
    cpu::gemm_pack_weight_fp8(fn.w.data(), fn.n, fn.k, fn.packed.data());
    Case fnuz = fn;
    fnuz.w_fmt = Fp8Format::e4m3fnuz;
    for (auto& b : fnuz.w) b = fp8_e4m3fn_to_fnuz(b);
    for (auto& s : fnuz.w_scale) s *= 2.0f;
    cpu::gemm_pack_weight_fp8(fnuz.w.data(), fnuz.n, fnuz.k, fnuz.packed.data());
    for (GemmIsa isa : supported_isas()) {
      INFO("kernel " << cpu::gemm_isa_name(isa) << " act " << act_name(act));
      const std::vector<float> a = run_f32(fn, 0, fn.m, isa), b = run_f32(fnuz, 0, fnuz.m, isa);
      CHECK(same_bits(a.data(), b.data(), a.size() * sizeof(float)));
    }
  }
}

TEST_CASE("cpu fp8 gemm: W8A16 equals the bf16 GEMM on the dequantized weights", "[gemm][fp8]") {
  // Power-of-two scales keep wd exact in bf16 (an e4m3 value has 4 significant bits), so
  // linear_bf16 (kernels/cpu/gemm/gemm.h) can run the same weights.
  Case c = make_case(5, 300, 40, Fp8Format::e4m3fn, Fp8Format::e4m3fn, Fp8Act::none, 31337);
  for (size_t j = 0; j < c.w_scale.size(); ++j) c.w_scale[j] = std::ldexp(1.0f, int(j % 7) - 8);
  std::vector<bf16_t> wd(c.w.size());
  for (int64_t j = 0; j < c.n; ++j)
    for (int64_t p = 0; p < c.k; ++p) {
      const float v = fp8_decode(c.w[size_t(j * c.k + p)], c.w_fmt) * c.w_scale[size_t(j)];
      wd[size_t(j * c.k + p)] = f32_to_bf16(v);
      REQUIRE(bf16_to_f32(wd[size_t(j * c.k + p)]) == v);
    }
  std::vector<bf16_t> packed_bf16(cpu::gemm_packed_elems(c.n, c.k));
  cpu::gemm_pack_weight(wd.data(), c.n, c.k, packed_bf16.data());
  for (GemmIsa isa : supported_isas()) {
    INFO("kernel " << cpu::gemm_isa_name(isa));
    std::vector<float> s8(cpu::gemm_fp8_scratch_floats(c.m, c.k, c.n)),
        s16(cpu::gemm_scratch_floats(c.m, c.k, c.n));
    std::vector<bf16_t> a(size_t(c.m * c.n)), b(a.size());
    cpu::linear_fp8_bf16(c.x.data(), c.m, c.k, weight_of(c), c.n, act_of(c), c.bias.data(), a.data(),
                         s8.data(), isa);
    cpu::linear_bf16(c.x.data(), c.m, c.k, packed_bf16.data(), c.n, c.bias.data(), b.data(), s16.data(), isa);
    CHECK(a == b);
  }
}
