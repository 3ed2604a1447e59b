// Pieces of the mma.sync block kernel (kernels/attention/attention_unified.cu): the
// whole-block search for a token's sequence (block_rows' FindSeq,
// kernels/attention/attention_params.h), the per-tile steps of a group's online softmax
// (the scores S^T = K Q^T, the softmax update, O^T += V^T P^T) and the load of the
// partial results of the split path's merge. The tiling and the numerics:
// kernels/attention/attention_tile.cuh. Everything is inlined into the kernel: the state
// stays the kernel's variables (OnlineSoftmax is a view of them), shared memory stays
// declared there.
#pragma once

#include "kernels/common/gpu.h"

#include <cmath>
#include <cstdint>

#include "kernels/attention/attention_tile.cuh"

namespace kvfuse::gpu::attention_detail {

// The last s with query_start[s] <= tok, found by the whole block in one round per
// kThreads sequences (query_start is non-decreasing).
struct BlockFindSeq {
  KVFUSE_DEVICE int32_t operator()(const int32_t* query_start, int32_t num_seqs, int64_t tok) const {
    int32_t count = 0;
    for (int32_t s0 = 0; s0 < num_seqs; s0 += kThreads) {
      const int32_t s = s0 + int32_t(threadIdx.x);
      count += __syncthreads_count(s < num_seqs && query_start[s] <= tok);
    }
    return count - 1;
  }
};

// A partial result another block of this kernel wrote: a volatile load, never served
// from this multiprocessor's L1.
struct L2Load {
  KVFUSE_HD float operator()(const float* p) const { return *static_cast<const volatile float*>(p); }
};

// S^T = K Q^T for one tile (reads r.k only), over two accumulators (even and odd chunks)
// to halve the dependent MMA chain. sm_q: the Q fragment, [chunk][lane]; l: the lane.
template <int D, KvKind K>
KVFUSE_DEVICE void tile_scores(const Raw<D, K>& r, const uint2 (&sm_q)[Geo<D, K>::kChunks][kMmaLanes], int l,
                               float (&s)[4]) {
  using Gm = Geo<D, K>;
  float s2[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int j = 0; j < Gm::kChunks; ++j) {
    uint32_t af[4];
    if constexpr (Gm::kBf16) {
      af[0] = r.k[0][2 * j];
      af[2] = r.k[0][2 * j + 1];
      af[1] = r.k[1][2 * j];
      af[3] = r.k[1][2 * j + 1];
    } else {
      fp8x4_to_f16x2<K>(r.k[0][j], af[0], af[2]);
      fp8x4_to_f16x2<K>(r.k[1][j], af[1], af[3]);
    }
    const uint2 q2 = sm_q[j][l];
    const uint32_t qb[2] = {q2.x, q2.y};
    mma_16816<Gm::kBf16>(s2[j & 1], af, qb);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = s2[0][i] + s2[1][i];
}

// One group's online softmax over its tiles, as lane (g, c) of the group holds it: a
// view of the kernel's variables. The state: the output accumulators O^T (rows 2c, 2c+1
// of the lane's D/8 dimensions; acc[j] is m16 tile j of PV), the running max and sum of
// rows 2c, 2c+1. The rows' masks: their score factors, the keys they see ([rlo, rhi]),
// and the keys every row of the block sees ([full_lo, full_hi]: tiles inside need no
// mask).
template <int D, KvKind K>
struct OnlineSoftmax {
  using Gm = Geo<D, K>;
  static constexpr bool kBf16 = Gm::kBf16;
  float (&acc)[Gm::kChunks][4];
  float (&m)[2];
  float (&lsum)[2];
  const float (&fac)[2];
  const int32_t (&rlo)[2];
  const int32_t (&rhi)[2];
  const int32_t &full_lo, &full_hi;
  const int &g, &c;

  // The update by tile t0's scores s; returns the P^T fragments (hi, lo).
  KVFUSE_DEVICE void update(const float (&s)[4], int32_t t0, uint32_t (&ph)[2], uint32_t (&pl)[2]) const {
    // s: (key g, row 2c), (key g, row 2c+1), (key g+8, row 2c), (key g+8, row 2c+1)
    float x[4] = {s[0] * fac[0], s[1] * fac[1], s[2] * fac[0], s[3] * fac[1]};
    if (t0 < full_lo || t0 + kTileKeys - 1 > full_hi) {  // a tile some row sees only in part
      const int32_t ka = t0 + g, kb = t0 + g + 8;
      x[0] = (ka >= rlo[0] && ka <= rhi[0]) ? x[0] : -INFINITY;
      x[1] = (ka >= rlo[1] && ka <= rhi[1]) ? x[1] : -INFINITY;
      x[2] = (kb >= rlo[0] && kb <= rhi[0]) ? x[2] : -INFINITY;
      x[3] = (kb >= rlo[1] && kb <= rhi[1]) ? x[3] : -INFINITY;
    }
    float tmax[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
#pragma unroll
    for (int off = 4; off < kMmaLanes; off *= 2) {
      tmax[0] = fmaxf(tmax[0], warp_shfl_xor(tmax[0], off));
      tmax[1] = fmaxf(tmax[1], warp_shfl_xor(tmax[1], off));
    }
    float mu[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float mn = fmaxf(m[i], tmax[i]);
      mu[i] = mn == -INFINITY ? 0.0f : mn;  // no visible key yet: keep everything at 0
      corr[i] = exp2f(m[i] - mu[i]);
      m[i] = mn;
    }
    const float p0 = exp2f(x[0] - mu[0]), p1 = exp2f(x[1] - mu[1]);
    const float p2 = exp2f(x[2] - mu[0]), p3 = exp2f(x[3] - mu[1]);
    lsum[0] = lsum[0] * corr[0] + (p0 + p2);
    lsum[1] = lsum[1] * corr[1] + (p1 + p3);
    if (corr[0] != 1.0f || corr[1] != 1.0f) {  // a running max moved (rare after the first tiles)
#pragma unroll
      for (int j = 0; j < Gm::kChunks; ++j) {
        acc[j][0] *= corr[0];
        acc[j][1] *= corr[1];
        acc[j][2] *= corr[0];
        acc[j][3] *= corr[1];
      }
    }
    // P^T (B of O^T += V^T P^T): lane (g, c) needs P[keys 2c, 2c+1, 2c+8, 2c+9][row g],
    // held by lanes (2c, g/2) and (2c+1, g/2) as pairs over rows: two shuffles and a
    // byte permute per register, for the hi and the lo part.
    const uint32_t xh = pack_rn<kBf16>(p0, p1), yh = pack_rn<kBf16>(p2, p3);
    const uint32_t xl = pack_rn<kBf16>(p0 - half_lo<kBf16>(xh), p1 - half_hi<kBf16>(xh));
    const uint32_t yl = pack_rn<kBf16>(p2 - half_lo<kBf16>(yh), p3 - half_hi<kBf16>(yh));
    const int src_a = 8 * c + (g >> 1), src_b = src_a + 4;
    const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
    ph[0] = byte_perm(group_shfl(xh, src_a), group_shfl(xh, src_b), sel);
    ph[1] = byte_perm(group_shfl(yh, src_a), group_shfl(yh, src_b), sel);
    pl[0] = byte_perm(group_shfl(xl, src_a), group_shfl(xl, src_b), sel);
    pl[1] = byte_perm(group_shfl(yl, src_a), group_shfl(yl, src_b), sel);
  }

  // O^T += V^T P^T (reads r.v only).
  KVFUSE_DEVICE void accumulate(const Raw<D, K>& r, const uint32_t (&ph)[2], const uint32_t (&pl)[2]) const {
    // V^T fragment of m16 tile j: rows g, g+8 are dimensions 2j, 2j+1 of the lane's D/8,
    // columns the keys 2c, 2c+1 (regs 0, 1) and 2c+8, 2c+9 (regs 2, 3).
#pragma unroll
    for (int j = 0; j < Gm::kChunks; ++j) {
      uint32_t af[4];
      if constexpr (kBf16) {
        af[0] = byte_perm(r.v[0][j], r.v[1][j], 0x5410u);
        af[1] = byte_perm(r.v[0][j], r.v[1][j], 0x7632u);
        af[2] = byte_perm(r.v[2][j], r.v[3][j], 0x5410u);
        af[3] = byte_perm(r.v[2][j], r.v[3][j], 0x7632u);
      } else {
        const uint32_t pick = (j & 1) ? 0x7362u : 0x5140u;  // bytes {a, b, a', b'} of two keys
        fp8x4_to_f16x2<K>(byte_perm(r.v[0][j >> 1], r.v[1][j >> 1], pick), af[0], af[1]);
        fp8x4_to_f16x2<K>(byte_perm(r.v[2][j >> 1], r.v[3][j >> 1], pick), af[2], af[3]);
      }
      mma_16816<kBf16>(acc[j], af, ph);
      mma_16816<kBf16>(acc[j], af, pl);
    }
  }
};

}  // namespace kvfuse::gpu::attention_detail
