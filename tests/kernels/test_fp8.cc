// FP8 encode/decode (kernels/common/fp8.h) against an independent slow reference, hand-picked
// boundary cases, and conversion vectors from an H200's cvt.rn.satfinite and PyTorch's
// CPU casts (tests/data/README.md). The bytes written to the KV cache are defined by
// fp8_encode, so every byte of it is checked.
#include "tests/util/catch.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"

namespace {

using kvfuse::Fp8Format;

// The formats as the OCP and FNUZ papers describe them, written down independently of
// fp8_spec() so that a wrong constant there is caught here.
struct RefFormat {
  const char* name;
  int exp_bits;
  int mant_bits;
  int bias;
  uint8_t max_code;   // largest finite positive code
  uint8_t nan_code;   // canonical NaN
  bool fnuz;          // 0x80 is NaN, no -0, no inf
  bool ieee_special;  // e5m2: exponent all ones is inf (m == 0) or NaN
};

RefFormat ref_format(Fp8Format f) {
  switch (f) {
    case Fp8Format::e4m3fn:
      return {"e4m3fn", 4, 3, 7, 0x7e, 0x7f, false, false};
    case Fp8Format::e4m3fnuz:
      return {"e4m3fnuz", 4, 3, 8, 0x7f, 0x80, true, false};
    case Fp8Format::e5m2:
      return {"e5m2", 5, 2, 15, 0x7b, 0x7f, false, true};
  }
  return {};
}

// Decodes in double with ldexp on integer significands: a different formula from
// fp8_decode, which assembles fp32 bit patterns.
double ref_decode(uint8_t c, const RefFormat& r) {
  const bool neg = (c & 0x80) != 0;
  const int e = (c >> r.mant_bits) & ((1 << r.exp_bits) - 1);
  const int m = c & ((1 << r.mant_bits) - 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (r.fnuz && c == 0x80) return nan;
  if (!r.fnuz && !r.ieee_special && e == (1 << r.exp_bits) - 1 && m == (1 << r.mant_bits) - 1) return nan;
  if (r.ieee_special && e == (1 << r.exp_bits) - 1) {
    if (m != 0) return nan;
    return neg ? -HUGE_VAL : HUGE_VAL;
  }
  const double mag = e == 0 ? std::ldexp(double(m), 1 - r.bias - r.mant_bits)
                            : std::ldexp(double((1 << r.mant_bits) + m), e - r.bias - r.mant_bits);
  return neg ? -mag : mag;
}

// Nearest-value search over every finite code: saturate beyond max finite, ties to the
// code whose mantissa LSB is even, sign kept except that FNUZ has no -0.
uint8_t ref_encode(double x, const RefFormat& r) {
  if (std::isnan(x)) return r.nan_code;
  const bool neg = std::signbit(x);
  const double a = std::fabs(x);
  const double max = ref_decode(r.max_code, r);
  int best = r.max_code;
  if (!(a > max)) {
    double best_dist = HUGE_VAL;
    for (int c = 0; c <= r.max_code; ++c) {
      const double d = std::fabs(ref_decode(uint8_t(c), r) - a);
      if (d < best_dist || (d == best_dist && (c & 1) == 0)) {
        best = c;
        best_dist = d;
      }
    }
  }
  if (neg && !(r.fnuz && best == 0)) best |= 0x80;
  return uint8_t(best);
}

constexpr Fp8Format kFormats[] = {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz, Fp8Format::e5m2};

std::string hex8(unsigned v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02x", v & 0xffu);
  return buf;
}

std::string describe(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (bits 0x%08x)", double(x), kvfuse::f32_bits(x));
  return buf;
}

// Collects mismatches of a bulk comparison: the count and the first few, for one
// assertion with a useful message instead of thousands of assertions.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 10) first += what + "\n";
  }
};

std::vector<uint8_t> read_data(const std::string& name, size_t expect_bytes) {
  const std::string path = std::string(KVFUSE_TEST_DATA_DIR) + "/" + name;
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  INFO("test data file " << path);
  REQUIRE(bytes.size() == expect_bytes);
  return bytes;
}

