// Decode-sized GEMM with FP8 weights, and the activation quantizer (kernels/gemm/gemv_fp8.cuh).
#include "kernels/common/gpu.h"

#include "kernels/gemm/gemv_fp8.cuh"

#include <algorithm>
#include <array>
#include <climits>
#include <type_traits>
#include <utility>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/fp8_act.cuh"
#include "kernels/gemm/gemv_tiling.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/common/fp8_decode.cuh"

namespace kvfuse::gpu {
namespace {

constexpr int64_t kChunk = 16;  // codes of w per 16-byte load

struct GemvFp8Args {
  const bf16_t* x;       // W8A16, and W8A8 quantized in the kernel
  const uint8_t* xq;     // W8A8 with codes
  const float* x_scale;  // W8A8 with codes
  const float* static_scale;  // W8A8 quantized in the kernel, static_tensor (else dynamic)
  const uint8_t* w;
  const float* w_scale;
  const float* bias;  // or null
  int64_t n, k;
  void* out;
  bool out_f32;
  bool silu;  // w is [gate rows; up rows] and out is silu_mul's bf16 act [m, n / 2]
};

// 8 bytes of read-only data (a W8A8 half chunk of xq). The caller guarantees 8-byte alignment.
KVFUSE_DEVICE uint2 load_8B(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

// --- The activation quantization (kernels/common/fp8_act.cuh's arithmetic) and the output
// arithmetic, one place for the GEMV's and the library's epilogues (the same numbers:
// kernels/cpu/gemm/gemm_fp8.h).

// The largest |x| over this thread's chunks of 8 of a bf16 row (chunk `first`, then every
// `stride`-th), NaN skipped.
KVFUSE_DEVICE float thread_amax(const bf16_t* row, int64_t chunks, int64_t first, int64_t stride) {
  float amax = 0.0f;
  for (int64_t c = first; c < chunks; c += stride) {
    float v[8];
    widen_bf16x8(load_ro_16B(row + c * 8), v);
    amax8(v, amax);
  }
  return amax;
}

// An output from its sum of decoded products: times the scale (W8A8: fl(x_scale * w_scale);
// W8A16: w_scale), then plus the bias where there is one, each operation rounded on its own.
KVFUSE_DEVICE float fp8_output(float sum, bool w8a8, float x_scale, float w_scale, bool has_bias, float bias) {
  const float v = mul_rn(sum, w8a8 ? mul_rn(x_scale, w_scale) : w_scale);
  return has_bias ? add_rn(v, bias) : v;
}

// The row scales of a GEMV that quantizes its activations (XMode::quantize), in every
// thread: static_tensor s = *static_scale; dynamic_token s = max(amax / max_finite,
// kFp8MinActScale), amax the largest |x| of the row (NaN skipped; a max in any order is the
// same), as launch_quantize_rows_fp8's kernel takes them, into shared_s; inv = recip_rn(s).
template <int M, Fp8Format F>
KVFUSE_DEVICE void row_scales(const GemvFp8Args& a, float* shared_s, float (&inv)[M]) {
  if (a.static_scale != nullptr) {
    if (threadIdx.x < M) shared_s[threadIdx.x] = *a.static_scale;
  } else {
    __shared__ float warp_amax[M][kGemvThreads / kWarpSize];
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float amax = warp_reduce_max(thread_amax(a.x + int64_t(i) * a.k, a.k / 8, threadIdx.x, kGemvThreads));
      if (lane_id() == 0) warp_amax[i][warp_id()] = amax;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      shared_s[threadIdx.x] = dynamic_act_scale<F>(max_of(warp_amax[threadIdx.x], kGemvThreads / kWarpSize));
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < M; ++i) inv[i] = recip_rn(shared_s[i]);
}

// kRows rows of w per group of kSplit warps, as the bf16 GEMV's kernel (kernels/gemm/gemv.cu,
// whose comment tells the tilings, the software pipelining and the split-K in full): each
// lane loads kUnroll 16-byte chunks (16 codes) of each of its rows per step, the loads of
// step s + 1 issued before the math of step s; the first chunks (and, for few sums, the
// weight scales and biases) are loaded before the PDL wait (they do not come from the kernel
// before), x after.
// A chunk is used in two halves of 8 codes: the group's rows' halves are decoded once
// (fp8x8_decode), then every token row's 8 activations (bf16 widened, or codes decoded) are
// multiplied into the sums, in element order. kX: the activations are bf16 x (W8A16), codes
// xq with their row scales (W8A8), or bf16 x that the kernel quantizes itself (W8A8):
// each block first takes every row's scale as launch_quantize_rows_fp8 does (the row's
// amax over the block's threads, or the static scale), then encodes each 8 activations as
// it reads them, with that kernel's operations, so the codes are its bytes. Each lane's
// sums are of decoded values in units of fp8_decode_unit (exact products); the unit and
// the scales are applied once, after the butterfly, by lane 0.
// a.silu (a uniform flag, not a template argument: the loop is the same, and the kernel
// count half): w is [gate rows; up rows] (n = 2 x inter) and out is act [m, inter] =
// silu_mul(x . w^T), as kernels/gemm/gemv.cu's kSilu: a group's rows are gate rows j.. and
// up rows inter + j.., each finished as without silu (scales, bias, bf16), then combined by
// launch_silu_mul's formula: the bits of this GEMV and then silu_mul.
enum class XMode { bf16, codes, quantize };
template <int M, XMode kX, Fp8Format F, int kRows, int kUnroll, int kSplit>
__global__ void KVFUSE_LAUNCH_BOUNDS(kGemvThreads, 4) gemv_fp8_kernel(GemvFp8Args a) {
  static_assert(kRows % 2 == 0, "silu pairs rows");
  constexpr bool kQ = kX != XMode::bf16;  // the sums are of decoded activation codes
  constexpr int kHalf = kRows / 2;
  const bool silu = a.silu;
  const int outs = silu ? kHalf : kRows;  // output columns per group
  static_assert(kSplit >= 1 && (kGemvThreads / kWarpSize) % kSplit == 0, "kSplit divides the block's warps");
  const int part = warp_id() % kSplit;
  const int lane = lane_id() + part * kWarpSize;
  const int64_t n = a.n, k = a.k;
  const int64_t n_out = silu ? n / 2 : n;
  const int64_t row0 =
      (int64_t(blockIdx.x) * (kGemvThreads / kWarpSize / kSplit) + int64_t(warp_id() / kSplit)) * outs;
  // Row r of the group: w's row for output column row0 + r % outs (silu: the second half
  // are the up rows), and whether that column exists.
  const auto w_row = [&](int r) -> int64_t { return silu && r >= kHalf ? n_out + row0 + r - kHalf : row0 + r; };
  const auto has_row = [&](int r) { return row0 + (silu && r >= kHalf ? r - kHalf : r) < n_out; };
  const int64_t chunks = k / kChunk;
  constexpr int64_t kStride = int64_t(kUnroll) * kWarpSize * kSplit;
  const bool full = row0 + outs <= n_out;
  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  Fp8NanWatch<F> w_nan[kRows];
  Fp8NanWatch<F> x_nan[M];
  uint4 wv[kUnroll][kRows];
  const uint64_t policy = l2_evict_first_policy();
  auto load_w = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t(u) * kWarpSize * kSplit;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        wv[u][r] = c < chunks && (full || has_row(r)) ? load_stream_16B(a.w + w_row(r) * k + c * kChunk, policy)
                                                      : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  if (lane < chunks) load_w(lane);
  // The group's weight scales and biases (rows past the last read its, never stored):
  // before the loop where registers allow (M * kRows <= 8), else after it, their latency
  // then under the butterfly's.
  constexpr bool kEarlyScales = M * kRows <= 8;
  float w_scale[kRows], bias[kRows];
  const auto load_scales = [&] {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t j = has_row(r) ? w_row(r) : n - 1;
      w_scale[r] = a.w_scale[j];
      bias[r] = a.bias != nullptr ? a.bias[j] : 0.0f;
    }
  };
  if constexpr (kEarlyScales) load_scales();
  grid_dependency_wait();  // PDL: x (xq, x_scale) comes from the kernel before
  __shared__ float row_s[M];  // XMode::quantize: the rows' scales
  float x_inv[M];
  if constexpr (kX == XMode::quantize) row_scales<M, F>(a, row_s, x_inv);
  for (int64_t c0 = lane; c0 < chunks; c0 += kStride) {
    uint4 cur[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) cur[u][r] = wv[u][r];
    if (c0 + kStride < chunks) load_w(c0 + kStride);  // the next step's loads, before this step's math
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t(u) * kWarpSize * kSplit;
      if (c >= chunks) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float wf[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          fp8x8_decode<F>(h == 0 ? cur[u][r].x : cur[u][r].z, h == 0 ? cur[u][r].y : cur[u][r].w, wf[r],
                          w_nan[r]);
        }
        const int64_t at = c * kChunk + h * 8;  // the half chunk's first element of a row
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float xf[8];
          if constexpr (kX == XMode::codes) {
            const uint2 q = load_8B(a.xq + int64_t(i) * k + at);
            fp8x8_decode<F>(q.x, q.y, xf, x_nan[i]);
          } else if constexpr (kX == XMode::quantize) {
            widen_bf16x8(load_ro_16B(a.x + int64_t(i) * k + at), xf);
            const uint2 q = encode_x8<F>(xf, x_inv[i]);
            fp8x8_decode<F>(q.x, q.y, xf, x_nan[i]);
          } else {
            widen_bf16x8(load_ro_16B(a.x + int64_t(i) * k + at), xf);
          }
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][i] = fmaf(xf[e], wf[r][e], acc[r][i]);
        }
      }
    }
  }
  launch_dependents();
  if constexpr (!kEarlyScales) load_scales();
  // NaN codes the bit decode turned into numbers: the sums they were part of become NaN
  // (and stay NaN through the butterfly), as fp8_decode's NaN makes them on the CPU.
  if constexpr (!fp8_decode_native<F>()) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (w_nan[r].any() || (kQ && x_nan[i].any())) acc[r][i] = __uint_as_float(0x7fc00000u);
      }
  }
  if (!gemv_reduce<M, kRows, kSplit>(acc, part)) return;
  if (lane != 0) return;
  // sum * unit (a power of two: exact), times the scales (W8A8: x_scale[i] * w_scale[j],
  // one rounding, then one more), plus the bias; each rounded on its own.
  constexpr float kUnit = kQ ? fp8_decode_unit<F>() * fp8_decode_unit<F>() : fp8_decode_unit<F>();
  float x_scale[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    x_scale[i] = kX == XMode::quantize ? row_s[i] : kX == XMode::codes ? a.x_scale[i] : 1.0f;
  }
  // Output r's value for token row i: the sum times the scales, plus the bias.
  const auto finish = [&](int r, int i) {
    return fp8_output(acc[r][i] * kUnit, kQ, x_scale[i], w_scale[r], a.bias != nullptr, bias[r]);
  };
  if (silu) {  // gate r with up r + kHalf, the indices known at compile time
#pragma unroll
    for (int r = 0; r < kHalf; ++r) {
      if (row0 + r >= n_out) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float g = bf16_bits_to_f32(f32_to_bf16(finish(r, i)));
        const float u = bf16_bits_to_f32(f32_to_bf16(finish(r + kHalf, i)));
        static_cast<bf16_t*>(a.out)[int64_t(i) * n_out + row0 + r] = f32_to_bf16(silu_mul_f32(g, u));
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (row0 + r >= n_out) break;
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const int64_t at = int64_t(i) * n_out + row0 + r;
      if (a.out_f32) {
        static_cast<float*>(a.out)[at] = finish(r, i);
      } else {
        static_cast<bf16_t*>(a.out)[at] = f32_to_bf16(finish(r, i));
      }
    }
  }
}

