// Device helpers of the paged attention kernels (attention_unified.cu, and
// attention_merge.cuh's lane groups) that differ between vendors, so that the kernels
// have no #if of their own: the warp-level MMA m16n8k16 (PTX mma.sync on NVIDIA sm_80+,
// emulated with shuffles over the same fragment layouts elsewhere: HIP, host passes),
// FP8 -> f16 (cvt.rn.f16x2.e4m3x2 on sm_89+, bit manipulation elsewhere) and fp32 ->
// f16x2 / bf16x2 packing. Include after kernels/common/gpu.h; for the attention kernels only
// (through kernels/attention/attention_tile.cuh).
#pragma once

#include "kernels/common/gpu.h"

#include <cstdint>

#include "kernels/common/bf16.h"

namespace kvfuse::gpu::attention_detail {

constexpr int kMmaLanes = 32;  // the m16n8k16 fragment layouts are defined over 32 lanes
static_assert(kWarpSize % kMmaLanes == 0, "a warp holds whole MMA groups");

// Cache element kinds the kernels are instantiated for.
enum class KvKind : int { bf16, e4m3fn_hw, e4m3fn_bits, e4m3fnuz, e5m2 };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KVFUSE_ATTN_HW_MMA 1
#else
#define KVFUSE_ATTN_HW_MMA 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVFUSE_ATTN_HW_FP8 1
#else
#define KVFUSE_ATTN_HW_FP8 0
#endif

KVFUSE_DEVICE int glane() { return int(threadIdx.x) % kMmaLanes; }
KVFUSE_DEVICE int group_id() { return int(threadIdx.x) / kMmaLanes; }

// Value of `x` in lane `src` (0..31) of the caller's 32-lane group.
template <class T>
KVFUSE_DEVICE T group_shfl(T x, int src) {
  return warp_broadcast(x, (lane_id() & ~(kMmaLanes - 1)) | src);
}

// CUDA's __byte_perm: byte i of the result is byte (s >> 4i) & 7 of y:x (one v_perm_b32 on AMD).
KVFUSE_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) { return vendor_byte_perm(x, y, s); }

// Two fp32 -> packed f16x2 / bf16x2 (low half first), round to nearest even.
template <bool kBf16>
KVFUSE_DEVICE uint32_t pack_rn(float lo, float hi) {
#if KVFUSE_ATTN_HW_MMA
  uint32_t d;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
#else
  if constexpr (kBf16) {
    return uint32_t(f32_to_bf16(lo)) | (uint32_t(f32_to_bf16(hi)) << 16);
  } else {
    return uint32_t(f32_to_f16(lo)) | (uint32_t(f32_to_f16(hi)) << 16);
  }
#endif
}

template <bool kBf16>
KVFUSE_DEVICE float half_lo(uint32_t w) {
  if constexpr (kBf16) return __uint_as_float(w << 16);
  return f16_bits_to_f32(uint16_t(w & 0xffffu));
}
template <bool kBf16>
KVFUSE_DEVICE float half_hi(uint32_t w) {
  if constexpr (kBf16) return __uint_as_float(w & 0xffff0000u);
  return f16_bits_to_f32(uint16_t(w >> 16));
}

// D += A . B, m16n8k16, f16 or bf16 inputs, fp32 accumulators, fragment layouts of PTX
// mma.m16n8k16 (g = lane / 4, c = lane % 4):
//   A regs: {A[g][2c..2c+1]}, {A[g+8][2c..2c+1]}, {A[g][2c+8..2c+9]}, {A[g+8][2c+8..2c+9]}
//   B regs: {B[2c..2c+1][g]}, {B[2c+8..2c+9][g]}
//   D: D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]
template <bool kBf16>
KVFUSE_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if KVFUSE_ATTN_HW_MMA
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  const int l = glane(), g = l >> 2, c = l & 3;
  const auto dot2 = [](uint32_t x, uint32_t y) {
    return half_lo<kBf16>(x) * half_lo<kBf16>(y) + half_hi<kBf16>(x) * half_hi<kBf16>(y);
  };
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // the four lanes that hold a row of A / a column of B
    const uint32_t a0 = group_shfl(a[0], 4 * g + k), a1 = group_shfl(a[1], 4 * g + k);
    const uint32_t a2 = group_shfl(a[2], 4 * g + k), a3 = group_shfl(a[3], 4 * g + k);
    const uint32_t b00 = group_shfl(b[0], 8 * c + k), b01 = group_shfl(b[1], 8 * c + k);
    const uint32_t b10 = group_shfl(b[0], 8 * c + 4 + k), b11 = group_shfl(b[1], 8 * c + 4 + k);
    d[0] += dot2(a0, b00) + dot2(a2, b01);
    d[1] += dot2(a0, b10) + dot2(a2, b11);
    d[2] += dot2(a1, b00) + dot2(a3, b01);
    d[3] += dot2(a1, b10) + dot2(a3, b11);
  }
#endif
}

// Four FP8 codes [x0 x1 x2 x3] (x0 in the low byte) -> f16x2 {x0, x1} and {x2, x3}, each
// value decode(x) / fp8_raw_factor<K>(), exact for every non-NaN code. (The bit
// manipulation maps NaN codes to finite values; the instruction keeps them NaN.)
template <KvKind K>
KVFUSE_DEVICE void fp8x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (K == KvKind::e5m2) {
    // An e5m2 code is the top byte of the f16 with the same value.
    lo = byte_perm(w, 0u, 0x1404);
    hi = byte_perm(w, 0u, 0x3424);
  } else if constexpr (K == KvKind::e4m3fn_hw && KVFUSE_ATTN_HW_FP8) {
#if KVFUSE_ATTN_HW_FP8
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#endif
  } else {
    // e4m3 s.eeee.mmm -> f16 s.0eeee.mmm0000000: the f16 exponent bias is 15 instead of 7
    // (8 for FNUZ), subnormals included, so the f16 is the value times 2^-8 (2^-7).
    const uint32_t x = byte_perm(w, 0u, 0x1404), y = byte_perm(w, 0u, 0x3424);
    lo = (x & 0x80008000u) | ((x & 0x7f007f00u) >> 1);
    hi = (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
  }
}

template <KvKind K>
KVFUSE_DEVICE float fp8_raw_factor() {
  if constexpr (K == KvKind::e4m3fn_hw && KVFUSE_ATTN_HW_FP8) return 1.0f;
  if constexpr (K == KvKind::e4m3fn_hw || K == KvKind::e4m3fn_bits) return 256.0f;
  if constexpr (K == KvKind::e4m3fnuz) return 128.0f;
  return 1.0f;
}

}  // namespace kvfuse::gpu::attention_detail
