// CPU reference of the elementwise and row ops. bf16 in memory, fp32 arithmetic, one
// rounding to bf16 per result (see ops.h).
#include "kernels/cpu/ops/ops.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops/rope_rows.h"

namespace kvfuse::cpu {

// size_t of a (non-negative) count; a function call, not a cast, so vector
// declarations like v(sz(n)) do not parse as function declarations.
namespace {
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }
}  // namespace

// The scalar conversions, overloaded beside the bulk ones declared in ops.h.
using kvfuse::bf16_to_f32;
using kvfuse::f32_to_bf16;

void embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden, bf16_t* out) {
  for (int64_t i = 0; i < n; ++i)
    memcpy(out + i * hidden, table + int64_t(ids[i]) * hidden, sz(hidden) * sizeof(bf16_t));
}

void rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps, bf16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16_t* xr = x + r * cols;
    bf16_t* o = out + r * cols;
    float ss = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bf16_to_f32(xr[c]);
      ss += v * v;
    }
    const float inv_rms = 1.0f / std::sqrt(ss / float(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) o[c] = f32_to_bf16(bf16_to_f32(xr[c]) * inv_rms * bf16_to_f32(w[c]));
  }
}

void rope_neox(bf16_t* q, int64_t q_token_stride, int32_t q_heads, bf16_t* k, int64_t k_token_stride,
               int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n, const float* inv_freq,
               float attention_scaling) {
  const int32_t half = head_dim / 2;
  std::vector<float> cos_t(sz(half)), sin_t(sz(half));
  for (int64_t t = 0; t < n; ++t) {
    rope_cos_sin(positions[t], inv_freq, half, attention_scaling, cos_t.data(), sin_t.data());
    rope_rotate_heads(q + t * q_token_stride, q_heads, head_dim, cos_t.data(), sin_t.data());
    rope_rotate_heads(k + t * k_token_stride, kv_heads, head_dim, cos_t.data(), sin_t.data());
  }
}

void silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) {
  for (int64_t t = 0; t < n; ++t) {
    const bf16_t* gate = gate_up + t * 2 * inter;
    const bf16_t* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = bf16_to_f32(gate[i]);
      out[t * inter + i] = f32_to_bf16(g / (1.0f + std::exp(-g)) * bf16_to_f32(up[i]));
    }
  }
}

void residual_add(bf16_t* x, const bf16_t* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

void bf16_to_f32(const bf16_t* x, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = kvfuse::bf16_to_f32(x[i]);
}

void f32_to_bf16(const float* x, int64_t count, bf16_t* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = kvfuse::f32_to_bf16(x[i]);
}

}  // namespace kvfuse::cpu
