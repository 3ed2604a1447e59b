// The CDNA paged attention kernel: kernels/attention/mfma/attention_mfma.h's block run by the wavefront
// itself (the executor below), for gfx942 and gfx950. HIP only; on CUDA
// launch_attention_mfma refuses (kernels/attention/attention_unified.cu launches the mma.sync
// kernel there).
//
// FP8 conversions, per target (kernels/attention/mfma/attention_mfma.h wants four codes as two f16x2
// words of decode(x) / factor):
//   gfx942  e4m3fnuz: v_cvt_pk_f32_fp8 (its native FNUZ format) then v_cvt_pkrtz_f16_f32,
//           exact (every e4m3fnuz value is an f16), factor 1.
//           e4m3fn: bit manipulation (the instruction reads FNUZ, where 0x80, OCP's -0,
//           is NaN), factor 256.
//   gfx950  e4m3fn: v_cvt_scalef32_pk_f16_fp8 with scale 1 (OCP is its native format),
//           factor 1. e4m3fnuz: bit manipulation (no FNUZ mode), factor 128.
//   both    e5m2: the code is the top byte of its f16, one byte permute per word.
#include "kernels/common/gpu.h"

#include "kernels/attention/mfma/attention_mfma.h"
#include "kernels/attention/attention_tile.cuh"
#include "kernels/common/dispatch.cuh"
#include "kernels/attention/mfma/mfma.cuh"

namespace kvfuse::gpu::attention_detail {

#if defined(__HIP__)
namespace {

#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx950__)
constexpr bool kHwOcpFp8 = true;  // gfx950: OCP e4m3fn in hardware
constexpr bool kHwFnuzFp8 = false;
#elif defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
constexpr bool kHwOcpFp8 = false;
constexpr bool kHwFnuzFp8 = true;  // gfx942: FNUZ e4m3 in hardware
#else
constexpr bool kHwOcpFp8 = false;
constexpr bool kHwFnuzFp8 = false;
#endif

// The wavefront as kernels/attention/mfma/attention_mfma.h's executor.
struct WaveExec {
  KVFUSE_DEVICE int lane() const { return int(threadIdx.x) & 63; }
  KVFUSE_DEVICE int wave() const { return int(threadIdx.x) >> 6; }
  KVFUSE_DEVICE int64_t block() const { return int64_t(blockIdx.x); }
  KVFUSE_DEVICE void sync() const { __syncthreads(); }
  KVFUSE_DEVICE float shfl_xor(float v, int mask) const { return __shfl_xor(v, mask, 64); }
  KVFUSE_DEVICE float exp2(float v) const { return exp2f(v); }
  KVFUSE_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) const {
    return vendor_byte_perm(x, y, s);
  }

  template <bool kBf16>
  KVFUSE_DEVICE void mfma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) const {
    using U4 = uint32_t __attribute__((ext_vector_type(4)));
    const MfmaOperand8 va = __builtin_bit_cast(MfmaOperand8, U4{a[0], a[1], a[2], a[3]});
    const MfmaOperand8 vb = __builtin_bit_cast(MfmaOperand8, U4{b[0], b[1], b[2], b[3]});
    MfmaAcc4 acc = {d[0], d[1], d[2], d[3]};
    acc = kBf16 ? mfma_16x16x32_bf16(va, vb, acc) : mfma_16x16x32_f16(va, vb, acc);
    d[0] = acc[0];
    d[1] = acc[1];
    d[2] = acc[2];
    d[3] = acc[3];
  }

  template <bool kBf16>
  KVFUSE_DEVICE uint32_t pack_rn(float lo, float hi) const {
    if constexpr (kBf16) {
      return uint32_t(f32_to_bf16(lo)) | (uint32_t(f32_to_bf16(hi)) << 16);
    } else {
      using H2 = _Float16 __attribute__((ext_vector_type(2)));
      return __builtin_bit_cast(uint32_t, H2{static_cast<_Float16>(lo), static_cast<_Float16>(hi)});
    }
  }
  template <bool kBf16>
  KVFUSE_DEVICE float half_lo(uint32_t w) const {
    if constexpr (kBf16) return __uint_as_float(w << 16);
    return vendor_f16_to_f32(uint16_t(w & 0xffffu));
  }
  template <bool kBf16>
  KVFUSE_DEVICE float half_hi(uint32_t w) const {
    if constexpr (kBf16) return __uint_as_float(w & 0xffff0000u);
    return vendor_f16_to_f32(uint16_t(w >> 16));
  }

