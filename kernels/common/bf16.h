// bf16 and fp16 stored as raw 16-bit patterns, converted with round-to-nearest-even.
// Raw patterns keep these headers free of vendor types, so the CPU reference and the
// GPU kernels read and write exactly the same bits.
#pragma once

#include "kernels/common/host_device.h"

namespace kvfuse {

using bf16_t = uint16_t;  // bfloat16 bit pattern
using f16_t = uint16_t;   // IEEE binary16 bit pattern

KVFUSE_HD float bf16_to_f32(bf16_t h) { return f32_from_bits(uint32_t(h) << 16); }

KVFUSE_HD bf16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t((u >> 16) | 0x40u);  // quiet NaN, keep sign
  u += 0x7fffu + ((u >> 16) & 1u);                                        // round to nearest even
  return bf16_t(u >> 16);
}

// IEEE half -> float, exact for every pattern.
KVFUSE_HD float f16_to_f32(f16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float mag = float(man) * 5.9604644775390625e-8f;
    return f32_from_bits(f32_bits(mag) | sign);
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

// float -> IEEE half, round to nearest even, overflow to inf (used by tests and inputs only).
KVFUSE_HD f16_t f32_to_f16(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return f16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                               // below 2^-14: subnormal or zero
    // value / 2^-24, rounded to nearest even as an integer
    const float scaled = f32_from_bits(a) * 16777216.0f;
    const uint32_t i = uint32_t(scaled);
    const float frac = scaled - float(i);
    uint32_t r = i + ((frac > 0.5f || (frac == 0.5f && (i & 1u))) ? 1u : 0u);
    return f16_t(sign | r);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  r = (r >> 13) - (112u << 10);
  return f16_t(sign | r);
}

}  // namespace kvfuse