std::vector<float> read_f32(const std::string& name, size_t count) {
  const std::vector<uint8_t> bytes = read_data(name, count * 4);
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) {
    uint32_t u = 0;
    for (int b = 0; b < 4; ++b) u |= uint32_t(bytes[i * 4 + size_t(b)]) << (8 * b);  // little-endian
    out[i] = kvfuse::f32_from_bits(u);
  }
  return out;
}

void check_every_code_round_trips(Fp8Format f) {
  const RefFormat r = ref_format(f);
  Mismatches bad;
  for (int c = 0; c < 256; ++c) {
    const float v = kvfuse::fp8_decode(uint8_t(c), f);
    const uint8_t back = kvfuse::fp8_encode(v, f);
    const std::string at =
        "code " + hex8(unsigned(c)) + " decodes to " + describe(v) + ", re-encodes to " + hex8(back);
    if (std::isnan(ref_decode(uint8_t(c), r))) {
      // NaN codes: decode to NaN, and every NaN is written back as the canonical code.
      if (!std::isnan(v) || !kvfuse::fp8_is_nan(uint8_t(c), f) || back != r.nan_code) bad.add(at);
    } else if (std::isinf(v)) {
      // e5m2 0x7c/0xfc are +-inf: saturation writes them back as +-max finite.
      if (!r.ieee_special || back != ((c & 0x80) | r.max_code)) bad.add(at);
    } else if (back != c) {
      bad.add(at);
    }
  }
  INFO(bad.first);
  CHECK(bad.count == 0);
}

void check_all_bf16_against_reference(Fp8Format f) {
  const RefFormat r = ref_format(f);
  Mismatches bad;
  for (uint32_t i = 0; i < 65536; ++i) {
    const float x = kvfuse::bf16_to_f32(kvfuse::bf16_t(i));
    const uint8_t got = kvfuse::fp8_encode(x, f);
    const uint8_t want = ref_encode(double(x), r);
    if (got != want) bad.add("bf16 " + describe(x) + ": got " + hex8(got) + ", reference " + hex8(want));
  }
  CAPTURE(r.name, bad.count);
  INFO(bad.first);
  CHECK(bad.count == 0);
}

struct Case {
  float x;
  uint8_t want;
  const char* what;
};

void check_cases(Fp8Format f, const std::vector<Case>& cases) {
  const RefFormat r = ref_format(f);
  for (const Case& c : cases) {
    INFO(r.name << ": " << c.what << ", input " << describe(c.x) << ", want " << hex8(c.want));
    CHECK(hex8(kvfuse::fp8_encode(c.x, f)) == hex8(c.want));
    // The reference must agree too, or the bulk comparison above proves little.
    CHECK(hex8(ref_encode(double(c.x), r)) == hex8(c.want));
  }
}

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

float p2(int e) { return std::ldexp(1.0f, e); }

// Bulk comparison of fp8_encode over inputs with expected bytes; `skip` excludes inputs
// the file does not define (returns true to skip), `expect` may override the file.
template <class Expect>
void check_against_file(Fp8Format f, const std::vector<float>& xs, const std::vector<uint8_t>& want,
                        const std::string& file, Expect expect) {
  Mismatches bad;
  int64_t compared = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    int w = expect(xs[i], want[i]);
    if (w < 0) continue;
    ++compared;
    const uint8_t got = kvfuse::fp8_encode(xs[i], f);
    if (got != w) {
      bad.add("index " + std::to_string(i) + " input " + describe(xs[i]) + ": got " + hex8(got) + ", want " +
              hex8(unsigned(w)));
    }
  }
  CAPTURE(file, compared, bad.count);
  INFO(bad.first);
  CHECK(compared > 0);
  CHECK(bad.count == 0);
}

std::vector<float> all_bf16_as_f32() {
  std::vector<float> xs(65536);
  for (uint32_t i = 0; i < 65536; ++i) xs[i] = kvfuse::bf16_to_f32(kvfuse::bf16_t(i));
  return xs;
}

