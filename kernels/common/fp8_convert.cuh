// Packed fp32 -> FP8 conversion on the device, with the write semantics of
// docs/design.md#fp8-encoding-and-saturation: round to nearest even; finite overflow and +-inf saturate to +-max finite;
// every NaN becomes the format's canonical NaN (0x7f e4m3fn/e5m2, 0x80 e4m3fnuz). The
// bytes equal kvfuse::fp8_encode (kernels/common/fp8.h), the CPU reference, for every input.
//
// Which instruction does the work is decided here, once, so kernels have no #if:
//   NVIDIA sm_89+   e4m3fn, e5m2: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, which already
//                   has these semantics (tests/data/all_bf16.*_satfinite.u8 came from it);
//                   e4m3fnuz: scalar fp8_encode (NVIDIA has no FNUZ instruction).
//   NVIDIA < sm_89  scalar fp8_encode (sm_80 has no FP8 conversion instruction).
//   AMD gfx942      v_cvt_pk_fp8_f32 / v_cvt_pk_bf8_f32 for all three formats, see
//                   AmdCvtRecipe: the hardware formats are FNUZ (e4m3fnuz, e5m2fnuz)
//                   and the instruction does not saturate.
//   AMD gfx950      the same instructions convert to OCP e4m3fn / e5m2 (no saturation
//                   either); e4m3fnuz is not native there: scalar fp8_encode.
//   anything else   scalar fp8_encode.
#pragma once

// gpu.h first: on HIP the vendor runtime header defines __forceinline__, which
// KVFUSE_HD in kernels/common/host_device.h expands to.
#include "kernels/common/gpu.h"

#include "kernels/common/fp8.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu {

// The 1 / scale pair of a scaled KV write: the reciprocals the pool keeps beside the
// scales when it has them (PagedKvView::k_inv_scale), else recip_rn of the scales, both
// loads issued before either value is used (load_f32_pair). The fused, decode-token and
// RoPE writes read them per row, after the row's own loads are issued.
KVFUSE_DEVICE void load_inv_scales(const PagedKvView& cache, float& inv_k, float& inv_v) {
  if (cache.k_inv_scale != nullptr && cache.v_inv_scale != nullptr) {
    load_f32_pair(cache.k_inv_scale, cache.v_inv_scale, inv_k, inv_v);
  } else {
    float k_scale, v_scale;
    load_f32_pair(cache.k_scale, cache.v_scale, k_scale, v_scale);
    inv_k = recip_rn(k_scale);
    inv_v = recip_rn(v_scale);
  }
}

// The AMD conversion recipe, written for both hosts and devices so tests can run it
// with an emulated instruction (tests/gpu) — there is no AMD GPU to run it on.
//
// 1. Clamp to +-max finite of the target format with comparisons that let NaN through
//    (fminf/fmaxf would turn NaN into a number): the instruction does not saturate,
//    so without the clamp overflow would become NaN and poison the cache.
// 2. On gfx942 the instruction writes FNUZ codes. An FNUZ code means exactly half the
//    value of the same OCP code (bias 8 vs 7 for e4m3, 16 vs 15 for e5m2, subnormals
//    included), so the OCP code of x is the FNUZ code of x/2. Halving is exact for
//    every value that can round to a non-zero FP8 code, and the clamped x/2 stays
//    below the FNUZ-only top codes (224 < 240, 28672 < 57344), so one instruction
//    serves e4m3fn, e4m3fnuz and e5m2.
// 3. Fix the two cases the instruction does not define our way: NaN becomes the
//    canonical NaN of the target, and a result of zero takes the sign the target
//    requires (OCP keeps -0 as 0x80; FNUZ has no -0, 0x80 is its NaN).
template <Fp8Format F, bool kHwFnuz>
struct AmdCvtRecipe {
  static_assert(kHwFnuz || F != Fp8Format::e4m3fnuz,
                "OCP hardware (gfx950) has no FNUZ mode: use fp8_encode");
  static constexpr bool kBf8 = F == Fp8Format::e5m2;  // v_cvt_pk_bf8_f32 rather than _fp8_
  static constexpr bool kTargetFnuz = F == Fp8Format::e4m3fnuz;

  KVFUSE_HD static float prepare(float x) {
    const float m = fp8_max_finite(F);
    const float y = x > m ? m : (x < -m ? -m : x);  // NaN compares false: stays NaN
    return (kHwFnuz && !kTargetFnuz) ? y * 0.5f : y;
  }

  // `raw` is the instruction's byte for prepare(x).
  KVFUSE_HD static uint32_t fixup(uint32_t raw, float x) {
    if (x != x) return fp8_spec(F).nan_code;  // x != x: NaN (no fast-math in kvfuse)
    if ((raw & 0x7fu) == 0) return kTargetFnuz ? 0u : (f32_bits(x) >> 31) << 7;
    return raw;
  }
};

