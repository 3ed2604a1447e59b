// Device FP8 conversion (kernels/common/fp8_convert.cuh) against the bytes that define it:
// - on the GPU: cvt_fp8x4<F> over every bf16 value (widened exactly) and over 65,536
//   random fp32 values, against the H200 instruction's files in tests/data (e4m3fn,
//   e5m2) and the CPU reference fp8_encode (all three formats, FNUZ included);
// - on the host, with or without a GPU: the AMD recipe (clamp, FNUZ-to-OCP halving,
//   NaN and zero fix-ups) run with an emulated v_cvt_pk_{fp8,bf8}_f32 of each target,
//   gfx942 (FNUZ formats) and gfx950 (OCP formats), against fp8_encode, over every bf16
//   and f16 value, random fp32 values, scaled bf16 values and the special values. There
//   is no AMD GPU here: this checks the recipe's arithmetic, and the emulators are
//   written independently (double-precision rounding), but they are not the hardware.
//   Each emulator is run twice, writing -0 as 0x00 and as 0x80, since what the
//   instruction does there is not documented and the fix-up must cover both; the gfx950
//   one writes NaN, and overflow (which the recipe's clamp must prevent), with the
//   input's sign, as the OCP encodings allow.
#include "kernels/common/gpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8_convert.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;

const Fp8Format kFormats[] = {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz, Fp8Format::e5m2};

const char* format_name(Fp8Format f) {
  return f == Fp8Format::e4m3fn ? "e4m3fn" : f == Fp8Format::e4m3fnuz ? "e4m3fnuz" : "e5m2";
}

// A finite a > 0 rounded to nearest even with mbits mantissa bits, its exponent no lower
// than emin (subnormals): the code's significand field and exponent before packing.
struct Rounded {
  uint32_t q;  // significand in units of 2^(e - mbits), below 2^(mbits + 1)
  int e;
};
Rounded round_significand(double a, int mbits, int emin) {
  int e = 0;
  std::frexp(a, &e);
  e -= 1;  // a = m * 2^e, m in [1, 2)
  if (e < emin) e = emin;
  double q = std::nearbyint(std::ldexp(a, mbits - e));  // ties to even
  if (q >= double(2 << mbits)) {                        // rounded up to the next binade
    q /= 2;
    e += 1;
  }
  return {uint32_t(q), e};
}

// A model of gfx942's v_cvt_pk_fp8_f32 (mant_bits 3) / v_cvt_pk_bf8_f32 (mant_bits 2):
// round to nearest even into the FNUZ format (bias 8 / 16, no inf, 0x80 the only NaN),
// no saturation: a result beyond the largest finite value is NaN.
uint8_t emulate_gfx942_cvt(float y, bool bf8, bool neg_zero_0x80) {
  const int mbits = bf8 ? 2 : 3;
  const int bias = bf8 ? 16 : 8;
  const int emax = (1 << (7 - mbits)) - 1 - bias;
  const int emin = 1 - bias;
  if (std::isnan(y)) return 0x80;
  const bool neg = std::signbit(y);
  const double a = std::fabs(double(y));
  if (a == 0.0) return neg && neg_zero_0x80 ? 0x80 : 0x00;
  if (std::isinf(a)) return 0x80;
  const auto [qi, e] = round_significand(a, mbits, emin);
  if (e > emax) return 0x80;
  const uint32_t code = qi < (1u << mbits) ? qi : ((uint32_t(e + bias) << mbits) | (qi - (1u << mbits)));
  if (code == 0) return neg && neg_zero_0x80 ? 0x80 : 0x00;
  return uint8_t((neg ? 0x80u : 0u) | code);
}

