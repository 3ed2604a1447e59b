// KV write kernels, one CUDA-dialect source for CUDA and HIP (kernels/common/gpu.h).
//
// Numerics are the CPU reference's (kernels/cpu/kv_write/kv_write.cc), so the bytes are equal:
// - FP8 cache: stored = fp8(x * inv), inv = 1/scale computed once per thread in fp32 and
//   correctly rounded (recip_rn), x the source element widened exactly to fp32, one fp32
//   multiply (nothing to contract into an FMA), then the saturating conversion of
//   fp8_convert.cuh.
// - bf16 cache: no scaling. A bf16 source is copied bit for bit; an f16 source is widened
//   with kvfuse::f16_to_f32 (exact, NaN payload kept, as the reference does; the
//   hardware conversion may canonicalise NaN) and rounded with kvfuse::f32_to_bf16.
//
// Thread mapping of the fused write: a row team writes one token row. A row is all
// heads of one token, H * D contiguous elements in the source and, because the cache
// is NHD, H * D contiguous elements at the slot in the cache, so head_dim only matters
// through H * D. Each lane of the team takes 16-element chunks (two 16-byte loads, one
// 16-byte FP8 store; one load and one store for bf16) of the K row and the same chunks
// of the V row, kUnroll chunks at a time so that 4 * kUnroll 16-byte loads are in
// flight per lane. The source loads of the first chunks are issued before the slot is
// resolved: at decode sizes the write is latency-bound, and this overlaps the
// slot-mapping (and SWA table) round trip with the data round trip. The grid covers
// num_tokens rows (the slot mapping's length) with a grid-stride loop, so any T and
// graph padding work.
// The team (RowTeam) is chosen at launch from T:
// - warp: one warp (wavefront) per row, several rows per block. For large T: every
//   lane streams kUnroll chunk pairs at a time, 86% of HBM peak on the H200 at T = 65536.
// - block: one block per row, as many lanes as the row has chunks (up to
//   kKvWriteMaxBlockThreads). For small T (decode), where the write is one round trip
//   of latency: a lane converts and stores at most one chunk of K and one of V, all its
//   loads issued before the slot and the scales arrive, and T rows run on T
//   multiprocessors instead of T / rows-per-block. Rows of up to 2048 elements take
//   kv_write_token_kernel instead, the same mapping at 8 elements a lane without the
//   loops (with 8 heads x 128: 4 warps per row); wider rows take this team.
// gpu.h first: on HIP the vendor runtime header defines __forceinline__, which
// kernels/common/host_device.h (reached through the other headers) uses in KVFUSE_HD.
#include "kernels/common/gpu.h"

#include <algorithm>

#include "kernels/common/dispatch.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/kv_write/kv_write.cuh"
#include "kernels/kv_write/kv_write_rows.cuh"