template <int M, XMode kX, Fp8Format F, int kRows, int kUnroll, int kSplit>
cudaError_t launch_shape(const GemvFp8Args& a, cudaStream_t stream, bool pdl) {
  const int64_t per_block = int64_t(kGemvThreads / kWarpSize / kSplit) * (a.silu ? kRows / 2 : kRows);
  const int64_t outs = a.silu ? a.n / 2 : a.n;  // output columns
  const int64_t blocks = (outs + per_block - 1) / per_block;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return launch_kernel(gemv_fp8_kernel<M, kX, F, kRows, kUnroll, kSplit>, unsigned(blocks), kGemvThreads, stream,
                       pdl, a);
}

bool is_e4m3(Fp8Format f) { return f == Fp8Format::e4m3fn || f == Fp8Format::e4m3fnuz; }

// --- The quantizer -----------------------------------------------------------------------

constexpr int kQuantThreads = 256;

// One block per row: the row's amax (dynamic: each thread's running max of |x|, NaN
// skipped as the CPU skips it, then the warps' and the block's; a max is the same in any
// order), s and inv = 1 / s, then the codes, 8 per thread and step (one 16-byte load, one
// 8-byte store). The arithmetic is the CPU's, operation for operation: amax / max_finite
// (IEEE division on both vendors: no fast-math), recip_rn, mul_rn, the project's encoder.
template <Fp8Format F, bool kDynamic>
__global__ void KVFUSE_LAUNCH_BOUNDS(kQuantThreads, 1)
    quantize_rows_fp8_kernel(const bf16_t* x, int64_t k, const float* static_scale, uint8_t* xq,
                             float* x_scale) {
  const int64_t row = blockIdx.x;
  const bf16_t* xr = x + row * k;
  const int64_t chunks = k / 8;
  grid_dependency_wait();  // PDL: x comes from the kernel before
  float s;
  if constexpr (kDynamic) {
    __shared__ float warp_amax[kQuantThreads / kWarpSize];
    const float amax = warp_reduce_max(thread_amax(xr, chunks, threadIdx.x, kQuantThreads));
    if (lane_id() == 0) warp_amax[warp_id()] = amax;
    __syncthreads();
    s = dynamic_act_scale<F>(max_of(warp_amax, kQuantThreads / kWarpSize));
  } else {
    s = *static_scale;
  }
  launch_dependents();
  if (threadIdx.x == 0) x_scale[row] = s;
  const float inv = recip_rn(s);
  for (int64_t c = threadIdx.x; c < chunks; c += kQuantThreads) {
    float v[8];
    widen_bf16x8(load_ro_16B(xr + c * 8), v);
    *reinterpret_cast<uint2*>(xq + row * k + c * 8) = encode_x8<F>(v, inv);
  }
}

