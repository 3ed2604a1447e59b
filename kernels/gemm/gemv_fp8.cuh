// Decode-sized products with FP8 weights on the GPU (CUDA and HIP from one source):
// out[m, n] = x[m, k] . wd[n, k]^T (+ bias) for m <= kGemvMaxRows, the weight stored as
// e4m3 codes with one fp32 scale per output channel. The numbers are those of the CPU
// reference, kernels/cpu/gemm/gemm_fp8.h (its header states them in full), up to the order
// of the fp32 sums and of the scale multiplies:
//   wd[j, p] = fp8_decode(w[j, p]) * w_scale[j];
//   W8A16 (act none): out = sum_p x[i, p] * fp8_decode(w[j, p]), then * w_scale[j];
//   W8A8 (static_tensor, dynamic_token): the activations quantized, xq [m, k] codes and
//     x_scale [m] (quantize_rows_fp8's: launch_quantize_rows_fp8 below makes them, or the
//     GEMV itself as it reads x), and
//     out = sum_p fp8_decode(xq[i, p]) * fp8_decode(w[j, p]), then * (x_scale[i] * w_scale[j]);
//   then + bias[j] (one fp32 add) and one rounding to bf16, or fp32 out.
// The products of decoded codes are exact in fp32 (bf16 x e4m3, e4m3 x e4m3), so the
// kernel's sums differ from the CPU's in-order chain of rounded dequantized operands only by
// fp32 rounding: tests/gpu/test_gemv_fp8_gpu.cu states and checks the bound. NaN codes (and
// NaN activations) give NaN outputs, as on the CPU.
//
// Memory bound at these sizes, as the bf16 GEMV (kernels/gemm/gemv.cuh), whose structure it
// keeps: each warp streams a few rows of w with 16-byte loads (16 codes), each lane a strided
// run of chunks, several in flight, the next step's loads issued before this step's math;
// the codes decoded with the packed conversions of kernels/common/fp8_decode.cuh; the lanes'
// partial sums meet in a butterfly. The GPU backend's FP8 projections run it through the
// GEMM planner (src/backends/gpu/gemm/gemm_planner.h), which also runs the vendor library's
// FP8 GEMM for larger m, finished by launch_fp8_gemm_epilogue below.
#pragma once

// gpu.h first: on HIP the vendor runtime header must precede kernels/common/host_device.h.
#include "kernels/common/gpu.h"

#include <cstdint>
#include <string>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "kernels/gemm/gemv.cuh"

