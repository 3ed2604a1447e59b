// One token's NeoX rotation, the arithmetic of rope_neox (kernels/cpu/ops/ops.h) in one place:
// the KV write that rotates K on its way into the cache (kv_write_rope,
// kernels/cpu/kv_write/kv_write.h) calls these same functions, so its rows are rope's bit for bit
// rather than a second copy of the formula that would have to be kept in step.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/bf16.h"

namespace kvfuse::cpu {

// cos_t[i], sin_t[i] of the pair (i, i + half) at `position`: the angle is the fp32
// product float(position) * inv_freq[i], as a GPU kernel computes it (the table itself
// was rounded once from double, src/loading/rope.h), and cos and sin are each multiplied
// by attention_scaling.
inline void rope_cos_sin(int32_t position, const float* inv_freq, int32_t half, float attention_scaling,
                         float* cos_t, float* sin_t) {
  const float pos = float(position);
  for (int32_t i = 0; i < half; ++i) {
    const float angle = pos * inv_freq[i];
    cos_t[i] = std::cos(angle) * attention_scaling;
    sin_t[i] = std::sin(angle) * attention_scaling;
  }
}

// Rotates each head of one token's row in place: (x_i, x_{i+D/2}) by the pair's angle,
// fp32 arithmetic, one bf16 rounding per result. (Qualified: kernels/cpu/ops/ops.h declares
// bulk conversions of the same names in this namespace.)
inline void rope_rotate_heads(bf16_t* row, int32_t heads, int32_t head_dim, const float* cos_t,
                              const float* sin_t) {
  const int32_t half = head_dim / 2;
  for (int32_t h = 0; h < heads; ++h) {
    bf16_t* x = row + int64_t(h) * head_dim;
    for (int32_t i = 0; i < half; ++i) {
      const float a = kvfuse::bf16_to_f32(x[i]), b = kvfuse::bf16_to_f32(x[i + half]);
      x[i] = kvfuse::f32_to_bf16(a * cos_t[i] - b * sin_t[i]);
      x[i + half] = kvfuse::f32_to_bf16(b * cos_t[i] + a * sin_t[i]);
    }
  }
}

}  // namespace kvfuse::cpu
