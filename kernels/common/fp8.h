// FP8 formats of the KV cache: encode from fp32 and decode to fp32.
//
// Encoding follows docs/design.md#fp8-encoding-and-saturation and NVIDIA's cvt.rn.satfinite: round to nearest, ties to
// even; finite values beyond the largest finite value and +-inf saturate to +-max
// finite; NaN becomes the format's canonical NaN. This header is the CPU reference
// that defines the cache bytes, and GPU kernels include it for their scalar fallback,
// so every path agrees bit for bit.
//
//   format     bias  max finite  NaN         inf   -0
//   e4m3fn       7      448      0x7f/0xff   none  0x80
//   e4m3fnuz     8      240      0x80 only   none  none (0x80 is NaN)
//   e5m2        15    57344      0x7d..0x7f  0x7c  0x80
#pragma once

#include "kernels/common/host_device.h"

namespace kvfuse {

enum class Fp8Format : uint8_t { e4m3fn, e4m3fnuz, e5m2 };

// How the input activations of a linear layer with FP8 weights are quantized: not at all
// (W8A16), with one static scale (the checkpoint's input_scale), or with a scale per token
// row computed from its largest magnitude. The contract: kernels/cpu/gemm/gemm_fp8.h.
enum class Fp8Act : uint8_t { none, static_tensor, dynamic_token };
// The smallest dynamic per-row activation scale, 1 / (448 * 512), for every format: it
// keeps an all-zero row well defined (scale this, every code 0). CPU and GPU quantizers
// both clamp to it (kernels/cpu/gemm/gemm_fp8.h, kernels/gemm/gemv_fp8.cuh).
constexpr float kFp8MinActScale = 1.0f / (448.0f * 512.0f);

// An e4m3fn code as the e4m3fnuz code of half its value (the FNUZ grid is the OCP grid
// halved, same bits), so fnuz bytes with scale 2 * s dequantize to
// the same fp32 values as the fn bytes with scale s (src/loading/kv_scales.h makes the
// same choice for KV scales). Exact: -0 (0x80, the FNUZ NaN) becomes +0; the fn NaNs
// (0x7f, 0xff) become the FNUZ NaN 0x80; every other code keeps its bits.
constexpr uint8_t fp8_e4m3fn_to_fnuz(uint8_t b) {
  if (b == 0x80) return 0x00;
  if ((b & 0x7f) == 0x7f) return 0x80;
  return b;
}

struct Fp8Spec {
  int mant_bits;
  int bias;
  uint32_t max_code;  // code of the largest finite positive value
  uint8_t nan_code;   // canonical NaN written for any NaN input
  bool fnuz;          // no negative zero: 0x80 is the only NaN
  bool has_inf;
};

KVFUSE_HD Fp8Spec fp8_spec(Fp8Format f) {
  switch (f) {
    case Fp8Format::e4m3fnuz:
      return {3, 8, 0x7f, 0x80, true, false};
    case Fp8Format::e5m2:
      return {2, 15, 0x7b, 0x7f, false, true};
    case Fp8Format::e4m3fn:
    default:
      return {3, 7, 0x7e, 0x7f, false, false};
  }
}

KVFUSE_HD float fp8_max_finite(Fp8Format f) {
  switch (f) {
    case Fp8Format::e4m3fnuz:
      return 240.0f;
    case Fp8Format::e5m2:
      return 57344.0f;
    case Fp8Format::e4m3fn:
    default:
      return 448.0f;
  }
}

// Round to nearest even and saturate. Works on the fp32 bit pattern so the result does
// not depend on the host's floating-point rounding mode or flush-to-zero settings.
KVFUSE_HD uint8_t fp8_encode(float x, Fp8Format f) {
  const Fp8Spec s = fp8_spec(f);
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 31) << 7;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return s.nan_code;
  const int shift = 23 - s.mant_bits;
  const int emin = 1 - s.bias;  // exponent of the smallest normal
  uint32_t code;
  if (a >= uint32_t(127 + emin) << 23) {
    // Normal range: round the fp32 significand to mant_bits, then rebias the exponent.
    // A carry out of the significand moves into the exponent, as it should.
    const uint32_t rounded = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    code = rounded - (uint32_t(127 - s.bias) << s.mant_bits);
    if (a >= 0x7f800000u || code > s.max_code) code = s.max_code;  // +-inf and overflow
  } else {
    // Subnormal range: the code is |x| in units of the smallest subnormal 2^(emin-M),
    // rounded to nearest even. The fp32 exponent e (biased) gives |x| = sig * 2^(e-150),
    // with sig the 24-bit significand (implicit bit included for normals).
    const uint32_t e = a >> 23;
    const uint32_t sig = e ? ((a & 0x7fffffu) | 0x800000u) : (a & 0x7fffffu);
    // |x| / 2^(emin-M) = sig * 2^(e' - 150 - emin + M), with e' = max(e, 1).
    const int rshift = 150 + emin - s.mant_bits - int(e ? e : 1);  // >= 1 here
    if (rshift >= 32) {
      code = 0;
    } else {
      const uint32_t q = sig >> rshift;
      const uint32_t rem = sig & ((1u << rshift) - 1u);
      const uint32_t half = 1u << (rshift - 1);
      code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    }
  }
  if (code == 0 && s.fnuz) return 0;  // FNUZ has no -0: 0x80 is its NaN
  return uint8_t(sign | code);
}

KVFUSE_HD bool fp8_is_nan(uint8_t c, Fp8Format f) {
  switch (f) {
    case Fp8Format::e4m3fnuz:
      return c == 0x80;
    case Fp8Format::e5m2:
      return (c & 0x7f) > 0x7c;
    case Fp8Format::e4m3fn:
    default:
      return (c & 0x7f) == 0x7f;
  }
}

KVFUSE_HD float fp8_decode(uint8_t c, Fp8Format f) {
  const Fp8Spec s = fp8_spec(f);
  if (fp8_is_nan(c, f)) return f32_from_bits(0x7fc00000u);
  const uint32_t sign = uint32_t(c >> 7) << 31;
  const int exp_bits = 7 - s.mant_bits;
  const uint32_t e = (c >> s.mant_bits) & ((1u << exp_bits) - 1u);
  const uint32_t m = c & ((1u << s.mant_bits) - 1u);
  if (s.has_inf && e == (1u << exp_bits) - 1u) return f32_from_bits(sign | 0x7f800000u);
  if (e == 0) {
    // m * 2^(1 - bias - M): exact in fp32 (a small integer times a power of two).
    const float mag = float(m) * f32_from_bits(uint32_t(127 + 1 - s.bias - s.mant_bits) << 23);
    return f32_from_bits(f32_bits(mag) | sign);
  }
  return f32_from_bits(sign | ((e - uint32_t(s.bias) + 127u) << 23) | (m << (23 - s.mant_bits)));
}

}  // namespace kvfuse