namespace kvfuse::gpu {
namespace {

// Resident blocks of kKvWriteMaxBlockThreads per multiprocessor the row kernels are
// built for. NVIDIA: 4 x 256 threads, at most 64 registers a thread (what the old bound
// of 1024 threads gave; the scalar FNUZ conversion needs 72 without a cap). CDNA: 4 x 4
// waves is 4 waves per SIMD, 128 registers a lane.
constexpr int kKvWriteMinBlocks = 4;
// Threads per block of the unfused path's elementwise kernels.
constexpr int kElementwiseBlock = 256;

// --- Fused write -------------------------------------------------------------------

// Who writes one row (see the thread mapping above).
enum class RowTeam { warp, block };

// Launch bounds: every block size the launch options allow (up to
// kKvWriteMaxBlockThreads) must fit, and kKvWriteMinBlocks of the largest must be
// resident on a multiprocessor.
template <class Op, bool kVec, RowTeam kTeam, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kKvWriteMaxBlockThreads, kKvWriteMinBlocks)
    kv_write_fused_kernel(KvWriteArgs a) {
  constexpr bool kBlockTeam = kTeam == RowTeam::block;
  const PagedKvView& cache = a.cache;
  const int64_t row_elems = cache.row_elems();
  const int64_t row_bytes = row_elems * Op::kOutBytesPerElem;
  const int chunks = int(row_elems / Op::kChunkElems);
  const int64_t num_slots = cache.num_slots();
  // A warp team's size is a constant, so that path compiles as if there were no other.
  const int lanes = kBlockTeam ? int(blockDim.x) : kWarpSize;
  const int rows_per_block = kBlockTeam ? 1 : int(blockDim.x) / kWarpSize;
  const int lane = kBlockTeam ? int(threadIdx.x) : lane_id();
  const int team = kBlockTeam ? 0 : warp_id();
  pdl_handshake<kPdl>();  // PDL: inputs come from the previous kernel
  const uint16_t* k_src = static_cast<const uint16_t*>(a.k);
  const uint16_t* v_src = static_cast<const uint16_t*>(a.v);

  for (int64_t t = int64_t(blockIdx.x) * rows_per_block + team; t < a.num_tokens;
       t += int64_t(gridDim.x) * rows_per_block) {
    const int64_t raw_slot = a.slot_mapping[t];
    const uint16_t* ks = k_src + t * a.k_token_stride;
    const uint16_t* vs = v_src + t * a.v_token_stride;
    RowGroup<Op, kVec> g;
    g.load(ks, vs, lane, chunks, lanes);  // independent of the slot: overlaps its round trip
    // Scales are read through device pointers (no host sync in a step); bf16 caches may
    // come without them. Read per row, after the row's loads are issued: taken once
    // before the loop, rcp.rn (whose slow path is a branch) held those loads back until
    // the scale arrived, two memory round trips instead of one (measured on the H200:
    // +0.2 us per call at T = 1, against the bf16 store). A warp writes one row in all
    // but giant grids, so this costs nothing extra; inside the loop the compiler cannot
    // hoist the load, since the loop stores to memory that might alias it.
    // Both loads before either reciprocal, for the same reason (load_inv_scales).
    float inv_k = 1.0f, inv_v = 1.0f;
    if constexpr (Op::kScaled) load_inv_scales(cache, inv_k, inv_v);
    const int64_t slot = resolve_write_slot(raw_slot, a.swa, num_slots);
    if (slot < 0) continue;  // padding or SWA-unmapped: nothing is written
    uint8_t* kd = static_cast<uint8_t*>(cache.k) + slot * row_bytes;
    uint8_t* vd = static_cast<uint8_t*>(cache.v) + slot * row_bytes;
    for (int c0 = lane;;) {
      g.store(kd, vd, c0, chunks, lanes, inv_k, inv_v);
      c0 += kUnroll * lanes;
      if (c0 >= chunks) break;
      g.load(ks, vs, c0, chunks, lanes);
    }
  }
}

// The decode write (T <= launch.block_team_max_tokens, rows of at most
// kKvWriteMaxBlockThreads x 8 elements): a block per token row, a lane per 8 elements of
// K and of V (one 16-byte load each), no loops. Its every load (the row's, the slot's,
// the scales') is issued before any is used, and its one store per lane and tensor
// follows. It exists beside the block team of kv_write_fused_kernel for its length: at
// one token, that kernel (its grid-stride and chunk loops, two 16-byte loads a lane)
// took 1.40 us a call on an H200 where this shape took 1.06-1.12 us
// (bench/bench_kv_write_probe.cu). The same bytes: Op::convert8 and Op::convert agree.
template <class Op, bool kVec, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kKvWriteMaxBlockThreads, kKvWriteMinBlocks)
    kv_write_token_kernel(KvWriteArgs a) {
  pdl_handshake<kPdl>();  // PDL: inputs come from the previous kernel
  const PagedKvView& cache = a.cache;
  const int64_t t = blockIdx.x;
  const int64_t e = int64_t(threadIdx.x) * 8;  // this lane's first element of the row
  const bool live = e < cache.row_elems();
  uint4 k[1] = {make_uint4(0u, 0u, 0u, 0u)}, v[1] = {make_uint4(0u, 0u, 0u, 0u)};
  if (live) {
    k[0] = load_raw8<kVec>(static_cast<const uint16_t*>(a.k) + t * a.k_token_stride + e);
    v[0] = load_raw8<kVec>(static_cast<const uint16_t*>(a.v) + t * a.v_token_stride + e);
  }
  const int64_t raw_slot = a.slot_mapping[t];
  float inv_k = 1.0f, inv_v = 1.0f;
  if constexpr (Op::kScaled) load_inv_scales(cache, inv_k, inv_v);
  const int64_t slot = resolve_write_slot(raw_slot, a.swa, cache.num_slots());
  if (slot < 0 || !live) return;
  const int64_t at = (slot * cache.row_elems() + e) * Op::kOutBytesPerElem;
  uint8_t* kd = static_cast<uint8_t*>(cache.k) + at;
  uint8_t* vd = static_cast<uint8_t*>(cache.v) + at;
  if constexpr (Op::kScaled) {
    *reinterpret_cast<uint2*>(kd) = Op::convert8(k[0], inv_k);
    *reinterpret_cast<uint2*>(vd) = Op::convert8(v[0], inv_v);
  } else {
    static_assert(Op::kChunkElems == 8, "a bf16 cache chunk is 8 elements");
    store_16B(kd, Op::convert(k, 1.0f));
    store_16B(vd, Op::convert(v, 1.0f));
  }
}

