// RoPE and the KV write taken into the attention block kernel (p.rope_write; the
// contract: kernels/attention/attention.cuh, attention_rope_unsupported): which kernel
// instances take them in, and one block's share of a decode row. For the block kernel
// only (kernels/attention/attention_unified.cu).
#pragma once

#include "kernels/common/gpu.h"

#include <cstdint>

#include "kernels/attention/attention_tile.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/common/kv_types.h"
#include "kernels/ops/rope_rows.cuh"

namespace kvfuse::gpu::attention_detail {

// The cache format a kernel instance reads (KvKind also names the decode method).
template <KvKind K>
constexpr KvFormat kKindFormat = K == KvKind::bf16       ? KvFormat::bf16
                                 : K == KvKind::e4m3fnuz ? KvFormat::fp8_e4m3fnuz
                                 : K == KvKind::e5m2     ? KvFormat::fp8_e5m2
                                                         : KvFormat::fp8_e4m3fn;

// The instances that take RoPE and the KV write in (p.rope_write): the formats a CUDA
// engine writes, with the hardware e4m3fn decode, page-aligned tiles.
template <KvKind K>
constexpr bool kRopeKind = K == KvKind::bf16 || K == KvKind::e4m3fn_hw || K == KvKind::e5m2;

// p.rope_write: RoPE and the KV write of decode row `row0`, KV head kvh, done by one
// block. Every block rotates its G query heads into q_out (bf16 bits, [head][dim]); with
// slot >= 0 (the block that holds the row's own key, and a slot to write) it also
// rotates the K row, and writes K and V into the slot as kv_write_rope_kernel does: the
// same loads, rotation, rounding and conversion (kernels/ops/rope_rows.cuh), so the same
// bytes. cos_t/sin_t: the position's cos and sin (rope_rows::cos_sin).
template <int D, KvKind K>
KVFUSE_DEVICE void rope_write_row(const Params& p, int32_t row0, int32_t kvh, int32_t G, int64_t slot,
                                  const float* cos_t, const float* sin_t, uint16_t (*q_out)[D]) {
  using namespace rope_rows;
  constexpr KvFormat F = kKindFormat<K>;
  constexpr bool kFp8 = F != KvFormat::bf16;
  constexpr int kHalf = D / 2, kPairs = kHalf / kPairElems, kVChunks = D / kVChunkElems;
  const KvWriteRopeArgs& r = p.rope;
  const PagedKvView& cache = p.a.cache;
  const int nq = G * kPairs, nk = slot >= 0 ? kPairs : 0, nv = slot >= 0 ? kVChunks : 0;
  const bf16_t* q = r.q + int64_t(row0) * r.q_token_stride + int64_t(kvh) * G * D;
  const bf16_t* k =
      static_cast<const bf16_t*>(r.kv.k) + int64_t(row0) * r.kv.k_token_stride + int64_t(kvh) * D;
  const bf16_t* v =
      static_cast<const bf16_t*>(r.kv.v) + int64_t(row0) * r.kv.v_token_stride + int64_t(kvh) * D;
  const int64_t at = (slot * cache.num_kv_heads + kvh) * int64_t(D) * (kFp8 ? 1 : 2);  // bytes
  uint8_t* k_dst = static_cast<uint8_t*>(cache.k) + at;
  uint8_t* v_dst = static_cast<uint8_t*>(cache.v) + at;
  for (int it = int(threadIdx.x); it < nq + nk + nv; it += kThreads) {
    // The item's two 16-byte loads first, then the scales (their loads are ordered after).
    const bool pair = it < nq + nk, is_q = it < nq;
    const int j = is_q ? it : it - nq;
    const int c0 = pair ? (j % kPairs) * kPairElems : (it - nq - nk) * kVChunkElems;
    const bf16_t* src = is_q ? q + (j / kPairs) * D + c0 : pair ? k + c0 : v + c0;
    const uint4 x0 = *reinterpret_cast<const uint4*>(src);
    const uint4 x1 = *reinterpret_cast<const uint4*>(src + (pair ? kHalf : kVChunkElems / 2));
    float inv_k = 1.0f, inv_v = 1.0f;
    if constexpr (kFp8) {
      if (!is_q) load_inv_scales(cache, inv_k, inv_v);  // as the fused write, per token
    }
    if (pair) {
      uint16_t lo[8], hi[8];
      rotate_pair(x0, x1, cos_t, sin_t, c0, lo, hi);
      const uint4 lo4 = pack_bf16x8(lo), hi4 = pack_bf16x8(hi);
      if (is_q) {
        *reinterpret_cast<uint4*>(&q_out[j / kPairs][c0]) = lo4;
        *reinterpret_cast<uint4*>(&q_out[j / kPairs][c0 + kHalf]) = hi4;
      } else {
        store_k_pair<F>(k_dst, c0, kHalf, lo4, hi4, inv_k);
      }
    } else {
      store_v_chunk<F>(v_dst, c0, x0, x1, inv_v);
    }
  }
}

}  // namespace kvfuse::gpu::attention_detail