// A model of gfx950's v_cvt_pk_fp8_f32 (OCP e4m3: bias 7, no inf, S.1111.111 NaN) and
// v_cvt_pk_bf8_f32 (OCP e5m2: bias 15, S.11111.00 inf): round to nearest even, no
// saturation: a finite result beyond the largest finite value is NaN (e4m3) or inf
// (e5m2), as is an infinite input; NaN stays NaN. Signs are kept.
uint8_t emulate_gfx950_cvt(float y, bool bf8, bool neg_zero_0x80) {
  const int mbits = bf8 ? 2 : 3;
  const int bias = bf8 ? 15 : 7;
  const uint32_t max_code = bf8 ? 0x7b : 0x7e;
  const int emax = bf8 ? 15 : 8;  // exponent of the top binade that holds finite values
  const int emin = 1 - bias;
  const bool neg = std::signbit(y);
  const uint32_t sign = neg ? 0x80u : 0u;
  const uint32_t overflow = sign | (bf8 ? 0x7cu : 0x7fu);
  if (std::isnan(y)) return uint8_t(sign | 0x7fu);
  const double a = std::fabs(double(y));
  if (std::isinf(a)) return uint8_t(overflow);
  if (a == 0.0) return neg && neg_zero_0x80 ? 0x80 : 0x00;
  const auto [qi, e] = round_significand(a, mbits, emin);
  if (e > emax) return uint8_t(overflow);
  const uint32_t code = qi < (1u << mbits) ? qi : ((uint32_t(e + bias) << mbits) | (qi - (1u << mbits)));
  if (code > max_code) return uint8_t(overflow);
  if (code == 0) return neg && neg_zero_0x80 ? 0x80 : 0x00;
  return uint8_t(sign | code);
}

enum class AmdArch { gfx942, gfx950 };

const char* arch_name(AmdArch a) { return a == AmdArch::gfx942 ? "gfx942" : "gfx950"; }

// The formats the recipe serves on each target: gfx950 has no FNUZ conversion (its
// e4m3fnuz path is the scalar fp8_encode, nothing to emulate).
std::vector<Fp8Format> recipe_formats(AmdArch a) {
  if (a == AmdArch::gfx942) return {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz, Fp8Format::e5m2};
  return {Fp8Format::e4m3fn, Fp8Format::e5m2};
}

template <Fp8Format F, AmdArch A>
uint8_t amd_recipe_emulated(float x, bool neg_zero_0x80) {
  constexpr bool kHwFnuz = A == AmdArch::gfx942;
  if constexpr (!kHwFnuz && F == Fp8Format::e4m3fnuz) {
    return 0;  // not a gfx950 recipe (recipe_formats)
  } else {
    using R = gpu::AmdCvtRecipe<F, kHwFnuz>;
    const float y = R::prepare(x);
    const uint8_t raw = kHwFnuz ? emulate_gfx942_cvt(y, R::kBf8, neg_zero_0x80)
                                : emulate_gfx950_cvt(y, R::kBf8, neg_zero_0x80);
    return uint8_t(R::fixup(raw, x));
  }
}

template <AmdArch A>
uint8_t amd_recipe_emulated(float x, Fp8Format f, bool nz) {
  switch (f) {
    case Fp8Format::e4m3fn:
      return amd_recipe_emulated<Fp8Format::e4m3fn, A>(x, nz);
    case Fp8Format::e4m3fnuz:
      return amd_recipe_emulated<Fp8Format::e4m3fnuz, A>(x, nz);
    case Fp8Format::e5m2:
      return amd_recipe_emulated<Fp8Format::e5m2, A>(x, nz);
  }
  return 0;
}

uint8_t amd_recipe_emulated(AmdArch a, float x, Fp8Format f, bool nz) {
  return a == AmdArch::gfx942 ? amd_recipe_emulated<AmdArch::gfx942>(x, f, nz)
                              : amd_recipe_emulated<AmdArch::gfx950>(x, f, nz);
}

// Compares two byte arrays; one check, with the first mismatches printed.
void expect_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                  const std::vector<float>& in, const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i] && ++bad <= 5) {
      uint32_t bits;
      std::memcpy(&bits, &in[i], 4);
      std::printf("  %s: index %zu input %g (0x%08x): got 0x%02x want 0x%02x\n", what.c_str(), i,
                  double(in[i]), bits, got[i], want[i]);
    }
  }
  check(bad == 0 && got.size() == want.size(),
        what + ": " + std::to_string(bad) + " of " + std::to_string(want.size()) + " bytes differ");
}

std::vector<float> all_bf16_values() {
  std::vector<float> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = bf16_to_f32(uint16_t(i));
  return v;
}

std::vector<float> all_f16_values() {
  std::vector<float> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = f16_to_f32(uint16_t(i));
  return v;
}