// --- The vendor GEMM's epilogue -----------------------------------------------------------

constexpr int kEpilogueThreads = 256;

__global__ void KVFUSE_LAUNCH_BOUNDS(kEpilogueThreads, 1)
    fp8_gemm_epilogue_kernel(const float* d, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                             const float* bias, void* out, bool out_f32) {
  grid_dependency_wait();  // PDL: d comes from the GEMM before
  const int64_t total = m * n;
  for (int64_t at = int64_t(blockIdx.x) * kEpilogueThreads + threadIdx.x; at < total;
       at += int64_t(gridDim.x) * kEpilogueThreads) {
    const int64_t i = at / n, j = at - i * n;
    const float v = fp8_output(d[at], x_scale != nullptr, x_scale != nullptr ? x_scale[i] : 1.0f, w_scale[j],
                               bias != nullptr, bias != nullptr ? bias[j] : 0.0f);
    if (out_f32) {
      static_cast<float*>(out)[at] = v;
    } else {
      static_cast<bf16_t*>(out)[at] = f32_to_bf16(v);
    }
  }
  launch_dependents();
}

}  // namespace

LaunchStatus launch_fp8_gemm_epilogue(const float* d, int64_t m, int64_t n, const float* x_scale,
                                      const float* w_scale, const float* bias, void* out, bool out_f32,
                                      cudaStream_t stream, bool pdl) {
  if (m < 1 || n < 1 || d == nullptr || w_scale == nullptr || out == nullptr) {
    return LaunchStatus::refused("fp8 gemm epilogue: m " + std::to_string(m) + ", n " + std::to_string(n) +
                                 " (both >= 1; d, w_scale and out given)");
  }
  const int64_t blocks = std::min<int64_t>((m * n + kEpilogueThreads - 1) / kEpilogueThreads, 65536);
  return launch_kernel(fp8_gemm_epilogue_kernel, unsigned(blocks), kEpilogueThreads, stream, pdl, d, m, n, x_scale,
                       w_scale, bias, out, out_f32);
}

