// The W8A8 activation quantization's device arithmetic, one place for every kernel that
// quantizes activations (kernels/gemm/gemv_fp8.cu's quantizer and GEMV, kernels/ops/norm_fp8.cu's
// norm): they must make the same bytes as the CPU's quantize_rows_fp8
// (kernels/cpu/gemm/gemm_fp8.h), operation for operation. Device code only; include after
// kernels/common/gpu.h.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "kernels/common/bf16.h"
#include "kernels/common/bf16x8.cuh"
#include "kernels/common/dispatch.cuh"
#include "kernels/common/fp8.h"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

// The largest |v| of 8 values into amax: NaN skipped (it compares false), so a max in any
// order is the same.
KVFUSE_DEVICE void amax8(const float (&v)[8], float& amax) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float m = fabsf(v[e]);
    if (m > amax) amax = m;
  }
}

// The largest of n warps' maxima.
KVFUSE_DEVICE float max_of(const float* v, int n) {
  float m = v[0];
  for (int i = 1; i < n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// A row's dynamic per-token scale from its amax: max(amax / max_finite, kFp8MinActScale),
// with the CPU's operations (IEEE division on both vendors: no fast-math).
template <Fp8Format F>
KVFUSE_DEVICE float dynamic_act_scale(float amax) {
  const float r = amax / fp8_max_finite(F);
  return r > kFp8MinActScale ? r : kFp8MinActScale;
}

// 8 activations quantized with inv = recip_rn(s): fp8_encode(x * inv), each product rounded,
// then the KV write's encoder; v is left holding the products.
template <Fp8Format F>
KVFUSE_DEVICE uint2 encode_x8(float (&v)[8], float inv) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = mul_rn(v[e], inv);
  return make_uint2(cvt_fp8x4<F>(v[0], v[1], v[2], v[3]), cvt_fp8x4<F>(v[4], v[5], v[6], v[7]));
}

// The activation (and weight) formats the quantizing kernels are instantiated for;
// f(std::integral_constant<Fp8Format, fmt>{}) through kernels/common/dispatch.cuh's one_of.
inline constexpr std::array<Fp8Format, 2> kE4m3Formats = {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz};
template <class Fn>
cudaError_t with_e4m3(Fp8Format fmt, Fn&& f) {
  return dispatch_detail::one_of<kE4m3Formats>(fmt, f, std::make_index_sequence<kE4m3Formats.size()>{});
}

}  // namespace kvfuse::gpu