std::vector<float> random_f32_values() {
  const std::vector<uint8_t> raw = gpu_test::read_file(gpu_test::data_path("random_f32.f32"));
  std::vector<float> v(raw.size() / 4);
  std::memcpy(v.data(), raw.data(), v.size() * 4);
  return v;
}

// Values where conversions go wrong: zeros, infinities, NaNs (quiet, signalling, either
// sign, with payloads), fp32 extremes and denormals, and for each format its largest
// finite value, the values around it and the rounding boundary above it, and its
// smallest subnormal with the values around half of it.
std::vector<float> special_values() {
  const auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  std::vector<float> v = {0.0f,
                          std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          from_bits(0x007fffffu),
                          1.0f,
                          0.5f};
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0x7fa00000u}) v.push_back(from_bits(nan));
  for (Fp8Format f : kFormats) {
    const Fp8Spec sp = fp8_spec(f);
    const float mx = fp8_max_finite(f);
    const float ulp_top = std::ldexp(1.0f, int(std::floor(std::log2(mx))) - sp.mant_bits);
    const float sub = std::ldexp(1.0f, 1 - sp.bias - sp.mant_bits);
    for (float x : {mx, mx + ulp_top / 2, mx + ulp_top, 2 * mx, mx * 0.5f, sub, sub / 2, sub * 0.75f,
                    sub * 0.25f, sub * 1.5f, sub * 2.5f}) {
      v.push_back(x);
      v.push_back(std::nextafter(x, 0.0f));
      v.push_back(std::nextafter(x, std::numeric_limits<float>::infinity()));
    }
  }
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);  // the same with the sign bit set
  while (v.size() % 4) v.push_back(0.0f);             // convert_on_gpu works in fours
  return v;
}

std::vector<uint8_t> reference(const std::vector<float>& in, Fp8Format f) {
  std::vector<uint8_t> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = fp8_encode(in[i], f);
  return out;
}

void test_amd_recipe_emulated() {
  struct Set {
    const char* name;
    std::vector<float> values;
  };
  std::vector<Set> sets = {{"all bf16", all_bf16_values()},
                           {"all f16", all_f16_values()},
                           {"random f32", random_f32_values()},
                           {"special values", special_values()}};
  // Scaled inputs as the kernels produce them: x * (1/scale) for a few scales.
  std::vector<float> scaled;
  for (float s : {0.37f, 2.9f, 1.0f / 64.0f}) {
    const float inv = 1.0f / s;
    for (float x : sets[0].values) scaled.push_back(x * inv);
  }
  sets.push_back({"all bf16 * (1/scale)", scaled});

  for (const Set& set : sets) {
    // The emulator itself must agree with the reference where FNUZ e4m3 saturation
    // does not come in (|x| <= 240): otherwise the recipe checks below mean nothing.
    size_t emu_bad = 0;
    for (float x : set.values) {
      if (std::fabs(x) <= 240.0f &&
          emulate_gfx942_cvt(x, false, false) != fp8_encode(x, Fp8Format::e4m3fnuz)) {
        ++emu_bad;
      }
    }
    check(emu_bad == 0, std::string("gfx942 emulator vs fp8_encode(e4m3fnuz) in range, ") + set.name + ": " +
                            std::to_string(emu_bad) + " differ");
    // Likewise the gfx950 emulator against the OCP formats' reference, where saturation
    // does not come in (|x| <= max finite; -0 written as 0x80, as OCP keeps it).
    size_t emu950_bad = 0;
    for (float x : set.values) {
      for (Fp8Format f : {Fp8Format::e4m3fn, Fp8Format::e5m2}) {
        if (std::fabs(x) <= fp8_max_finite(f) &&
            emulate_gfx950_cvt(x, f == Fp8Format::e5m2, true) != fp8_encode(x, f)) {
          ++emu950_bad;
        }
      }
    }
    check(emu950_bad == 0, std::string("gfx950 emulator vs fp8_encode(e4m3fn, e5m2) in range, ") + set.name +
                               ": " + std::to_string(emu950_bad) + " differ");
    for (AmdArch arch : {AmdArch::gfx942, AmdArch::gfx950}) {
      for (Fp8Format f : recipe_formats(arch)) {
        for (bool nz : {false, true}) {
          std::vector<uint8_t> got(set.values.size());
          for (size_t i = 0; i < got.size(); ++i) got[i] = amd_recipe_emulated(arch, set.values[i], f, nz);
          expect_bytes(got, reference(set.values, f), set.values,
                       std::string("AMD recipe (emulated ") + arch_name(arch) + ", -0 as " +
                           (nz ? "0x80" : "0x00") + ") " + format_name(f) + ", " + set.name);
        }
      }
    }
  }
}