void check_decode_table(Fp8Format f, const std::string& file) {
  const std::vector<float> table = read_f32(file, 256);
  Mismatches bad;
  for (int c = 0; c < 256; ++c) {
    const float got = kvfuse::fp8_decode(uint8_t(c), f);
    const bool ok = (std::isnan(got) || std::isnan(table[size_t(c)]))
                        ? (std::isnan(got) && std::isnan(table[size_t(c)]))
                        : kvfuse::f32_bits(got) == kvfuse::f32_bits(table[size_t(c)]);  // sign of zero too
    if (!ok)
      bad.add("code " + hex8(unsigned(c)) + ": got " + describe(got) + ", PyTorch " +
              describe(table[size_t(c)]));
  }
  CAPTURE(file, bad.count);
  INFO(bad.first);
  CHECK(bad.count == 0);
}

}  // namespace

TEST_CASE("fp8 e4m3fn: every code decodes and re-encodes to itself", "[fp8]") {
  check_every_code_round_trips(Fp8Format::e4m3fn);
}
TEST_CASE("fp8 e4m3fnuz: every code decodes and re-encodes to itself", "[fp8]") {
  check_every_code_round_trips(Fp8Format::e4m3fnuz);
}
TEST_CASE("fp8 e5m2: every code decodes and re-encodes to itself, inf codes to max finite", "[fp8]") {
  check_every_code_round_trips(Fp8Format::e5m2);
  CHECK(hex8(kvfuse::fp8_encode(kvfuse::fp8_decode(0x7c, Fp8Format::e5m2), Fp8Format::e5m2)) == "0x7b");
  CHECK(hex8(kvfuse::fp8_encode(kvfuse::fp8_decode(0xfc, Fp8Format::e5m2), Fp8Format::e5m2)) == "0xfb");
}

TEST_CASE("fp8 e4m3fn: all bf16 values encode like a nearest-value reference", "[fp8]") {
  check_all_bf16_against_reference(Fp8Format::e4m3fn);
}
TEST_CASE("fp8 e4m3fnuz: all bf16 values encode like a nearest-value reference", "[fp8]") {
  check_all_bf16_against_reference(Fp8Format::e4m3fnuz);
}
TEST_CASE("fp8 e5m2: all bf16 values encode like a nearest-value reference", "[fp8]") {
  check_all_bf16_against_reference(Fp8Format::e5m2);
}

TEST_CASE("fp8 e4m3fn: boundary cases (max 448, ties, subnormals, zeros, inf, NaN)", "[fp8]") {
  check_cases(Fp8Format::e4m3fn,
              {
                  {448.0f, 0x7e, "max finite"},
                  {-448.0f, 0xfe, "-max finite"},
                  {464.0f, 0x7e, "halfway between max and the next step up (480)"},
                  {std::nextafter(464.0f, kInf), 0x7e, "just above that halfway point"},
                  {1e30f, 0x7e, "far beyond max"},
                  {-1e30f, 0xfe, "far beyond -max"},
                  {432.0f, 0x7e, "halfway 416|448, ties to even"},
                  {1.0625f, 0x38, "halfway 1|1.125, ties to even (down)"},
                  {1.1875f, 0x3a, "halfway 1.125|1.25, ties to even (up)"},
                  {std::nextafter(1.0625f, kInf), 0x39, "just above a halfway point"},
                  {std::nextafter(1.0625f, 0.0f), 0x38, "just below a halfway point"},
                  {p2(-9), 0x01, "smallest subnormal 2^-9"},
                  {-p2(-9), 0x81, "-smallest subnormal"},
                  {p2(-10), 0x00, "half the smallest subnormal, ties to even (0)"},
                  {-p2(-10), 0x80, "-half the smallest subnormal: -0"},
                  {std::nextafter(p2(-10), kInf), 0x01, "just above half the smallest subnormal"},
                  {1.5f * p2(-9), 0x02, "halfway between subnormals 1|2, ties to even"},
                  {7 * p2(-9), 0x07, "largest subnormal"},
                  {7.5f * p2(-9), 0x08, "halfway largest subnormal|min normal, ties to even"},
                  {std::nextafter(7.5f * p2(-9), 0.0f), 0x07, "just below that halfway point"},
                  {p2(-6), 0x08, "min normal 2^-6"},
                  {0.0f, 0x00, "+0"},
                  {-0.0f, 0x80, "-0"},
                  {kInf, 0x7e, "+inf saturates"},
                  {-kInf, 0xfe, "-inf saturates"},
                  {kNaN, 0x7f, "NaN canonical"},
                  {-kNaN, 0x7f, "-NaN canonical"},
              });
  const float neg_zero = kvfuse::fp8_decode(0x80, Fp8Format::e4m3fn);
  CHECK(neg_zero == 0.0f);
  CHECK(std::signbit(neg_zero));
  CHECK(std::isnan(kvfuse::fp8_decode(0x7f, Fp8Format::e4m3fn)));
  CHECK(std::isnan(kvfuse::fp8_decode(0xff, Fp8Format::e4m3fn)));
  CHECK(kvfuse::fp8_decode(0x7e, Fp8Format::e4m3fn) == 448.0f);
  CHECK(kvfuse::fp8_max_finite(Fp8Format::e4m3fn) == 448.0f);
}