// --- Unfused path: five kernels ------------------------------------------------------

// Launches 1 and 2: src rows (strided) -> fp32 scratch [T, row_elems], x * inv for FP8
// caches, x exactly for bf16 caches. 8 elements per item: one 16-byte load, two stores.
template <KvSrcDtype S, bool kScaled, bool kVec, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kElementwiseBlock, 1)
    kv_scale_kernel(const uint16_t* src, int64_t token_stride, int64_t num_tokens, int64_t row_elems,
                    const float* scale, float* out) {
  pdl_handshake<kPdl>();
  const int64_t per_row = row_elems / 8;
  const int64_t items = num_tokens * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row;
    const int64_t e = (i - t * per_row) * 8;
    const uint4 raw = load_raw8<kVec>(src + t * token_stride + e);
    // As in the fused kernel: the scale is read after the data load is issued.
    const float inv = kScaled ? recip_rn(*scale) : 1.0f;
    float x[8];
    if constexpr (kScaled) {
      widen8<S>(raw, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] *= inv;
    } else {
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[2 * j] = widen_exact<S>(uint16_t(w[j]));
        x[2 * j + 1] = widen_exact<S>(uint16_t(w[j] >> 16));
      }
    }
    float4* o = reinterpret_cast<float4*>(out + t * row_elems + e);
    o[0] = make_float4(x[0], x[1], x[2], x[3]);
    o[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

// Launches 3 and 4, FP8: 16 fp32 -> 16 bytes per item.
template <Fp8Format F, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kElementwiseBlock, 1)
    kv_cast_fp8_kernel(const float* in, int64_t count, uint8_t* out) {
  pdl_handshake<kPdl>();
  grid_stride_loop(count / 16, [&](int64_t i) {
    float x[16];
    load_f32x4s(in + i * 16, x);
    store_16B(out + i * 16, cvt_fp8x16<F>(x));
  });
}