std::string gemv_fp8_unsupported(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                                 Fp8Format w_fmt, int64_t n, int64_t k, const void* out,
                                 const Fp8GemvAct& act) {
  if (m < 1 || m > kGemvMaxRows)
    return "gemv fp8: m " + std::to_string(m) + " outside 1.." + std::to_string(kGemvMaxRows);
  if (n < 1 || k < kChunk || k % kChunk != 0)
    return "gemv fp8: n " + std::to_string(n) + ", k " + std::to_string(k) + " (k a positive multiple of 16)";
  if (!is_e4m3(w_fmt))
    return "gemv fp8: weight format " + std::to_string(int(w_fmt)) + " (e4m3fn or e4m3fnuz)";
  if (w == nullptr || !is_aligned(w, 16)) return "gemv fp8: w must be given and 16-byte aligned";
  if (w_scale == nullptr || out == nullptr) return "gemv fp8: w_scale and out must be given";
  switch (act.act) {
    case Fp8Act::none:
      if (x == nullptr || !is_aligned(x, 16))
        return "gemv fp8: x must be given and 16-byte aligned (act none)";
      return {};
    case Fp8Act::static_tensor:
    case Fp8Act::dynamic_token:
      if (act.xq != nullptr) {
        if (!is_aligned(act.xq, 16) || act.x_scale == nullptr)
          return "gemv fp8: xq must be 16-byte aligned and x_scale given (quantized activations)";
        if (act.fmt != w_fmt) return "gemv fp8: the activation format must be the weight's";
        return {};
      }
      if (x == nullptr || !is_aligned(x, 16))
        return "gemv fp8: x must be given and 16-byte aligned (activations quantized in the kernel)";
      if (act.act == Fp8Act::static_tensor && act.static_scale == nullptr)
        return "gemv fp8: static_tensor activations quantized in the kernel need static_scale";
      return {};
  }
  return "gemv fp8: activation kind " + std::to_string(int(act.act));
}