namespace kvfuse::gpu {

// Rows and tilings are the bf16 GEMV's (kernels/gemm/gemv.cuh): m <= kGemvMaxRows, and
// gemv_variants(m) tilings for the tuner to time.


// The activations of a launch_gemv_fp8: bf16 x (act none, W8A16); or W8A8, either codes
// quantized beforehand (xq given) by launch_quantize_rows_fp8 or a kernel that makes the same
// bytes, or bf16 x that the GEMV quantizes itself (xq null), to those same bytes: the
// rows' scales from static_scale (static_tensor, a device pointer) or from each row's
// amax (dynamic_token), no launch and no codes in memory.
struct Fp8GemvAct {
  Fp8Act act = Fp8Act::none;
  const uint8_t* xq = nullptr;        // [m, k] codes of format fmt, 16-byte aligned, or null
  const float* x_scale = nullptr;     // [m] row scales s_i of xq (static_tensor: all the same)
  Fp8Format fmt = Fp8Format::e4m3fn;  // xq's format: must equal the weight's
  const float* static_scale = nullptr;  // xq null, static_tensor: the scale, in device memory
};

// Empty if launch_gemv_fp8 supports the call (any variant), else why not: 1 <= m <=
// kGemvMaxRows, n >= 1, k a positive multiple of 16, w_fmt e4m3fn or e4m3fnuz, w 16-byte
// aligned, w_scale and out given; act none, or W8A8 without xq: x given and 16-byte
// aligned (and static_scale for static_tensor); W8A8 with xq: xq 16-byte aligned,
// x_scale given, act.fmt == w_fmt.
std::string gemv_fp8_unsupported(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                                 Fp8Format w_fmt, int64_t n, int64_t k, const void* out,
                                 const Fp8GemvAct& act);

// out[m, n] as above: fp32 (out_f32) or bf16. w: [n, k] codes row-major (not the CPU's
// panels), w_scale [n], bias [n] or null (fp32). x: bf16 [m, k] for act none, else unused
// (may be null). variant: 0 .. gemv_variants(m) - 1, the same result up to the order of
// the sums. pdl: programmatic dependent launch (CUDA): the first loads of w (and, for few
// sums, of w_scale and bias) are issued before the wait for the previous kernel, those of x,
// xq, x_scale and static_scale after it.
// Asynchronous on `stream`, graph-safe.
LaunchStatus launch_gemv_fp8(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                             Fp8Format w_fmt, int64_t n, int64_t k, const float* bias, void* out,
                             bool out_f32, const Fp8GemvAct& act, cudaStream_t stream, bool pdl = false,
                             int variant = 0);

// The MLP's first half in one launch, as launch_gemv_silu_mul_bf16 (kernels/gemm/gemv.cuh):
// w is [gate rows; up rows] (n = 2 x inter), act_out bf16 [m, inter] = silu_mul of the
// bf16 [m, n] that launch_gemv_fp8 would write, bit for bit (each gate and up value rounded
// to bf16, then launch_silu_mul's formula). The activations as for launch_gemv_fp8 (bf16 x,
// codes in xq, or quantized by the GEMV itself); refused with an odd n.
LaunchStatus launch_gemv_fp8_silu_mul(const bf16_t* x, int64_t m, const uint8_t* w, const float* w_scale,
                                      Fp8Format w_fmt, int64_t n, int64_t k, const float* bias, bf16_t* act_out,
                                      const Fp8GemvAct& act, cudaStream_t stream, bool pdl = false,
                                      int variant = 0);

// Empty if launch_quantize_rows_fp8 supports the call, else why not: m >= 1, k a positive
// multiple of 8, act static_tensor or dynamic_token, fmt e4m3fn or e4m3fnuz, x 16-byte
// aligned, xq 8-byte aligned, x_scale given, static_scale given for static_tensor.
std::string quantize_rows_fp8_unsupported(const bf16_t* x, int64_t m, int64_t k, Fp8Act act,
                                          const float* static_scale, Fp8Format fmt, const uint8_t* xq,
                                          const float* x_scale);

// xq [m, k] and x_scale [m]: the bytes and scales of the CPU's quantize_rows_fp8
// (kernels/cpu/gemm/gemm_fp8.h), bit for bit: per row s = *static_scale (a device pointer,
// static_tensor; the CPU refuses a scale that is not finite and > 0, this kernel takes it as
// it is) or s = max(amax / fp8_max_finite(fmt), kFp8MinActScale) with amax the largest
// |x| of the row, NaN skipped (dynamic_token); then inv = 1.0f / s and each code
// fp8_encode(x * inv) through the KV write's device encoder (kernels/common/fp8_convert.cuh).
// A block per row. Asynchronous on `stream`, graph-safe.
LaunchStatus launch_quantize_rows_fp8(const bf16_t* x, int64_t m, int64_t k, Fp8Act act,
                                      const float* static_scale, Fp8Format fmt, uint8_t* xq, float* x_scale,
                                      cudaStream_t stream, bool pdl = false);

// The W8A8 epilogue of a vendor FP8 GEMM that summed the decoded codes' products in fp32
// without scales, d [m, n]: out[i, j] = d[i, j] * (x_scale[i] * w_scale[j]) (+ bias[j]),
// each operation rounded on its own as in launch_gemv_fp8's epilogue, then bf16 (one
// rounding) or fp32. x_scale null: d * w_scale[j] (W8A16 sums). Asynchronous, graph-safe.
LaunchStatus launch_fp8_gemm_epilogue(const float* d, int64_t m, int64_t n, const float* x_scale,
                                      const float* w_scale, const float* bias, void* out, bool out_f32,
                                      cudaStream_t stream, bool pdl = false);

}  // namespace kvfuse::gpu