TEST_CASE("fp8 e4m3fnuz: boundary cases (max 240, ties, subnormals, no -0, inf, NaN 0x80)", "[fp8]") {
  check_cases(Fp8Format::e4m3fnuz,
              {
                  {240.0f, 0x7f, "max finite"},
                  {-240.0f, 0xff, "-max finite"},
                  {248.0f, 0x7f, "halfway between max and the next step up (256)"},
                  {std::nextafter(248.0f, kInf), 0x7f, "just above that halfway point"},
                  {1e30f, 0x7f, "far beyond max"},
                  {-1e30f, 0xff, "far beyond -max"},
                  {232.0f, 0x7e, "halfway 224|240, ties to even"},
                  {1.0625f, 0x40, "halfway 1|1.125, ties to even (down)"},
                  {1.1875f, 0x42, "halfway 1.125|1.25, ties to even (up)"},
                  {std::nextafter(1.0625f, kInf), 0x41, "just above a halfway point"},
                  {p2(-10), 0x01, "smallest subnormal 2^-10"},
                  {-p2(-10), 0x81, "-smallest subnormal"},
                  {p2(-11), 0x00, "half the smallest subnormal, ties to even (0)"},
                  {-p2(-11), 0x00, "-half the smallest subnormal: +0, FNUZ has no -0"},
                  {-p2(-30), 0x00, "tiny negative: +0"},
                  {std::nextafter(p2(-11), kInf), 0x01, "just above half the smallest subnormal"},
                  {1.5f * p2(-10), 0x02, "halfway between subnormals 1|2, ties to even"},
                  {7 * p2(-10), 0x07, "largest subnormal"},
                  {7.5f * p2(-10), 0x08, "halfway largest subnormal|min normal, ties to even"},
                  {p2(-7), 0x08, "min normal 2^-7"},
                  {0.0f, 0x00, "+0"},
                  {-0.0f, 0x00, "-0 is +0 in FNUZ"},
                  {kInf, 0x7f, "+inf saturates"},
                  {-kInf, 0xff, "-inf saturates"},
                  {kNaN, 0x80, "NaN canonical"},
                  {-kNaN, 0x80, "-NaN canonical"},
              });
  CHECK(std::isnan(kvfuse::fp8_decode(0x80, Fp8Format::e4m3fnuz)));
  CHECK(kvfuse::f32_bits(kvfuse::fp8_decode(0x00, Fp8Format::e4m3fnuz)) == 0u);
  CHECK(kvfuse::fp8_decode(0x7f, Fp8Format::e4m3fnuz) == 240.0f);
  CHECK(kvfuse::fp8_decode(0xff, Fp8Format::e4m3fnuz) == -240.0f);
  CHECK(kvfuse::fp8_max_finite(Fp8Format::e4m3fnuz) == 240.0f);
}