// Launches 3 and 4, bf16 cache: 8 fp32 -> 8 bf16 per item. The scratch of a bf16 source
// holds exact widenings, so the high half is the source's bits (NaN payloads included);
// an f16 source rounds to nearest even, as in the fused path.
template <KvSrcDtype S, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kElementwiseBlock, 1)
    kv_cast_bf16_kernel(const float* in, int64_t count, uint8_t* out) {
  pdl_handshake<kPdl>();
  grid_stride_loop(count / 8, [&](int64_t i) {
    float x[8];
    load_f32x4s(in + i * 8, x);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t lo = S == KvSrcDtype::bf16 ? __float_as_uint(x[2 * j]) >> 16 : f32_to_bf16(x[2 * j]);
      const uint32_t hi =
          S == KvSrcDtype::bf16 ? __float_as_uint(x[2 * j + 1]) >> 16 : f32_to_bf16(x[2 * j + 1]);
      w[j] = lo | (hi << 16);
    }
    store_16B(out + i * 16, make_uint4(w[0], w[1], w[2], w[3]));
  });
}

// Launch 5: scatter the cast rows of K and V into their slots, one warp per row, with
// the fused kernel's row pipeline (RowGroup over 16-byte bit copies): rows are loaded
// before the slot is resolved, so the unfused path gets the same latency care.
template <bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kKvWriteMaxBlockThreads, kKvWriteMinBlocks)
    kv_scatter_kernel(const uint8_t* k_rows, const uint8_t* v_rows, int64_t row_bytes, KvWriteArgs a) {
  using Copy = Bf16RowOp<KvSrcDtype::bf16>;  // 8 x 16 bits in, the same 16 bytes out
  const int64_t num_slots = a.cache.num_slots();
  const int rows_per_block = int(blockDim.x) / kWarpSize;
  const int chunks = int(row_bytes / 16);
  const int lane = lane_id();
  pdl_handshake<kPdl>();
  for (int64_t t = int64_t(blockIdx.x) * rows_per_block + warp_id(); t < a.num_tokens;
       t += int64_t(gridDim.x) * rows_per_block) {
    const int64_t raw_slot = a.slot_mapping[t];
    const uint16_t* ks = reinterpret_cast<const uint16_t*>(k_rows + t * row_bytes);
    const uint16_t* vs = reinterpret_cast<const uint16_t*>(v_rows + t * row_bytes);
    RowGroup<Copy, true> g;
    g.load(ks, vs, lane, chunks, kWarpSize);
    const int64_t slot = resolve_write_slot(raw_slot, a.swa, num_slots);
    if (slot < 0) continue;
    uint8_t* kd = static_cast<uint8_t*>(a.cache.k) + slot * row_bytes;
    uint8_t* vd = static_cast<uint8_t*>(a.cache.v) + slot * row_bytes;
    for (int c0 = lane;;) {
      g.store(kd, vd, c0, chunks, kWarpSize, 1.0f, 1.0f);
      c0 += kUnroll * kWarpSize;
      if (c0 >= chunks) break;
      g.load(ks, vs, c0, chunks, kWarpSize);
    }
  }
}

template <Fp8Format F>
__global__ void fp8_cvt_path_probe_kernel(int* out) {
  *out = fp8_cvt_path_id<F>();
}

// --- Host side -------------------------------------------------------------------------

// The source rows can be read with 16-byte loads.
bool src_vectorizable(const KvWriteArgs& a) {
  return is_aligned(a.k, 16) && is_aligned(a.v, 16) && a.k_token_stride % 8 == 0 && a.v_token_stride % 8 == 0;
}

template <class Op, RowTeam kTeam>
cudaError_t launch_fused_team(const KvWriteArgs& a, unsigned grid, unsigned block, cudaStream_t stream,
                              bool pdl) {
  return with_pdl(pdl, [&](auto p) {
    constexpr bool kPdl = decltype(p)::value;
    return src_vectorizable(a)
               ? launch_kernel(kv_write_fused_kernel<Op, true, kTeam, kPdl>, grid, block, stream, kPdl, a)
               : launch_kernel(kv_write_fused_kernel<Op, false, kTeam, kPdl>, grid, block, stream, kPdl, a);
  });
}

