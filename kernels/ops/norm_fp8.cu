// The RMSNorm that quantizes its output for an FP8 W8A8 projection (kernels/ops/norm_fp8.cuh).
#include "kernels/common/gpu.h"

#include "kernels/ops/norm_fp8.cuh"

#include <string>
#include <utility>

#include "kernels/common/fp8_act.cuh"
#include "kernels/ops/rmsnorm_row.cuh"

namespace kvfuse::gpu {
namespace {

// One block per row, the norm's vector path (kernels/ops/rmsnorm_row.cuh, as the model's
// norm kernel runs it: the same bits of x and out), its output chunks kept in registers;
// then the row's scale (dynamic: each thread's max of |out| over its chunks, NaN skipped,
// the warps' maxima, then the block's, in partial[] after the norm is done with it; a max
// is the same in any order) and each chunk's 8 codes, as launch_quantize_rows_fp8 makes them.
template <bool kAdd, Fp8Format F, bool kDynamic>
__global__ void KVFUSE_LAUNCH_BOUNDS(kNormThreads, 1)
    rmsnorm_fp8_kernel(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out, const float* static_scale, uint8_t* xq, float* x_scale) {
  constexpr int kWarps = kNormThreads / kWarpSize;
  __shared__ float partial[kWarps + 1];
  uint4 wvec[kNormVec];
  load_norm_weight(w, cols, wvec);
  grid_dependency_wait();  // PDL: x and y come from the kernel before
  launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const bf16_t* yr = kAdd ? y + row * cols : nullptr;
    uint4 o[kNormVec];
    rmsnorm_row_vec<kAdd>(
        x + row * cols, [&](int, int64_t c) { return *reinterpret_cast<const uint4*>(yr + c); }, wvec, cols, eps,
        out + row * cols, partial, &o);
    float s;
    if constexpr (kDynamic) {
      float amax = 0.0f;
#pragma unroll
      for (int k = 0; k < kNormVec; ++k) {  // chunks past cols hold zeros
        float v[8];
        widen_bf16x8(o[k], v);
        amax8(v, amax);
      }
      amax = warp_reduce_max(amax);
      // partial[0 .. kWarps - 1] are free: the norm's last __syncthreads came after thread 0
      // read them, and every thread reads only partial[kWarps] since.
      if (lane_id() == 0) partial[warp_id()] = amax;
      __syncthreads();
      s = dynamic_act_scale<F>(max_of(partial, kWarps));
    } else {
      s = *static_scale;
    }
    if (threadIdx.x == 0) x_scale[row] = s;
    const float inv = recip_rn(s);
#pragma unroll
    for (int k = 0; k < kNormVec; ++k) {
      const int64_t c = (int64_t(k) * kNormThreads + threadIdx.x) * 8;
      if (c >= cols) continue;
      float v[8];
      widen_bf16x8(o[k], v);
      *reinterpret_cast<uint2*>(xq + row * cols + c) = encode_x8<F>(v, inv);
    }
    __syncthreads();  // partial[] is reused by the next row
  }
}

}  // namespace

std::string rmsnorm_fp8_unsupported(const bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols,
                                    const bf16_t* out, Fp8Act act, const float* static_scale, Fp8Format fmt,
                                    const uint8_t* xq, const float* x_scale) {
  if (rows < 1 || cols < 8 || cols % 8 != 0 || cols > kNormVecMaxCols) {
    return "rmsnorm_fp8: rows " + std::to_string(rows) + ", cols " + std::to_string(cols) +
           " (rows >= 1, cols a positive multiple of 8 up to " + std::to_string(kNormVecMaxCols) + ")";
  }
  if (x == nullptr || !is_aligned(x, 16) || (y != nullptr && !is_aligned(y, 16)) || w == nullptr || !is_aligned(w, 16) ||
      out == nullptr || !is_aligned(out, 16)) {
    return "rmsnorm_fp8: x, w and out (and y, when given) must be 16-byte aligned";
  }
  if (xq == nullptr || !is_aligned(xq, 8) || x_scale == nullptr)
    return "rmsnorm_fp8: xq (8-byte aligned) and x_scale must be given";
  if (act != Fp8Act::static_tensor && act != Fp8Act::dynamic_token)
    return "rmsnorm_fp8: activation kind " + std::to_string(int(act)) + " (static_tensor or dynamic_token)";
  if (act == Fp8Act::static_tensor && static_scale == nullptr) return "rmsnorm_fp8: static_tensor needs static_scale";
  if (fmt != Fp8Format::e4m3fn && fmt != Fp8Format::e4m3fnuz)
    return "rmsnorm_fp8: format " + std::to_string(int(fmt)) + " (e4m3fn or e4m3fnuz)";
  return {};
}

LaunchStatus launch_rmsnorm_fp8(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                                bf16_t* out, Fp8Act act, const float* static_scale, Fp8Format fmt, uint8_t* xq,
                                float* x_scale, cudaStream_t stream, bool pdl) {
  if (std::string why = rmsnorm_fp8_unsupported(x, y, w, rows, cols, out, act, static_scale, fmt, xq, x_scale);
      !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  const unsigned blocks = rows < 65535 ? unsigned(rows) : 65535u;
  const bool add = y != nullptr, dynamic = act == Fp8Act::dynamic_token;
  return with_e4m3(fmt, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    const auto go = [&](auto kernel) {
      return launch_kernel(kernel, blocks, kNormThreads, stream, pdl, x, y, w, rows, cols, eps, out, static_scale,
                           xq, x_scale);
    };
    if (add) return dynamic ? go(rmsnorm_fp8_kernel<true, F, true>) : go(rmsnorm_fp8_kernel<true, F, false>);
    return dynamic ? go(rmsnorm_fp8_kernel<false, F, true>) : go(rmsnorm_fp8_kernel<false, F, false>);
  });
}

}  // namespace kvfuse::gpu