TEST_CASE("fp8 e5m2: boundary cases (max 57344, ties, subnormals, zeros, inf, NaN)", "[fp8]") {
  check_cases(Fp8Format::e5m2,
              {
                  {57344.0f, 0x7b, "max finite"},
                  {-57344.0f, 0xfb, "-max finite"},
                  {61440.0f, 0x7b, "halfway between max and the next step up (65536): not inf"},
                  {std::nextafter(61440.0f, kInf), 0x7b, "just above that halfway point"},
                  {1e30f, 0x7b, "far beyond max"},
                  {-1e30f, 0xfb, "far beyond -max"},
                  {53248.0f, 0x7a, "halfway 49152|57344, ties to even"},
                  {1.125f, 0x3c, "halfway 1|1.25, ties to even (down)"},
                  {1.375f, 0x3e, "halfway 1.25|1.5, ties to even (up)"},
                  {std::nextafter(1.125f, kInf), 0x3d, "just above a halfway point"},
                  {p2(-16), 0x01, "smallest subnormal 2^-16"},
                  {-p2(-16), 0x81, "-smallest subnormal"},
                  {p2(-17), 0x00, "half the smallest subnormal, ties to even (0)"},
                  {-p2(-17), 0x80, "-half the smallest subnormal: -0"},
                  {std::nextafter(p2(-17), kInf), 0x01, "just above half the smallest subnormal"},
                  {1.5f * p2(-16), 0x02, "halfway between subnormals 1|2, ties to even"},
                  {3 * p2(-16), 0x03, "largest subnormal"},
                  {3.5f * p2(-16), 0x04, "halfway largest subnormal|min normal, ties to even"},
                  {p2(-14), 0x04, "min normal 2^-14"},
                  {0.0f, 0x00, "+0"},
                  {-0.0f, 0x80, "-0"},
                  {kInf, 0x7b, "+inf saturates"},
                  {-kInf, 0xfb, "-inf saturates"},
                  {kNaN, 0x7f, "NaN canonical"},
                  {-kNaN, 0x7f, "-NaN canonical"},
              });
  CHECK(kvfuse::fp8_decode(0x7c, Fp8Format::e5m2) == kInf);
  CHECK(kvfuse::fp8_decode(0xfc, Fp8Format::e5m2) == -kInf);
  for (int c : {0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff})
    CHECK(std::isnan(kvfuse::fp8_decode(uint8_t(c), Fp8Format::e5m2)));
  CHECK(std::signbit(kvfuse::fp8_decode(0x80, Fp8Format::e5m2)));
  CHECK(kvfuse::fp8_max_finite(Fp8Format::e5m2) == 57344.0f);
}

TEST_CASE("fp8 e4m3fn: all bf16 values match the H200 cvt.rn.satfinite bytes", "[fp8][data]") {
  const auto want = read_data("all_bf16.e4m3fn_satfinite.u8", 65536);
  check_against_file(Fp8Format::e4m3fn, all_bf16_as_f32(), want, "all_bf16.e4m3fn_satfinite.u8",
                     [](float, uint8_t w) { return int(w); });
  // The reference agrees with the hardware as well (it is what the other formats rely on).
  const RefFormat r = ref_format(Fp8Format::e4m3fn);
  int64_t ref_bad = 0;
  for (uint32_t i = 0; i < 65536; ++i)
    ref_bad += ref_encode(kvfuse::bf16_to_f32(kvfuse::bf16_t(i)), r) != want[i];
  CHECK(ref_bad == 0);
}

TEST_CASE("fp8 e5m2: all bf16 values match the H200 cvt.rn.satfinite bytes", "[fp8][data]") {
  const auto want = read_data("all_bf16.e5m2_satfinite.u8", 65536);
  check_against_file(Fp8Format::e5m2, all_bf16_as_f32(), want, "all_bf16.e5m2_satfinite.u8",
                     [](float, uint8_t w) { return int(w); });
  const RefFormat r = ref_format(Fp8Format::e5m2);
  int64_t ref_bad = 0;
  for (uint32_t i = 0; i < 65536; ++i)
    ref_bad += ref_encode(kvfuse::bf16_to_f32(kvfuse::bf16_t(i)), r) != want[i];
  CHECK(ref_bad == 0);
}

TEST_CASE("fp8 e4m3fn: random fp32 values match the H200 cvt.rn.satfinite bytes", "[fp8][data]") {
  const auto xs = read_f32("random_f32.f32", 65536);
  check_against_file(Fp8Format::e4m3fn, xs, read_data("random_f32.e4m3fn_satfinite.u8", 65536),
                     "random_f32.e4m3fn_satfinite.u8", [](float, uint8_t w) { return int(w); });
}

