// Eight bf16 in one 16-byte vector (element 2i in the low half of word i), as the
// kernels' vector paths load and store them: widened exactly to fp32, and packed back
// from bf16 bits or from fp32 with one rounding each. A vector path built on these gives
// its scalar path's bits.
#pragma once

#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

KVFUSE_DEVICE void widen_bf16x8(uint4 raw, float* x) {  // x[0 .. 8)
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

KVFUSE_DEVICE uint4 pack_bf16x8(const uint16_t (&b)[8]) {
  return make_uint4(uint32_t(b[0]) | (uint32_t(b[1]) << 16), uint32_t(b[2]) | (uint32_t(b[3]) << 16),
                    uint32_t(b[4]) | (uint32_t(b[5]) << 16), uint32_t(b[6]) | (uint32_t(b[7]) << 16));
}

KVFUSE_DEVICE uint4 pack_bf16x8(const float (&f)[8]) {
  uint16_t b[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = f32_to_bf16(f[i]);
  return pack_bf16x8(b);
}

}  // namespace kvfuse::gpu