// The thread mapping is select::kv_write_team's (kernels/common/kernel_select.h):
// kv_write_token_kernel, block teams (a lane per chunk of the row, whole warps, at most
// kKvWriteMaxBlockThreads, wider rows loop) or warp teams.
template <class Op>
cudaError_t launch_fused_op(const KvWriteArgs& a, cudaStream_t stream, const KvWriteLaunch& l) {
  switch (select::kv_write_team(a.num_tokens, a.cache.row_elems(), l.block_team_max_tokens)) {
    case select::KvWriteTeam::token: {
      const int64_t lanes8 = a.cache.row_elems() / 8;  // kv_write_token_kernel's lanes
      const unsigned block = unsigned((lanes8 + kWarpSize - 1) / kWarpSize * kWarpSize);
      return with_pdl(l.pdl, [&](auto p) {
        constexpr bool kPdl = decltype(p)::value;
        const unsigned grid = unsigned(a.num_tokens);
        return src_vectorizable(a)
                   ? launch_kernel(kv_write_token_kernel<Op, true, kPdl>, grid, block, stream, kPdl, a)
                   : launch_kernel(kv_write_token_kernel<Op, false, kPdl>, grid, block, stream, kPdl, a);
      });
    }
    case select::KvWriteTeam::block: {
      const int64_t chunks = a.cache.row_elems() / Op::kChunkElems;
      const int64_t warps = (chunks + kWarpSize - 1) / kWarpSize;
      const int64_t block = std::min<int64_t>(warps * kWarpSize, kKvWriteMaxBlockThreads);
      return launch_fused_team<Op, RowTeam::block>(a, grid_blocks(a.num_tokens, 1), unsigned(block), stream,
                                                   l.pdl);
    }
    case select::KvWriteTeam::warp:
      break;
  }
  return launch_fused_team<Op, RowTeam::warp>(a, grid_blocks(a.num_tokens, l.block_threads / kWarpSize),
                                              l.block_threads, stream, l.pdl);
}

template <KvSrcDtype S>
cudaError_t launch_fused_src(const KvWriteArgs& a, cudaStream_t stream, const KvWriteLaunch& l) {
  return dispatch_kv_format(a.cache.format, [&](auto fmt) {
    constexpr KvFormat F = decltype(fmt)::value;
    if constexpr (F == KvFormat::bf16) {
      return launch_fused_op<Bf16RowOp<S>>(a, stream, l);
    } else {
      return launch_fused_op<Fp8RowOp<S, kv_fp8_format(F)>>(a, stream, l);
    }
  });
}

template <KvSrcDtype S, bool kScaled>
cudaError_t launch_scale(const void* src, int64_t stride, const KvWriteArgs& a, const float* scale,
                         float* out, cudaStream_t stream, bool pdl) {
  const int64_t row_elems = a.cache.row_elems();
  const unsigned grid = grid_blocks(a.num_tokens * (row_elems / 8), kElementwiseBlock);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  const int64_t T = a.num_tokens;
  return with_pdl(pdl, [&](auto p) {
    constexpr bool kPdl = decltype(p)::value;
    return is_aligned(src, 16) && stride % 8 == 0
               ? launch_kernel(kv_scale_kernel<S, kScaled, true, kPdl>, grid, kElementwiseBlock, stream, kPdl,
                               s, stride, T, row_elems, scale, out)
               : launch_kernel(kv_scale_kernel<S, kScaled, false, kPdl>, grid, kElementwiseBlock, stream,
                               kPdl, s, stride, T, row_elems, scale, out);
  });
}