template <Fp8Format F>
__global__ void convert_kernel(const float* in, int64_t n, uint32_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i * 4 < n) out[i] = gpu::cvt_fp8x4<F>(in[4 * i], in[4 * i + 1], in[4 * i + 2], in[4 * i + 3]);
}

std::vector<uint8_t> convert_on_gpu(const std::vector<float>& in, Fp8Format f) {
  const int64_t n = int64_t(in.size());  // a multiple of 4 for every set used here
  gpu_test::DeviceMem d_in(n * 4), d_out(n);
  d_in.upload(in.data(), n * 4);
  const unsigned grid = gpu::grid_blocks(n / 4, 256);
  switch (f) {
    case Fp8Format::e4m3fn:
      convert_kernel<Fp8Format::e4m3fn><<<grid, 256>>>(d_in.get<float>(), n, d_out.get<uint32_t>());
      break;
    case Fp8Format::e4m3fnuz:
      convert_kernel<Fp8Format::e4m3fnuz><<<grid, 256>>>(d_in.get<float>(), n, d_out.get<uint32_t>());
      break;
    case Fp8Format::e5m2:
      convert_kernel<Fp8Format::e5m2><<<grid, 256>>>(d_in.get<float>(), n, d_out.get<uint32_t>());
      break;
  }
  KVFUSE_TEST_GPU(cudaGetLastError());
  return d_out.download<uint8_t>(size_t(n));
}

void test_device_conversion() {
  const std::vector<float> special = special_values();
  for (Fp8Format f : kFormats) {
    expect_bytes(convert_on_gpu(special, f), reference(special, f), special,
                 std::string("GPU ") + format_name(f) + ", special values vs fp8_encode");
  }
  const std::vector<float> bf16 = all_bf16_values();
  const std::vector<float> f16 = all_f16_values();
  const std::vector<float> rnd = random_f32_values();
  const auto file = [](const char* name) { return gpu_test::read_file(gpu_test::data_path(name)); };

  expect_bytes(convert_on_gpu(bf16, Fp8Format::e4m3fn), file("all_bf16.e4m3fn_satfinite.u8"), bf16,
               "GPU e4m3fn, all bf16 vs H200 cvt.rn.satfinite file");
  expect_bytes(convert_on_gpu(bf16, Fp8Format::e5m2), file("all_bf16.e5m2_satfinite.u8"), bf16,
               "GPU e5m2, all bf16 vs H200 cvt.rn.satfinite file");
  expect_bytes(convert_on_gpu(rnd, Fp8Format::e4m3fn), file("random_f32.e4m3fn_satfinite.u8"), rnd,
               "GPU e4m3fn, random f32 vs H200 cvt.rn.satfinite file");
  expect_bytes(convert_on_gpu(rnd, Fp8Format::e5m2), file("random_f32.e5m2_satfinite.u8"), rnd,
               "GPU e5m2, random f32 vs H200 cvt.rn.satfinite file");
  for (Fp8Format f : kFormats) {
    expect_bytes(convert_on_gpu(bf16, f), reference(bf16, f), bf16,
                 std::string("GPU ") + format_name(f) + ", all bf16 vs fp8_encode");
    expect_bytes(convert_on_gpu(f16, f), reference(f16, f), f16,
                 std::string("GPU ") + format_name(f) + ", all f16 vs fp8_encode");
    expect_bytes(convert_on_gpu(rnd, f), reference(rnd, f), rnd,
                 std::string("GPU ") + format_name(f) + ", random f32 vs fp8_encode");
  }
}

}  // namespace

int main() {
  test_amd_recipe_emulated();
  if (gpu_test::gpu_available("test_fp8_convert_gpu")) test_device_conversion();
  return gpu_test::tally().report("test_fp8_convert_gpu");
}
