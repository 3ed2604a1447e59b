// AMD CDNA matrix instructions (MFMA) for kernels: thin wrappers over clang's builtins,
// one per instruction the MFMA attention kernel uses. HIP only: on CUDA this header is
// empty (NVIDIA's warp MMA is kernels/attention/attention_mma.cuh). The lane layouts of the
// operands and results are kernels/attention/mfma/mfma_layout.h; the host emulator that defines what
// the wrappers compute is kernels/cpu/attention/mfma_emu.h.
//
// Operands are raw 16-bit patterns (bf16 or f16, as kernels/common/bf16.h stores them), packed
// two to a VGPR: MfmaOperand4 is 4 of them (2 VGPRs), MfmaOperand8 is 8 (4 VGPRs). The
// accumulator MfmaAcc4 is 4 fp32 (4 VGPRs or AGPRs, the compiler's choice). All 64
// lanes of the wavefront must execute the instruction together.
//
// Builtins (clang 21, BuiltinsAMDGPU.def; the signature string in brackets):
//   __builtin_amdgcn_mfma_f32_16x16x16bf16_1k  [V4fV4sV4sV4fIiIiIi] gfx90a+   (mai-insts)
//   __builtin_amdgcn_mfma_f32_16x16x16f16      [V4fV4hV4hV4fIiIiIi] gfx908+   (mai-insts)
//   __builtin_amdgcn_mfma_f32_16x16x32_bf16    [V4fV8yV8yV4fIiIiIi] gfx950    (gfx950-insts)
//   __builtin_amdgcn_mfma_f32_16x16x32_f16     [V4fV8hV8hV4fIiIiIi] gfx950    (gfx950-insts)
// (s = short, h = _Float16, y = __bf16; the three trailing immediates are CBSZ, ABID and
// BLGP, the broadcast modifiers, always 0 here.)
//
// 16x16x32 is also offered on gfx942, as two 16x16x16 on the halves of each lane's
// operand vector (kernels/attention/mfma/mfma_layout.h says why that is the same product): kernels can
// be written once in the 16x16x32 shape. kMfmaNative16x16x32 says which it is.
#pragma once

#include "kernels/attention/mfma/mfma_layout.h"

#if defined(__HIP__)

#include "kernels/common/gpu.h"

// The device pass of a target with these instructions (CDNA3 gfx940-942, CDNA4 gfx950).
// Other passes (the host pass, which parses device code but emits none of it) see the
// declarations with bodies that are never compiled to machine code.
#if defined(__HIP_DEVICE_COMPILE__) && \
    (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__))
#define KVFUSE_MFMA_DEVICE 1
#else
#define KVFUSE_MFMA_DEVICE 0
#endif
#if defined(__HIP_DEVICE_COMPILE__) && !KVFUSE_MFMA_DEVICE
#error "kernels/attention/mfma/mfma.cuh: this target has no 16x16x16 bf16/f16 MFMA (kvfuse's are gfx942 and gfx950)"
#endif
#if KVFUSE_MFMA_DEVICE && defined(__gfx950__) && __has_builtin(__builtin_amdgcn_mfma_f32_16x16x32_bf16) && \
    __has_builtin(__builtin_amdgcn_mfma_f32_16x16x32_f16)
#define KVFUSE_MFMA_16X16X32 1
#else
#define KVFUSE_MFMA_16X16X32 0
#endif

namespace kvfuse::gpu {

using MfmaOperand4 = short __attribute__((ext_vector_type(4)));
using MfmaOperand8 = short __attribute__((ext_vector_type(8)));
using MfmaAcc4 = float __attribute__((ext_vector_type(4)));

// Whether mfma_16x16x32_* is one instruction on this target (gfx950) or two (gfx942).
// Meaningful in device code only (the host pass has no target; it reads false).
constexpr bool kMfmaNative16x16x32 = KVFUSE_MFMA_16X16X32;

// D = A * B + C with A 16x16, B 16x16 (v_mfma_f32_16x16x16_bf16 / _f16).
KVFUSE_DEVICE MfmaAcc4 mfma_16x16x16_bf16(MfmaOperand4 a, MfmaOperand4 b, MfmaAcc4 c) {
#if KVFUSE_MFMA_DEVICE
  return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
#else
  (void)a, (void)b;
  return c;  // not a device pass of an MFMA target: never runs
#endif
}

KVFUSE_DEVICE MfmaAcc4 mfma_16x16x16_f16(MfmaOperand4 a, MfmaOperand4 b, MfmaAcc4 c) {
#if KVFUSE_MFMA_DEVICE
  using Half4 = _Float16 __attribute__((ext_vector_type(4)));
  return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(Half4, a), __builtin_bit_cast(Half4, b), c,
                                               0, 0, 0);
#else
  (void)a, (void)b;
  return c;
#endif
}

// D = A * B + C with A 16x32, B 32x16 (v_mfma_f32_16x16x32_bf16 / _f16 on gfx950).
KVFUSE_DEVICE MfmaAcc4 mfma_16x16x32_bf16(MfmaOperand8 a, MfmaOperand8 b, MfmaAcc4 c) {
#if KVFUSE_MFMA_16X16X32
  using Bf16x8 = __bf16 __attribute__((ext_vector_type(8)));
  return __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(Bf16x8, a), __builtin_bit_cast(Bf16x8, b),
                                                 c, 0, 0, 0);
#else  // elements 0-3 of each lane, then 4-7
  return mfma_16x16x16_bf16(a.hi, b.hi, mfma_16x16x16_bf16(a.lo, b.lo, c));
#endif
}

KVFUSE_DEVICE MfmaAcc4 mfma_16x16x32_f16(MfmaOperand8 a, MfmaOperand8 b, MfmaAcc4 c) {
#if KVFUSE_MFMA_16X16X32
  using Half8 = _Float16 __attribute__((ext_vector_type(8)));
  return __builtin_amdgcn_mfma_f32_16x16x32_f16(__builtin_bit_cast(Half8, a), __builtin_bit_cast(Half8, b), c,
                                                0, 0, 0);
#else
  return mfma_16x16x16_f16(a.hi, b.hi, mfma_16x16x16_f16(a.lo, b.lo, c));
#endif
}

}  // namespace kvfuse::gpu

#endif  // __HIP__
