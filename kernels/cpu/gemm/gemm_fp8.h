// The CPU backend's FP8-weight GEMM: y[m, n] = x[m, k] * wd[n, k]^T (+ bias), with the
// weight stored as FP8 bytes and one fp32 scale per output channel. It is the reference
// the GPU FP8 kernels are tested against, so its numerics are stated here in full.
//
// Weight. w: uint8_t FP8 codes [n, k] row-major in format w_fmt (e4m3fn, or e4m3fnuz;
// any Fp8Format decodes), w_scale: float[n], one per output channel (a per-tensor scale
// arrives expanded to n copies). Packed once at load by gemm_pack_weight_fp8 into the
// panel layout of the bf16 weights (gemm.h: panels of kGemmPanel output columns, k-major
// within a panel, zero bytes past n). The dequantized weight is
//   wd[j, p] = fp8_decode(w[j, p], w_fmt) * w_scale[j]      (one fp32 rounding)
// with fp8_decode from kernels/common/fp8.h (exact). NaN codes give NaN.
//
// Activations (bf16 x[m, k]), by Fp8Act:
//   none (W8A16):   xd[i, p] = float(x[i, p])  (bf16 widened, exact).
//   static_tensor:  one scale s (the checkpoint's input_scale; finite and > 0, else the
//                   call aborts), for every row.
//   dynamic_token:  per row i, amax_i = max over p of fabsf(float(x[i, p])), NaN elements
//                   skipped (the running max starts at +0 and takes a value only when it
//                   is larger, so it equals fmaxf over the row in any order), and
//                   s_i = fmaxf(amax_i / fp8_max_finite(act_fmt), kFp8MinActScale)
//                   (one fp32 division). An all-zero row gets s_i = kFp8MinActScale.
//   For both scaled kinds, with inv_i = 1.0f / s_i (one fp32 division per row):
//     q[i, p]  = fp8_encode(float(x[i, p]) * inv_i, act_fmt)   (the KV write's expression,
//                kernels/cpu/kv_write/kv_write.cc: one fp32 multiply, then the project's
//                one encoder: saturating, round to nearest even, NaN to the format's NaN)
//     xd[i, p] = fp8_decode(q[i, p], act_fmt) * s_i          (one fp32 rounding)
//   quantize_rows_fp8 computes q and s_i; the GEMM uses it, and GPU kernels that fuse the
//   quantization into another op are compared with it byte for byte. A row holding an
//   inf gets s_i = inf, inv_i = 0, so that element becomes NaN and the others 0: defined
//   but useless, as in any amax-scaled format.
//
// Output. out[i, j] is the fp32 fused multiply-add chain
//   acc = +0; for p = 0..k-1 ascending: acc = fmaf(xd[i, p], wd[j, p], acc)
// then, for linear_fp8_bf16, f32_to_bf16(bias ? acc + bias[j] : acc) (one fp32 add, one
// rounding to bf16), or for linear_fp8_f32_out acc itself (no bias; logits). So a W8A8
// result is the in-order fp32 chain of the dequantized operands, and a W8A16 result is
// the bf16 GEMM's chain (gemm.h) with the fp32 weights wd in place of widened bf16 ones
// (the same bits as linear_bf16 where wd is exact in bf16). k = 0 gives acc = +0.
//
// Invariance. The bits do not depend on the ISA (generic, avx2, avx512: gemm.h's
// GemmIsa, KVFUSE_CPU_GEMM), on m, or on a row's position in the batch: each weight block
// is dequantized into fp32 by scalar code (a 256-entry decode table, exact, times the
// column's scale), and gemm_block_f32w runs the same chains as the bf16 GEMM. No threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "kernels/cpu/gemm/gemm.h"

namespace kvfuse::cpu {



// Bytes of a packed [n, k] FP8 weight.
size_t gemm_packed_fp8_bytes(int64_t n, int64_t k);
// Packs FP8 codes [n, k] row-major (zero bytes past n).
void gemm_pack_weight_fp8(const uint8_t* w, int64_t n, int64_t k, uint8_t* packed);

// A packed FP8 weight as the GEMM reads it.
struct Fp8Weight {
  const uint8_t* packed = nullptr;  // gemm_pack_weight_fp8
  const float* scale = nullptr;     // [n], per output channel
  Fp8Format fmt = Fp8Format::e4m3fn;
};

// How the activations are quantized (Fp8Act::none: not at all).
struct Fp8ActQuant {
  Fp8Act act = Fp8Act::none;
  float static_scale = 1.0f;  // static_tensor only
  Fp8Format fmt = Fp8Format::e4m3fn;
};

// q[i * k + p] and scales[i] (s_i) as above, for act static_tensor (every scales[i] =
// static_scale) or dynamic_token; act none aborts.
void quantize_rows_fp8(const bf16_t* x, int64_t m, int64_t k, Fp8Act act, float static_scale,
                       Fp8Format act_fmt, uint8_t* q, float* scales);

// y[i * ldy + j] = the chain of xd[i, p] = x[i * k + p] (fp32, taken as is) and wd[j, p],
// for j < round_up(n, kGemmPanel) (columns past n are +0). ldy >= round_up(n, kGemmPanel);
// wbuf: gemm_fp8_wbuf_floats() floats (required).
void gemm_fp8_f32(const float* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n, float* y, int64_t ldy,
                  GemmIsa isa, float* wbuf);

size_t gemm_fp8_wbuf_floats();

// Floats of scratch linear_fp8_bf16 / linear_fp8_f32_out need.
size_t gemm_fp8_scratch_floats(int64_t m, int64_t k, int64_t n);

// out (bf16) = round(x * wd^T + bias); bias (fp32, [n]) may be null.
void linear_fp8_bf16(const bf16_t* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n,
                     const Fp8ActQuant& aq, const float* bias, bf16_t* out, float* scratch, GemmIsa isa);

// out (fp32) = x * wd^T; for logits.
void linear_fp8_f32_out(const bf16_t* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n,
                        const Fp8ActQuant& aq, float* out, float* scratch, GemmIsa isa);

}  // namespace kvfuse::cpu
