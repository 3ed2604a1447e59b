// CPU reference of the model's elementwise and row ops. Activations are bf16 in
// memory, arithmetic is fp32, each result is rounded to bf16 once: the same contract
// as the GPU kernels, so CPU and GPU engines differ only by summation order.
#pragma once

#include "kernels/common/bf16.h"

namespace kvfuse::cpu {

// out[i, :] = table[ids[i], :]; ids must be in [0, vocab).
void embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden, bf16_t* out);

// out = x / sqrt(mean(x^2) + eps) * w, per row of `cols`.
void rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps, bf16_t* out);

// Neox-style rotary embedding in place on q [n, q_heads, head_dim] and
// k [n, kv_heads, head_dim] (rows with token strides): the pair (i, i + head_dim/2)
// rotates by the fp32 angle float(pos) * inv_freq[i], with cos and sin each multiplied
// by attention_scaling (transformers' post-processing factor: yarn's mscale, else 1,
// where the product is exact). inv_freq [head_dim/2] is the model's frequency table
// (src/loading/rope.h builds it; plain RoPE: float(theta^(-2i/head_dim)) rounded from
// double).
void rope_neox(bf16_t* q, int64_t q_token_stride, int32_t q_heads, bf16_t* k, int64_t k_token_stride,
               int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n, const float* inv_freq,
               float attention_scaling);

// gate_up: [n, 2 * inter] (gate then up); out[n, inter] = silu(gate) * up.
void silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out);

// x += y, elementwise over `count` values.
void residual_add(bf16_t* x, const bf16_t* y, int64_t count);

// Converts bf16 to fp32 and back, elementwise.
void bf16_to_f32(const bf16_t* x, int64_t count, float* out);
void f32_to_bf16(const float* x, int64_t count, bf16_t* out);

}  // namespace kvfuse::cpu