template <KvSrcDtype S>
cudaError_t launch_cast(const float* in, int64_t count, KvFormat dtype, uint8_t* out, cudaStream_t stream,
                        bool pdl) {
  return dispatch_kv_format(dtype, [&](auto fmt) {
    constexpr KvFormat F = decltype(fmt)::value;
    return with_pdl(pdl, [&](auto p) {
      constexpr bool kPdl = decltype(p)::value;
      if constexpr (F == KvFormat::bf16) {
        return launch_kernel(kv_cast_bf16_kernel<S, kPdl>, grid_blocks(count / 8, kElementwiseBlock),
                             kElementwiseBlock, stream, kPdl, in, count, out);
      } else {
        return launch_kernel(kv_cast_fp8_kernel<kv_fp8_format(F), kPdl>,
                             grid_blocks(count / 16, kElementwiseBlock), kElementwiseBlock, stream, kPdl, in,
                             count, out);
      }
    });
  });
}

template <KvSrcDtype S>
cudaError_t launch_unfused_src(const KvWriteArgs& a, const KvWriteScratch& s, cudaStream_t stream,
                               bool pdl) {
  const bool fp8 = a.cache.format != KvFormat::bf16;
  const int64_t row_elems = a.cache.row_elems();
  const int64_t count = a.num_tokens * row_elems;
  // Launches 1 and 2: every token is converted, padding included, as elementwise
  // kernels do; only the scatter looks at slots.
  if (fp8) {
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_scale<S, true>(a.k, a.k_token_stride, a, a.cache.k_scale, s.k_scaled, stream, pdl));
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_scale<S, true>(a.v, a.v_token_stride, a, a.cache.v_scale, s.v_scaled, stream, pdl));
  } else {
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_scale<S, false>(a.k, a.k_token_stride, a, nullptr, s.k_scaled, stream, pdl));
    KVFUSE_GPU_RETURN_IF_ERROR(
        launch_scale<S, false>(a.v, a.v_token_stride, a, nullptr, s.v_scaled, stream, pdl));
  }
  // Launches 3 and 4.
  KVFUSE_GPU_RETURN_IF_ERROR(launch_cast<S>(s.k_scaled, count, a.cache.format, s.k_cast, stream, pdl));
  KVFUSE_GPU_RETURN_IF_ERROR(launch_cast<S>(s.v_scaled, count, a.cache.format, s.v_cast, stream, pdl));
  // Launch 5.
  const int64_t row_bytes = row_elems * kv_format_bytes(a.cache.format);
  const uint8_t* k_rows = s.k_cast;
  const uint8_t* v_rows = s.v_cast;
  return with_pdl(pdl, [&](auto p) {
    constexpr bool kPdl = decltype(p)::value;
    return launch_kernel(kv_scatter_kernel<kPdl>, grid_blocks(a.num_tokens, kKvWriteBlockThreads / kWarpSize),
                         kKvWriteBlockThreads, stream, kPdl, k_rows, v_rows, row_bytes, a);
  });
}

const char* src_name(KvSrcDtype s) { return s == KvSrcDtype::bf16 ? "bf16" : "f16"; }

}  // namespace

std::string kv_write_unsupported(const KvWriteArgs& a) {
  const PagedKvView& c = a.cache;
  std::string why;
  if (!head_dim_supported(c.head_dim)) {
    why = "head_dim must be one of " + supported_head_dims();
  } else if (!kv_format_supported(c.format)) {
    why = "unknown cache dtype";
  } else if (c.num_kv_heads <= 0 || c.page_size <= 0 || c.num_pages < 0) {
    why = "num_kv_heads and page_size must be positive, num_pages non-negative";
  } else if (a.num_tokens < 0) {
    why = "num_tokens is negative";
  } else if (a.num_tokens > 0 && (a.k == nullptr || a.v == nullptr || a.slot_mapping == nullptr)) {
    why = "k, v and slot_mapping must be set";
  } else if (a.k_token_stride < c.row_elems() || a.v_token_stride < c.row_elems()) {
    why = "token strides must be at least num_kv_heads * head_dim elements";
  } else if (c.num_slots() > 0 &&
             (c.k == nullptr || c.v == nullptr || !is_aligned(c.k, 16) || !is_aligned(c.v, 16))) {
    why = "cache K/V must be set and 16-byte aligned";
  } else if (c.format != KvFormat::bf16 && (c.k_scale == nullptr || c.v_scale == nullptr)) {
    why = "FP8 caches need k_scale and v_scale (device pointers)";
  } else if (a.swa.full_to_swa != nullptr && a.swa.size < 0) {
    why = "SWA table size is negative";
  }
  if (why.empty()) return why;
  return "GPU KV write unsupported for (head_dim=" + std::to_string(c.head_dim) +
         ", num_kv_heads=" + std::to_string(c.num_kv_heads) + ", page_size=" + std::to_string(c.page_size) +
         ", cache dtype=" + kv_format_name(c.format) + ", source dtype=" + src_name(a.src_dtype) +
         "): " + why;
}