namespace {

// launch_gemv_fp8, and with silu its SiLU-mul form (bf16 act [m, n / 2]).
LaunchStatus launch_gemv_fp8_as(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale, Fp8Format w_fmt,
                                int64_t n, int64_t k, const float* bias, void* out, bool out_f32,
                                const Fp8GemvAct& act, cudaStream_t stream, bool pdl, int variant, bool silu) {
  if (std::string why = gemv_fp8_unsupported(x, m, w, w_scale, w_fmt, n, k, out, act); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (variant < 0 || variant >= gemv_variants(m)) {
    return LaunchStatus::refused("gemv fp8: variant " + std::to_string(variant) + " of " +
                                 std::to_string(gemv_variants(m)) + " for m " + std::to_string(m));
  }
  const XMode mode = act.act == Fp8Act::none ? XMode::bf16 : act.xq != nullptr ? XMode::codes : XMode::quantize;
  if (silu && n % 2 != 0) {
    return LaunchStatus::refused("gemv fp8 silu_mul: n " + std::to_string(n) + " must be even (gate rows, then up rows)");
  }
  const float* static_scale = act.act == Fp8Act::static_tensor ? act.static_scale : nullptr;
  const GemvFp8Args a{x, act.xq, act.x_scale, static_scale, w, w_scale, bias, n, k, out, out_f32 && !silu, silu};
  return with_gemv_rows(m, [&](auto rows) {
    constexpr int M = decltype(rows)::value;
    return with_gemv_tiling<M>(variant, [&](auto t) {
      using T = decltype(t);
      return with_e4m3(w_fmt, [&](auto fmt) {
        constexpr Fp8Format F = decltype(fmt)::value;
        switch (mode) {
          case XMode::codes:
            return launch_shape<M, XMode::codes, F, T::kRows, T::kUnroll, T::kSplit>(a, stream, pdl);
          case XMode::quantize:
            return launch_shape<M, XMode::quantize, F, T::kRows, T::kUnroll, T::kSplit>(a, stream, pdl);
          case XMode::bf16:
            break;
        }
        return launch_shape<M, XMode::bf16, F, T::kRows, T::kUnroll, T::kSplit>(a, stream, pdl);
      });
    });
  });
}

}  // namespace

LaunchStatus launch_gemv_fp8(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                             Fp8Format w_fmt, int64_t n, int64_t k, const float* bias, void* out,
                             bool out_f32, const Fp8GemvAct& act, cudaStream_t stream, bool pdl,
                             int variant) {
  return launch_gemv_fp8_as(x, m, w, w_scale, w_fmt, n, k, bias, out, out_f32, act, stream, pdl, variant, false);
}

LaunchStatus launch_gemv_fp8_silu_mul(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                                      Fp8Format w_fmt, int64_t n, int64_t k, const float* bias, bf16_t* act_out,
                                      const Fp8GemvAct& act, cudaStream_t stream, bool pdl, int variant) {
  return launch_gemv_fp8_as(x, m, w, w_scale, w_fmt, n, k, bias, act_out, false, act, stream, pdl, variant, true);
}

std::string quantize_rows_fp8_unsupported(const bf16_t* x, int64_t m, int64_t k, Fp8Act act,
                                          const float* static_scale, Fp8Format fmt, const uint8_t* xq,
                                          const float* x_scale) {
  if (m < 1 || m > INT32_MAX || k < 8 || k % 8 != 0)
    return "quantize_rows_fp8: m " + std::to_string(m) + ", k " + std::to_string(k) +
           " (m >= 1, k a positive multiple of 8)";
  if (act != Fp8Act::static_tensor && act != Fp8Act::dynamic_token)
    return "quantize_rows_fp8: activation kind " + std::to_string(int(act)) +
           " (static_tensor or dynamic_token)";
  if (!is_e4m3(fmt)) return "quantize_rows_fp8: format " + std::to_string(int(fmt)) + " (e4m3fn or e4m3fnuz)";
  if (x == nullptr || !is_aligned(x, 16) || xq == nullptr || !is_aligned(xq, 8) || x_scale == nullptr)
    return "quantize_rows_fp8: x (16-byte aligned), xq (8-byte aligned) and x_scale must be given";
  if (act == Fp8Act::static_tensor && static_scale == nullptr)
    return "quantize_rows_fp8: static_tensor needs static_scale";
  return {};
}

LaunchStatus launch_quantize_rows_fp8(const bf16_t* x, int64_t m, int64_t k, Fp8Act act,
                                      const float* static_scale, Fp8Format fmt, uint8_t* xq, float* x_scale,
                                      cudaStream_t stream, bool pdl) {
  if (std::string why = quantize_rows_fp8_unsupported(x, m, k, act, static_scale, fmt, xq, x_scale);
      !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  return with_e4m3(fmt, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    return act == Fp8Act::dynamic_token
               ? launch_kernel(quantize_rows_fp8_kernel<F, true>, unsigned(m), kQuantThreads, stream, pdl, x,
                               k, static_scale, xq, x_scale)
               : launch_kernel(quantize_rows_fp8_kernel<F, false>, unsigned(m), kQuantThreads, stream, pdl, x,
                               k, static_scale, xq, x_scale);
  });
}

}  // namespace kvfuse::gpu
