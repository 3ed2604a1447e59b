// The rows of the KV write kernels (kernels/kv_write/kv_write.cu): the source loads and
// their exact widening, the row operations (what one chunk of a row becomes in the cache:
// the FP8 conversion or the bf16 copy) and RowGroup, a lane's chunks of a K row and a V
// row between load and store. The numerics are kernels/kv_write/kv_write.cu's (its first
// comment).
//
// For kernels/kv_write/kv_write.cu only: everything here has internal linkage, as it
// had there, so the kernel instances keep their names (the row operations are template
// arguments of kv_write_fused_kernel and kv_write_token_kernel, whose names
// scripts/ci/hip-kernel-report.py reads).
#pragma once

#include "kernels/common/gpu.h"

#include <cstdint>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu {
namespace {

// Chunks a lane of a row team holds between load and store (RowGroup).
constexpr int kUnroll = 2;

// --- Source loads ------------------------------------------------------------------

// Eight raw 16-bit source elements. The vector path needs 16-byte alignment of the row
// start and the chunk; the scalar path serves misaligned views (e.g. a QKV projection
// sliced at an odd offset).
template <bool kVec>
KVFUSE_DEVICE uint4 load_raw8(const uint16_t* p) {
  if constexpr (kVec) {
    return load_ro_16B(p);
  } else {
    uint4 r;
    r.x = uint32_t(p[0]) | (uint32_t(p[1]) << 16);
    r.y = uint32_t(p[2]) | (uint32_t(p[3]) << 16);
    r.z = uint32_t(p[4]) | (uint32_t(p[5]) << 16);
    r.w = uint32_t(p[6]) | (uint32_t(p[7]) << 16);
    return r;
  }
}

// Exact widening of 8 packed source elements to fp32, for FP8 targets (hardware f16
// conversion: a NaN stays a NaN, which is all an FP8 target needs).
template <KvSrcDtype S>
KVFUSE_DEVICE void widen8(uint4 raw, float* x) {
  if constexpr (S == KvSrcDtype::bf16) {
    widen_bf16x8(raw, x);
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = f16_bits_to_f32(uint16_t(w[i]));
      x[2 * i + 1] = f16_bits_to_f32(uint16_t(w[i] >> 16));
    }
  }
}

// Exact widening for a bf16 target: NaN payloads must survive to match the reference.
template <KvSrcDtype S>
KVFUSE_DEVICE float widen_exact(uint16_t bits) {
  if constexpr (S == KvSrcDtype::bf16) {
    return bf16_bits_to_f32(bits);
  } else {
    return f16_to_f32(bits);
  }
}

// --- Row operations: what one chunk of a row becomes in the cache -------------------

// FP8 cache: 16 source elements (two 16-byte loads) -> 16 bytes.
template <KvSrcDtype S, Fp8Format F>
struct Fp8RowOp {
  static constexpr int kChunkElems = 16;
  static constexpr int kLoads = 2;
  static constexpr int kOutBytesPerElem = 1;
  static constexpr bool kScaled = true;
  KVFUSE_DEVICE static uint4 convert(const uint4 (&raw)[kLoads], float inv) {
    float x[16];
    widen8<S>(raw[0], x);
    widen8<S>(raw[1], x + 8);
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] *= inv;
    return cvt_fp8x16<F>(x);
  }
  // Half a chunk, 8 source elements -> 8 bytes: the bytes `convert` gives them.
  KVFUSE_DEVICE static uint2 convert8(const uint4& raw, float inv) {
    float x[8];
    widen8<S>(raw, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= inv;
    return make_uint2(cvt_fp8x4<F>(x[0], x[1], x[2], x[3]), cvt_fp8x4<F>(x[4], x[5], x[6], x[7]));
  }
};

// bf16 cache: 8 source elements (one 16-byte load) -> 16 bytes, unscaled.
template <KvSrcDtype S>
struct Bf16RowOp {
  static constexpr int kChunkElems = 8;
  static constexpr int kLoads = 1;
  static constexpr int kOutBytesPerElem = 2;
  static constexpr bool kScaled = false;
  KVFUSE_DEVICE static uint4 convert(const uint4 (&raw)[kLoads], float /*inv*/) {
    if constexpr (S == KvSrcDtype::bf16) {
      return raw[0];  // bit copy, NaN payloads included
    } else {
      uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = f32_to_bf16(f16_to_f32(uint16_t(w[i])));
        const uint32_t hi = f32_to_bf16(f16_to_f32(uint16_t(w[i] >> 16)));
        w[i] = lo | (hi << 16);
      }
      return make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
};

// --- Row pipeline: a lane's chunks between load and store ----------------------------

// The chunks c0, c0 + lanes, ... (kUnroll of them) of a K row and a V row, in registers
// between load and store; `lanes` is the row team's size.
template <class Op, bool kVec>
struct RowGroup {
  uint4 k[kUnroll][Op::kLoads];
  uint4 v[kUnroll][Op::kLoads];

  KVFUSE_DEVICE void load(const uint16_t* ks, const uint16_t* vs, int c0, int chunks, int lanes) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * lanes;
      if (c < chunks) {
#pragma unroll
        for (int l = 0; l < Op::kLoads; ++l) {
          k[u][l] = load_raw8<kVec>(ks + c * Op::kChunkElems + l * 8);
          v[u][l] = load_raw8<kVec>(vs + c * Op::kChunkElems + l * 8);
        }
      }
    }
  }

  KVFUSE_DEVICE void store(uint8_t* kd, uint8_t* vd, int c0, int chunks, int lanes, float inv_k,
                           float inv_v) const {
    constexpr int kOutChunkBytes = Op::kChunkElems * Op::kOutBytesPerElem;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * lanes;
      if (c < chunks) {
        store_16B(kd + c * kOutChunkBytes, Op::convert(k[u], inv_k));
        store_16B(vd + c * kOutChunkBytes, Op::convert(v[u], inv_v));
      }
    }
  }
};

}  // namespace
}  // namespace kvfuse::gpu
