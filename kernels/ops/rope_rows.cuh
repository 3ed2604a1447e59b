// The pieces of RoPE and of the fused write's conversion that the KV write with RoPE
// (kernels/kv_write/kv_write_rope.cu) and the attention kernel that takes that write in
// (kernels/attention/attention_unified.cu, AttnRope) share, so that both give the same bits: the
// angle's cos and sin (rope_kernel's too, kernels/ops/model_ops.cu), the rotation of a pair of
// 8-element runs with one bf16 rounding, eight bf16 to the cache's format, and the stores
// of a rotated K pair and a V chunk into a cache row.
#pragma once

#include <cstdint>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/common/gpu.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu::rope_rows {

// Elements of one side of a rotated pair: one 16-byte load of bf16.
constexpr int kPairElems = 8;
// Elements of a V chunk: two 16-byte loads of bf16, one 16-byte FP8 store.
constexpr int kVChunkElems = 16;

// cos and sin of pair i's angle at position pos: one expression for rope_kernel, the KV write
// with RoPE and attention's write.
KVFUSE_DEVICE void cos_sin(int32_t pos, float inv_freq, float attention_scaling, float& c, float& s) {
  const float angle = float(pos) * inv_freq;
  c = cosf(angle) * attention_scaling;
  s = sinf(angle) * attention_scaling;
}

// Eight bf16 to the cache's format: FP8 bytes of x * inv (the fused write's conversion),
// 8 bytes; unused for bf16 caches, which store the bf16 bits.
template <KvFormat F>
KVFUSE_DEVICE uint2 bf16x8_to_fp8(uint4 raw, float inv) {
  float x[8];
  widen_bf16x8(raw, x);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] *= inv;
  constexpr Fp8Format f = kv_fp8_format(F);
  return make_uint2(cvt_fp8x4<f>(x[0], x[1], x[2], x[3]), cvt_fp8x4<f>(x[4], x[5], x[6], x[7]));
}

// Rotates lo (elements c0 .. c0+7 of a head) with hi (the same of its second half):
// x0 c - x1 s and x1 c + x0 s in fp32, every product and sum rounded on its own (never
// contracted into a multiply-add, whose choice the compiler makes per kernel: the kernels
// that share this give the same bits), then one bf16 rounding each.
KVFUSE_DEVICE void rotate_pair(uint4 lo, uint4 hi, const float* cos_t, const float* sin_t, int c0,
                               uint16_t (&lo_out)[8], uint16_t (&hi_out)[8]) {
  float x0[8], x1[8];
  widen_bf16x8(lo, x0);
  widen_bf16x8(hi, x1);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float c = cos_t[c0 + e], s = sin_t[c0 + e];
    lo_out[e] = f32_to_bf16(sub_rn(mul_rn(x0[e], c), mul_rn(x1[e], s)));
    hi_out[e] = f32_to_bf16(add_rn(mul_rn(x1[e], c), mul_rn(x0[e], s)));
  }
}

// A rotated K pair (lo4: elements e0 .. e0+7 of the row, hi4: e0 + half ..; bf16 bits)
// into the cache row `dst`: FP8 bytes of x * inv_k, 8 bytes each, or for a bf16 cache the
// rounded bits as the fused write copies them.
template <KvFormat F>
KVFUSE_DEVICE void store_k_pair(uint8_t* dst, int64_t e0, int half, uint4 lo4, uint4 hi4, float inv_k) {
  if constexpr (F != KvFormat::bf16) {
    *reinterpret_cast<uint2*>(dst + e0) = bf16x8_to_fp8<F>(lo4, inv_k);
    *reinterpret_cast<uint2*>(dst + e0 + half) = bf16x8_to_fp8<F>(hi4, inv_k);
  } else {
    store_16B(dst + 2 * e0, lo4);
    store_16B(dst + 2 * (e0 + half), hi4);
  }
}

// A V chunk (x0, x1: elements e0 .. e0+15 of the row, bf16) into the cache row `dst`: one
// 16-byte store of FP8 bytes of x * inv_v, or for a bf16 cache a bit copy (NaN payloads
// included).
template <KvFormat F>
KVFUSE_DEVICE void store_v_chunk(uint8_t* dst, int64_t e0, uint4 x0, uint4 x1, float inv_v) {
  if constexpr (F != KvFormat::bf16) {
    const uint2 a = bf16x8_to_fp8<F>(x0, inv_v), b = bf16x8_to_fp8<F>(x1, inv_v);
    store_16B(dst + e0, make_uint4(a.x, a.y, b.x, b.y));
  } else {
    store_16B(dst + 2 * e0, x0);
    store_16B(dst + 2 * e0 + 16, x1);
  }
}

}  // namespace kvfuse::gpu::rope_rows
