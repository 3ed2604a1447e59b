// Packed FP8 (e4m3) -> fp32 on the device, four codes at a time, for kernels that compute
// with FP8 operands (the FP8-weight GEMV, kernels/gemm/gemv_fp8.cu). The values come out
// as decode(code) / fp8_decode_unit<F>() with fp8_decode from kernels/common/fp8.h, the unit
// a power of two, exactly: every e4m3 value times 2^-8 (2^-7 for FNUZ) is an f16, and every
// f16 an fp32. A kernel multiplies its sums by the unit once, at the end.
//
// Which instruction does the work is decided here, once, so kernels have no #if; the
// targets are the attention kernels' (kernels/attention/attention_mma.cuh, and
// kernels/attention/mfma/attention_mfma.cu on AMD), keyed by Fp8Format instead of KvFormat:
//   NVIDIA sm_89+   e4m3fn: cvt.rn.f16x2.e4m3x2 (two codes -> two f16), widened; unit 1.
//   AMD gfx942      e4m3fnuz: v_cvt_pk_f32_fp8 (FNUZ is the hardware format); unit 1.
//   AMD gfx950      e4m3fn: v_cvt_scalef32_pk_f32_fp8 with scale 1 (OCP is the hardware
//                   format); unit 1.
//   anything else   (sm_80; e4m3fnuz on NVIDIA and gfx950; e4m3fn on gfx942, whose
//                   instruction reads 0x80, OCP's -0, as NaN): bit manipulation, the code
//                   s.eeee.mmm moved into the f16 s.0eeee.mmm0000000 (the f16 exponent bias
//                   is 15, the code's 7, or 8 for FNUZ), widened; unit 256 (128 for FNUZ).
// The instructions keep NaN codes NaN. The bit manipulation turns them into finite
// numbers, so it also records them in an Fp8NanWatch, which the kernel asks at the end
// (one word operation per 4 codes); on the instruction paths the watch is empty and
// compiles away.
#pragma once

// gpu.h first: on HIP the vendor runtime header must precede kernels/common/host_device.h.
#include "kernels/common/gpu.h"

#include <cstdint>

#include "kernels/common/fp8.h"

namespace kvfuse::gpu {

namespace detail {

// The targets with a decode instruction (1) or without (0), each branch below compiled only
// for its own target: a builtin of one AMD generation is not even spelled for the other.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVFUSE_FP8_DECODE_NV 1
#else
#define KVFUSE_FP8_DECODE_NV 0
#endif
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx950__)
#define KVFUSE_FP8_DECODE_AMD_OCP 1  // gfx950 decodes OCP e4m3fn
#else
#define KVFUSE_FP8_DECODE_AMD_OCP 0
#endif
#if defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#define KVFUSE_FP8_DECODE_AMD_FNUZ 1  // gfx940-942 decode FNUZ e4m3
#else
#define KVFUSE_FP8_DECODE_AMD_FNUZ 0
#endif
constexpr bool kNvHwFp8Decode = KVFUSE_FP8_DECODE_NV;
constexpr bool kAmdHwOcpDecode = KVFUSE_FP8_DECODE_AMD_OCP;
constexpr bool kAmdHwFnuzDecode = KVFUSE_FP8_DECODE_AMD_FNUZ;

}  // namespace detail

// True where the current device target decodes format F with an instruction (the values
// exact, unit 1, NaN kept), false where the bits are moved by hand.
template <Fp8Format F>
KVFUSE_DEVICE constexpr bool fp8_decode_native() {
  static_assert(F == Fp8Format::e4m3fn || F == Fp8Format::e4m3fnuz, "e4m3 formats");
  if constexpr (F == Fp8Format::e4m3fn) return detail::kNvHwFp8Decode || detail::kAmdHwOcpDecode;
  return detail::kAmdHwFnuzDecode;
}

// decode(code) / (what fp8x4_decode<F> gives): 1 on the instruction paths, else 2^8 (2^7).
template <Fp8Format F>
KVFUSE_DEVICE constexpr float fp8_decode_unit() {
  if constexpr (fp8_decode_native<F>()) return 1.0f;
  return F == Fp8Format::e4m3fnuz ? 128.0f : 256.0f;
}