namespace detail {

KVFUSE_DEVICE uint32_t pack4(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
}

template <Fp8Format F>
KVFUSE_DEVICE uint32_t cvt_fp8x4_scalar(float a, float b, float c, float d) {
  return pack4(fp8_encode(a, F), fp8_encode(b, F), fp8_encode(c, F), fp8_encode(d, F));
}

#if defined(__HIP_DEVICE_COMPILE__) && \
    (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__))
#if defined(__gfx950__)
constexpr bool kAmdHwFnuz = false;  // gfx950 converts to OCP formats
#else
constexpr bool kAmdHwFnuz = true;  // gfx940-942 convert to FNUZ formats
#endif
#define KVFUSE_AMD_FP8_CVT 1

template <Fp8Format F>
KVFUSE_DEVICE uint32_t cvt_fp8x4_amd(float a, float b, float c, float d) {
  using R = AmdCvtRecipe<F, kAmdHwFnuz>;
  const float pa = R::prepare(a), pb = R::prepare(b), pc = R::prepare(c), pd = R::prepare(d);
  int w;
  if constexpr (R::kBf8) {
    w = __builtin_amdgcn_cvt_pk_bf8_f32(pa, pb, 0, false);  // bytes 0, 1
    w = __builtin_amdgcn_cvt_pk_bf8_f32(pc, pd, w, true);   // bytes 2, 3
  } else {
    w = __builtin_amdgcn_cvt_pk_fp8_f32(pa, pb, 0, false);
    w = __builtin_amdgcn_cvt_pk_fp8_f32(pc, pd, w, true);
  }
  const uint32_t u = uint32_t(w);
  return pack4(R::fixup(u & 0xffu, a), R::fixup((u >> 8) & 0xffu, b), R::fixup((u >> 16) & 0xffu, c),
               R::fixup(u >> 24, d));
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVFUSE_NV_FP8_CVT 1
// cvt.rn.satfinite.<fmt>x2.f32 d, a, b puts a in the upper byte of d, b in the lower.
KVFUSE_DEVICE uint32_t nv_cvt_e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}
KVFUSE_DEVICE uint32_t nv_cvt_e5m2x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}
#endif

}  // namespace detail

// Four fp32 values -> four FP8 bytes of format F, `a` in the lowest byte.
template <Fp8Format F>
KVFUSE_DEVICE uint32_t cvt_fp8x4(float a, float b, float c, float d) {
#if defined(KVFUSE_AMD_FP8_CVT)
  if constexpr (detail::kAmdHwFnuz || F != Fp8Format::e4m3fnuz) {
    return detail::cvt_fp8x4_amd<F>(a, b, c, d);
  } else {
    return detail::cvt_fp8x4_scalar<F>(a, b, c, d);
  }
#elif defined(KVFUSE_NV_FP8_CVT)
  if constexpr (F == Fp8Format::e4m3fn) {
    return detail::nv_cvt_e4m3x4(a, b, c, d);
  } else if constexpr (F == Fp8Format::e5m2) {
    return detail::nv_cvt_e5m2x4(a, b, c, d);
  } else {
    return detail::cvt_fp8x4_scalar<F>(a, b, c, d);
  }
#else
  return detail::cvt_fp8x4_scalar<F>(a, b, c, d);
#endif
}

// Sixteen fp32 values -> sixteen FP8 bytes (one 16-byte store).
template <Fp8Format F>
KVFUSE_DEVICE uint4 cvt_fp8x16(const float (&x)[16]) {
  uint4 r;
  r.x = cvt_fp8x4<F>(x[0], x[1], x[2], x[3]);
  r.y = cvt_fp8x4<F>(x[4], x[5], x[6], x[7]);
  r.z = cvt_fp8x4<F>(x[8], x[9], x[10], x[11]);
  r.w = cvt_fp8x4<F>(x[12], x[13], x[14], x[15]);
  return r;
}

// Names the conversion that cvt_fp8x4<F> compiles to on the current device target, for
// tests and benchmarks to print (so a log says which path it measured).
template <Fp8Format F>
KVFUSE_DEVICE int fp8_cvt_path_id() {
#if defined(KVFUSE_AMD_FP8_CVT)
  return (detail::kAmdHwFnuz || F != Fp8Format::e4m3fnuz) ? 2 : 0;
#elif defined(KVFUSE_NV_FP8_CVT)
  return F == Fp8Format::e4m3fnuz ? 0 : 1;
#else
  return 0;
#endif
}

inline const char* fp8_cvt_path_name(int id) {
  switch (id) {
    case 1:
      return "cvt.rn.satfinite (packed)";
    case 2:
      return "v_cvt_pk_{fp8,bf8}_f32 + clamp (packed)";
    default:
      return "scalar fp8_encode";
  }
}

}  // namespace kvfuse::gpu