  template <KvFormat F>
  KVFUSE_DEVICE float fp8_factor() const {
    if constexpr ((F == KvFormat::fp8_e4m3fn && kHwOcpFp8) || (F == KvFormat::fp8_e4m3fnuz && kHwFnuzFp8)) {
      return 1.0f;
    }
    return mfma_attn::fp8_bits_factor(F);
  }
  template <KvFormat F>
  KVFUSE_DEVICE void cvt_fp8x4(uint32_t w, uint32_t& lo, uint32_t& hi) const {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx950__)
    if constexpr (F == KvFormat::fp8_e4m3fn) {
      lo = __builtin_bit_cast(uint32_t, __builtin_amdgcn_cvt_scalef32_pk_f16_fp8(w, 1.0f, false));
      hi = __builtin_bit_cast(uint32_t, __builtin_amdgcn_cvt_scalef32_pk_f16_fp8(w, 1.0f, true));
      return;
    }
#elif defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
    if constexpr (F == KvFormat::fp8_e4m3fnuz) {
      using F2 = float __attribute__((ext_vector_type(2)));
      const F2 a = __builtin_amdgcn_cvt_pk_f32_fp8(int(w), false);
      const F2 b = __builtin_amdgcn_cvt_pk_f32_fp8(int(w), true);
      lo = __builtin_bit_cast(uint32_t, __builtin_amdgcn_cvt_pkrtz(a.x, a.y));
      hi = __builtin_bit_cast(uint32_t, __builtin_amdgcn_cvt_pkrtz(b.x, b.y));
      return;
    }
#endif
    if constexpr (F == KvFormat::fp8_e5m2) {
      lo = vendor_byte_perm(w, 0u, 0x1404);
      hi = vendor_byte_perm(w, 0u, 0x3424);
    } else {
      mfma_attn::fp8x4_to_f16x2_bits<F>(w, lo, hi);
    }
  }

  template <int N>
  KVFUSE_DEVICE void load_words(const void* src, uint32_t* out) const {
    if constexpr (N == 4) {
      const uint4 v = *static_cast<const uint4*>(src);
      out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else if constexpr (N == 2) {
      const uint2 v = *static_cast<const uint2*>(src);
      out[0] = v.x, out[1] = v.y;
    } else {
      static_assert(N == 1, "1, 2 or 4 words");
      out[0] = *static_cast<const uint32_t*>(src);
    }
  }
  // N words of bf16 pairs to dst, 16-byte stores where dst allows.
  template <int N>
  KVFUSE_DEVICE void store_words(bf16_t* dst, const uint32_t* words) const {
    if ((reinterpret_cast<uintptr_t>(dst) & 15u) == 0 && N % 4 == 0) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        reinterpret_cast<uint4*>(dst)[i / 4] = make_uint4(words[i], words[i + 1], words[i + 2], words[i + 3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        dst[2 * i] = bf16_t(words[i] & 0xffffu);
        dst[2 * i + 1] = bf16_t(words[i] >> 16);
      }
    }
  }
};

template <int D, KvFormat F, bool kPageTiles>
__global__ void KVFUSE_LAUNCH_BOUNDS(mfma_attn::kThreads, mfma_attn::kBlocksPerCu)
    attention_mfma_kernel(Params p) {
  __shared__ mfma_attn::Smem<D> sm;
  WaveExec x;
  mfma_attn::block<D, F, kPageTiles>(x, p, sm);
}

template <int D, KvFormat F>
cudaError_t launch_mfma(const Params& p, int64_t blocks, cudaStream_t stream) {
  constexpr unsigned kThreads = mfma_attn::kThreads;
  return p.page_tiles
             ? launch_kernel(attention_mfma_kernel<D, F, true>, unsigned(blocks), kThreads, stream, false, p)
             : launch_kernel(attention_mfma_kernel<D, F, false>, unsigned(blocks), kThreads, stream, false,
                             p);
}

// Blocks of one instance resident on a CU of the current device, from the runtime's
// occupancy calculator: it sees the instance's own VGPR count and LDS (the kernel table
// gives 2 to 4 waves per SIMD across instances) and the device's CU limits, so the split
// path sizes its waves per arch and per instance instead of with the launch bound.
template <int D, KvFormat F>
int32_t mfma_blocks_per_cu(bool page_tiles) {
  int n = 0;
  const cudaError_t e =
      page_tiles ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attention_mfma_kernel<D, F, true>,
                                                                 int(mfma_attn::kThreads), 0)
                 : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attention_mfma_kernel<D, F, false>,
                                                                 int(mfma_attn::kThreads), 0);
  return e == cudaSuccess && n > 0 ? int32_t(n) : mfma_attn::kBlocksPerCu;
}

}  // namespace

int32_t attention_mfma_blocks_per_cu(int32_t head_dim, KvFormat format, bool page_tiles) {
  // Per device and instance, asked once: the answer depends on nothing else.
  const int slot = ((head_dim / 64) * 8 + int(format)) * 2 + (page_tiles ? 1 : 0);
  return once_per_device<64>(slot, mfma_attn::kBlocksPerCu, [&] {
    return dispatch_head_dim_format(head_dim, format, [&](auto hd, auto fmt) {
      return mfma_blocks_per_cu<decltype(hd)::value, decltype(fmt)::value>(page_tiles);
    });
  });
}

cudaError_t launch_attention_mfma(const Params& p, int64_t blocks, cudaStream_t stream) {
  if (blocks <= 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_head_dim_format(p.a.cache.head_dim, p.a.cache.format, [&](auto hd, auto fmt) {
    return launch_mfma<decltype(hd)::value, decltype(fmt)::value>(p, blocks, stream);
  });
}

#else

cudaError_t launch_attention_mfma(const Params&, int64_t, cudaStream_t) { return cudaErrorInvalidValue; }
int32_t attention_mfma_blocks_per_cu(int32_t, KvFormat, bool) { return mfma_attn::kBlocksPerCu; }

#endif  // __HIP__

}  // namespace kvfuse::gpu::attention_detail