// Whether any code passed to fp8x4_decode<F> with this watch was a NaN code. Empty (always
// false) where the instruction keeps NaN as NaN.
template <Fp8Format F>
struct Fp8NanWatch {
  uint32_t bits = 0;
  // One word of four codes. e4m3fn: (c & 0x7f) + 1 sets bit 7 exactly for c & 0x7f = 0x7f,
  // without a carry into the next byte. e4m3fnuz (NaN 0x80 only): v = c ^ 0x80 is zero
  // exactly for NaN, and (v - 1) & ~v & 0x80 over the word is non-zero iff some byte of v
  // is zero (a borrow only ever starts at a zero byte).
  KVFUSE_DEVICE void add(uint32_t w) {
    if constexpr (!fp8_decode_native<F>()) {
      if constexpr (F == Fp8Format::e4m3fn) {
        bits |= (w & 0x7f7f7f7fu) + 0x01010101u;
      } else {
        const uint32_t v = w ^ 0x80808080u;
        bits |= (v - 0x01010101u) & ~v;
      }
    }
  }
  KVFUSE_DEVICE bool any() const {
    if constexpr (fp8_decode_native<F>()) return false;
    return (bits & 0x80808080u) != 0;
  }
};

// Codes [c0 c1 c2 c3] of w (c0 in the low byte) -> v[0 .. 4) = decode(c) / fp8_decode_unit<F>(),
// exact; NaN codes are NaN on the instruction paths and recorded in `nan` on the others.
template <Fp8Format F>
KVFUSE_DEVICE void fp8x4_decode(uint32_t w, float (&v)[4], Fp8NanWatch<F>& nan) {
  if constexpr (F == Fp8Format::e4m3fn && detail::kNvHwFp8Decode) {
#if KVFUSE_FP8_DECODE_NV
    uint32_t lo, hi;
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
    v[0] = f16_bits_to_f32(uint16_t(lo & 0xffffu));
    v[1] = f16_bits_to_f32(uint16_t(lo >> 16));
    v[2] = f16_bits_to_f32(uint16_t(hi & 0xffffu));
    v[3] = f16_bits_to_f32(uint16_t(hi >> 16));
#endif
  } else if constexpr (F == Fp8Format::e4m3fnuz && detail::kAmdHwFnuzDecode) {
#if KVFUSE_FP8_DECODE_AMD_FNUZ
    using F2 = float __attribute__((ext_vector_type(2)));
    const F2 a = __builtin_amdgcn_cvt_pk_f32_fp8(int(w), false);  // bytes 0, 1
    const F2 b = __builtin_amdgcn_cvt_pk_f32_fp8(int(w), true);   // bytes 2, 3
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
#endif
  } else if constexpr (F == Fp8Format::e4m3fn && detail::kAmdHwOcpDecode) {
#if KVFUSE_FP8_DECODE_AMD_OCP
    using F2 = float __attribute__((ext_vector_type(2)));
    const F2 a = __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(w, 1.0f, false);  // bytes 0, 1
    const F2 b = __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(w, 1.0f, true);   // bytes 2, 3
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
#endif
  } else {
    nan.add(w);
    // Bytes 0, 1 (2, 3) to the top of each half of x (y), then s.eeee.mmm -> s.0eeee.mmm0000000.
    const uint32_t x = vendor_byte_perm(w, 0u, 0x1404), y = vendor_byte_perm(w, 0u, 0x3424);
    const uint32_t lo = (x & 0x80008000u) | ((x & 0x7f007f00u) >> 1);
    const uint32_t hi = (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
    v[0] = f16_bits_to_f32(uint16_t(lo & 0xffffu));
    v[1] = f16_bits_to_f32(uint16_t(lo >> 16));
    v[2] = f16_bits_to_f32(uint16_t(hi & 0xffffu));
    v[3] = f16_bits_to_f32(uint16_t(hi >> 16));
  }
}

// Eight codes (two words, w0 first) -> v[0 .. 8).
template <Fp8Format F>
KVFUSE_DEVICE void fp8x8_decode(uint32_t w0, uint32_t w1, float (&v)[8], Fp8NanWatch<F>& nan) {
  float a[4], b[4];
  fp8x4_decode<F>(w0, a, nan);
  fp8x4_decode<F>(w1, b, nan);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[j] = a[j];
    v[4 + j] = b[j];
  }
}

}  // namespace kvfuse::gpu
