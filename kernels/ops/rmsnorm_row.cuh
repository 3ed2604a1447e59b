// The RMSNorm's row on the GPU's 16-byte path, shared by the model's norm kernels
// (kernels/ops/model_ops.cu) and the tensor-parallel norm that sums pushed partials first
// (kernels/parallel/peer_allreduce.cu), so that both compute the same bits from the same
// inputs. Device code only; include after kernels/common/gpu.h.
#pragma once

#include "kernels/common/bf16.h"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

// Threads of a norm block, and 16-byte chunks of a row per thread: rows of up to
// 8 * kNormVec * kNormThreads bf16 (8192) take the vector path.
constexpr int kNormThreads = 256;
constexpr int kNormVec = 4;
constexpr int64_t kNormVecMaxCols = int64_t(8) * kNormVec * kNormThreads;

// 1 / sqrt(mean + eps) of a row from each thread's sum of squares `ss`, for every thread
// of the block: warp sums, then thread 0 adds the warps in order. partial: the block's
// kThreads / kWarpSize + 1 floats of shared memory, free again after the caller's next
// __syncthreads.
//
// The order differs from the CPU's sequential sum, and between vendors (warp_reduce's
// tree). All terms are >= 0, so each fp32 sum is within k * u of the exact one, k the
// additions on its longest path: cols for the CPU; cols / kThreads + log2(kWarpSize) +
// kThreads / kWarpSize here (45 for 8192 columns, on either vendor). So the two sums
// differ by at most about (cols + 45) * u relative (5e-4 at 8192, typically far less),
// the inverse root by half that, and out's values before their bf16 rounding by less
// than bf16's relative half-ulp (2^-9, 2e-3): the rounded values are equal or one ulp
// apart, the tolerance tests/gpu checks.
KVFUSE_DEVICE float block_inv_rms(float ss, int64_t cols, float eps, float* partial) {
  ss = warp_reduce_sum(ss);
  const int warps = int(blockDim.x) / kWarpSize;
  if (lane_id() == 0) partial[warp_id()] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < warps; ++i) total += partial[i];
    partial[warps] = 1.0f / sqrtf(total / float(cols) + eps);
  }
  __syncthreads();
  return partial[warps];
}

// This thread's chunks of the norm weight w (the same for every row), zero past cols.
KVFUSE_DEVICE void load_norm_weight(const bf16_t* w, int64_t cols, uint4 (&wvec)[kNormVec]) {
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
    wvec[k] = c < cols ? load_ro_16B(w + c) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// One row on the vector path (cols % 8 == 0, cols <= 8 * kNormVec * blockDim.x, every
// pointer 16-byte aligned): with kAdd, xr = bf16(xr + y) written back, y's chunk at column
// c being load_y(k, c) (8 bf16 in a uint4); then orow = rmsnorm(xr) * w, w's chunks in wvec
// (load_norm_weight). load_y gets the chunk's index k (0 .. kNormVec - 1) and its column c.
// The chunks stay in registers between the two passes. orow may be xr or the row load_y
// reads (each thread reads its chunks before it writes them). outv, where given, also
// receives this thread's chunks of orow (zero past cols), for a caller that goes on with them.
template <bool kAdd, class LoadY>
KVFUSE_DEVICE void rmsnorm_row_vec(bf16_t* xr, LoadY&& load_y, const uint4 (&wvec)[kNormVec], int64_t cols,
                                   float eps, bf16_t* orow, float* partial, uint4 (*outv)[kNormVec] = nullptr) {
  float ss = 0.0f;
  uint4 keep[kNormVec];
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
    if (c >= cols) continue;
    const uint4 a = *reinterpret_cast<const uint4*>(xr + c);
    const uint4 b = kAdd ? load_y(k, c) : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
    uint32_t ws[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bf16_t lo = kAdd ? f32_to_bf16(bf16_bits_to_f32(bf16_t(wa[i])) + bf16_bits_to_f32(bf16_t(wb[i])))
                             : bf16_t(wa[i]);
      const bf16_t hi =
          kAdd ? f32_to_bf16(bf16_bits_to_f32(bf16_t(wa[i] >> 16)) + bf16_bits_to_f32(bf16_t(wb[i] >> 16)))
               : bf16_t(wa[i] >> 16);
      const float vl = bf16_bits_to_f32(lo), vh = bf16_bits_to_f32(hi);
      ss += vl * vl;
      ss += vh * vh;
      ws[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    keep[k] = make_uint4(ws[0], ws[1], ws[2], ws[3]);
    if (kAdd) store_16B(xr + c, keep[k]);
  }
  const float inv = block_inv_rms(ss, cols, eps, partial);
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
    if (outv != nullptr) (*outv)[k] = make_uint4(0u, 0u, 0u, 0u);
    if (c >= cols) continue;
    const uint4 wv = wvec[k];
    const uint32_t wx[4] = {keep[k].x, keep[k].y, keep[k].z, keep[k].w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
    uint32_t wo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bf16_t lo = f32_to_bf16(bf16_bits_to_f32(bf16_t(wx[i])) * inv * bf16_bits_to_f32(bf16_t(ww[i])));
      const bf16_t hi =
          f32_to_bf16(bf16_bits_to_f32(bf16_t(wx[i] >> 16)) * inv * bf16_bits_to_f32(bf16_t(ww[i] >> 16)));
      wo[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    const uint4 o = make_uint4(wo[0], wo[1], wo[2], wo[3]);
    store_16B(orow + c, o);
    if (outv != nullptr) (*outv)[k] = o;
  }
}

}  // namespace kvfuse::gpu