LaunchStatus launch_kv_write_fused(const KvWriteArgs& args, cudaStream_t stream,
                                   const KvWriteLaunch& launch) {
  const int bt = launch.block_threads;
  if (bt <= 0 || bt > kKvWriteMaxBlockThreads || bt % kWarpSize != 0) {
    return LaunchStatus::refused("GPU KV write: block_threads " + std::to_string(bt) +
                                 " must be a multiple of " + std::to_string(kWarpSize) + " in (0, " +
                                 std::to_string(kKvWriteMaxBlockThreads) + "]");
  }
  if (std::string why = kv_write_unsupported(args); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (args.num_tokens == 0) return cudaSuccess;  // an empty step: no launch
  return args.src_dtype == KvSrcDtype::bf16 ? launch_fused_src<KvSrcDtype::bf16>(args, stream, launch)
                                            : launch_fused_src<KvSrcDtype::f16>(args, stream, launch);
}

LaunchStatus launch_kv_store_bf16(const KvWriteArgs& args, cudaStream_t stream, const KvWriteLaunch& launch) {
  if (args.cache.format != KvFormat::bf16) {
    return LaunchStatus::refused(std::string("GPU bf16 KV store: the cache dtype is ") +
                                 kv_format_name(args.cache.format) + ", not bf16");
  }
  return launch_kv_write_fused(args, stream, launch);
}


LaunchStatus launch_kv_write_unfused(const KvWriteArgs& args, void* scratch, cudaStream_t stream,
                                     const KvWriteLaunch& launch) {
  if (std::string why = kv_write_unsupported(args); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (args.num_tokens == 0) return cudaSuccess;
  if (scratch == nullptr) {
    return LaunchStatus::refused("GPU unfused KV write: no scratch for " + std::to_string(args.num_tokens) +
                                 " tokens (kv_write_scratch_bytes)");
  }
  const KvWriteScratch s = kv_write_scratch_from(scratch, args.num_tokens, args.cache.row_elems());
  return args.src_dtype == KvSrcDtype::bf16
             ? launch_unfused_src<KvSrcDtype::bf16>(args, s, stream, launch.pdl)
             : launch_unfused_src<KvSrcDtype::f16>(args, s, stream, launch.pdl);
}

std::string kv_write_conversion_name(KvFormat dtype) {
  if (dtype == KvFormat::bf16) return "bf16 copy";
  int* d = nullptr;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return "unknown (cudaMalloc failed)";
  const cudaError_t launched = dispatch_kv_format(dtype, [&](auto fmt) {
    return launch_kernel(fp8_cvt_path_probe_kernel<kv_fp8_format(decltype(fmt)::value)>, 1, 1, nullptr, false,
                         d);
  });
  int id = -1;
  const cudaError_t err =
      launched != cudaSuccess ? launched : cudaMemcpy(&id, d, sizeof(int), cudaMemcpyDeviceToHost);
  (void)cudaFree(d);  // best effort: the answer is already read
  if (err != cudaSuccess) return "unknown (" + error_message(err, "the conversion probe") + ")";
  return fp8_cvt_path_name(id);
}

}  // namespace kvfuse::gpu