TEST_CASE("fp8 e5m2: random fp32 values match the H200 cvt.rn.satfinite bytes", "[fp8][data]") {
  const auto xs = read_f32("random_f32.f32", 65536);
  check_against_file(Fp8Format::e5m2, xs, read_data("random_f32.e5m2_satfinite.u8", 65536),
                     "random_f32.e5m2_satfinite.u8", [](float, uint8_t w) { return int(w); });
}

TEST_CASE("fp8 e4m3fnuz: random fp32 values encode like a nearest-value reference", "[fp8][data]") {
  // No hardware file exists for FNUZ; fp32 inputs exercise the rounding bits below bf16's.
  const auto xs = read_f32("random_f32.f32", 65536);
  const RefFormat r = ref_format(Fp8Format::e4m3fnuz);
  std::vector<uint8_t> want(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) want[i] = ref_encode(double(xs[i]), r);
  check_against_file(Fp8Format::e4m3fnuz, xs, want, "random_f32.f32 (reference)",
                     [](float, uint8_t w) { return int(w); });
}

// PyTorch does not saturate, so its bytes define only inputs within the finite range.
TEST_CASE("fp8 e4m3fn: all bf16 values match PyTorch's CPU cast within +-448", "[fp8][data]") {
  check_against_file(Fp8Format::e4m3fn, all_bf16_as_f32(), read_data("all_bf16.e4m3fn_torch_cpu.u8", 65536),
                     "all_bf16.e4m3fn_torch_cpu.u8",
                     [](float x, uint8_t w) { return std::fabs(x) <= 448.0f ? int(w) : -1; });
}

TEST_CASE("fp8 e5m2: all bf16 values match PyTorch's CPU cast within +-57344", "[fp8][data]") {
  check_against_file(Fp8Format::e5m2, all_bf16_as_f32(), read_data("all_bf16.e5m2_torch_cpu.u8", 65536),
                     "all_bf16.e5m2_torch_cpu.u8",
                     [](float x, uint8_t w) { return std::fabs(x) <= 57344.0f ? int(w) : -1; });
}

TEST_CASE("fp8 e4m3fnuz: all bf16 values match PyTorch's CPU cast within +-240, saturate beyond",
          "[fp8][data]") {
  // Out of range PyTorch writes NaN (0x80) from a little above 240; kvfuse saturates:
  // +-240 (0x7f/0xff) for finite overflow and +-inf, 0x80 for NaN only.
  check_against_file(Fp8Format::e4m3fnuz, all_bf16_as_f32(),
                     read_data("all_bf16.e4m3fnuz_torch_cpu.u8", 65536), "all_bf16.e4m3fnuz_torch_cpu.u8",
                     [](float x, uint8_t w) {
                       if (std::isnan(x)) return 0x80;
                       if (std::fabs(x) <= 240.0f) return int(w);
                       return x > 0 ? 0x7f : 0xff;
                     });
}

TEST_CASE("fp8 e4m3fn: decode table matches PyTorch", "[fp8][data]") {
  check_decode_table(Fp8Format::e4m3fn, "decode_e4m3fn.f32");
}
TEST_CASE("fp8 e4m3fnuz: decode table matches PyTorch", "[fp8][data]") {
  check_decode_table(Fp8Format::e4m3fnuz, "decode_e4m3fnuz.f32");
}
TEST_CASE("fp8 e5m2: decode table matches PyTorch", "[fp8][data]") {
  check_decode_table(Fp8Format::e5m2, "decode_e5m2.f32");
}

TEST_CASE("fp8: the reference decoder agrees with PyTorch's decode tables", "[fp8][data]") {
  // Guards the reference itself: it must be right for the bulk comparisons to mean much.
  const char* files[] = {"decode_e4m3fn.f32", "decode_e4m3fnuz.f32", "decode_e5m2.f32"};
  for (int k = 0; k < 3; ++k) {
    const RefFormat r = ref_format(kFormats[k]);
    const std::vector<float> table = read_f32(files[k], 256);
    int64_t bad = 0;
    for (int c = 0; c < 256; ++c) {
      const double want = double(table[size_t(c)]);
      const double got = ref_decode(uint8_t(c), r);
      const bool ok =
          std::isnan(want) ? std::isnan(got) : (got == want && std::signbit(got) == std::signbit(want));
      bad += !ok;
    }
    CAPTURE(r.name, bad);
    CHECK(bad == 0);
  }
}
