// The KV write with RoPE on the way; see kv_write_rope.cuh for the contract and numerics.
//
// Thread mapping: a block per token (grid-stride over the slot mapping's length). The
// token's work is cut into items of two 16-byte loads each:
// - q pairs: 8 elements of a query head's first half and the 8 they rotate with in its
//   second half; rotated and stored back in place;
// - k pairs: the same over a KV head of K; rotated, rounded to bf16, then scaled and
//   converted as the fused write converts (8 FP8 bytes or 16 bf16 bytes per half);
// - v chunks: 16 consecutive elements of the V row, written as the fused write writes
//   them.
// Pairs keep both elements of every rotated pair in one lane, so the rotation needs no
// exchange between lanes; the cache row is NHD, so a K or V element lands at its own
// offset within the slot's row. A lane holds kItemsPerLane items in flight: their loads
// are issued before the position, the slot and the scales arrive, as the fused write
// does at decode sizes, where the kernel is one memory round trip of latency. The block
// is sized so that, up to kKvWriteMaxBlockThreads, a lane has at most kItemsPerLane
// items (llama3-8b: 256 q + 64 k + 64 v items, 192 lanes); wider rows loop.
//
// cos and sin of the token's head_dim/2 angles are computed once per block into shared
// memory (rope_kernel computes them once per pair and head: here a token's 40 heads of
// llama3-8b share them), with rope_kernel's expressions (kernels/ops/rope_rows.cuh).
//
// gpu.h first: on HIP the vendor runtime header defines __forceinline__, which
// kernels/common/host_device.h (reached through the other headers) uses in KVFUSE_HD.
#include "kernels/common/gpu.h"

#include <algorithm>

#include "kernels/common/dispatch.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/rope_rows.cuh"

namespace kvfuse::gpu {
namespace {

using rope_rows::kPairElems;
using rope_rows::kVChunkElems;
using rope_rows::rotate_pair;
using rope_rows::store_k_pair;
using rope_rows::store_v_chunk;

// Items whose loads a lane keeps in flight at once.
constexpr int kItemsPerLane = 2;
// Resident blocks of kKvWriteMaxBlockThreads per multiprocessor, as for the fused write
// (kernels/kv_write/kv_write.cu): at most 64 registers a thread on NVIDIA, 4 waves per SIMD on CDNA.
constexpr int kMinBlocks = 4;

// The token's items: q pairs, then k pairs, then v chunks.
struct ItemCounts {
  int q = 0, k = 0, v = 0;
  KVFUSE_HD int total() const { return q + k + v; }
};

KVFUSE_HD ItemCounts item_counts(int32_t q_heads, int32_t kv_heads, int32_t head_dim) {
  const int pairs_per_head = head_dim / 2 / kPairElems;
  return {q_heads * pairs_per_head, kv_heads * pairs_per_head, kv_heads * head_dim / kVChunkElems};
}

KVFUSE_DEVICE uint4 load_16B(const void* p) { return *static_cast<const uint4*>(p); }

// One token's rows and where they go.
struct TokenRows {
  bf16_t* q;           // the token's q row, rotated in place
  const bf16_t* k;     // its K row (read only, unless k_rot aliases it)
  const bf16_t* v;     // its V row
  bf16_t* k_rot;       // where the rotated K row goes, or null
  uint8_t* k_dst;      // the slot's K row in the cache, or null (padding)
  uint8_t* v_dst;      // its V row
  const float* cos_t;  // [head_dim / 2], shared memory
  const float* sin_t;
  float inv_k, inv_v;  // 1/scale (FP8 caches)
};

// The items it, it + lanes, ... (kItemsPerLane of them) of one token, in registers
// between load and store.
template <int D, KvFormat F>
struct ItemGroup {
  static constexpr int kHalf = D / 2;
  static constexpr int kPairsPerHead = kHalf / kPairElems;
  uint4 raw[kItemsPerLane][2];

  KVFUSE_DEVICE void load(const TokenRows& r, const ItemCounts& n, int it0, int lanes) {
#pragma unroll
    for (int u = 0; u < kItemsPerLane; ++u) {
      const int it = it0 + u * lanes;
      if (it < n.q) {
        const bf16_t* p = r.q + (it / kPairsPerHead) * D + (it % kPairsPerHead) * kPairElems;
        raw[u][0] = load_16B(p);
        raw[u][1] = load_16B(p + kHalf);
      } else if (it < n.q + n.k) {
        const int j = it - n.q;
        const bf16_t* p = r.k + (j / kPairsPerHead) * D + (j % kPairsPerHead) * kPairElems;
        raw[u][0] = load_16B(p);  // not the read-only path: k_rot may be K itself
        raw[u][1] = load_16B(p + kHalf);
      } else if (it < n.total()) {
        const bf16_t* p = r.v + (it - n.q - n.k) * kVChunkElems;
        raw[u][0] = load_ro_16B(p);
        raw[u][1] = load_ro_16B(p + 8);
      }
    }
  }

  KVFUSE_DEVICE void store(const TokenRows& r, const ItemCounts& n, int it0, int lanes) const {
#pragma unroll
    for (int u = 0; u < kItemsPerLane; ++u) {
      const int it = it0 + u * lanes;
      uint16_t lo[8], hi[8];
      if (it < n.q) {
        const int c0 = (it % kPairsPerHead) * kPairElems;
        rotate_pair(raw[u][0], raw[u][1], r.cos_t, r.sin_t, c0, lo, hi);
        bf16_t* p = r.q + (it / kPairsPerHead) * D + c0;
        store_16B(p, pack_bf16x8(lo));
        store_16B(p + kHalf, pack_bf16x8(hi));
      } else if (it < n.q + n.k) {
        if (r.k_dst == nullptr && r.k_rot == nullptr) continue;  // padding: no K to keep
        const int j = it - n.q;
        const int c0 = (j % kPairsPerHead) * kPairElems;
        const int64_t e0 = int64_t(j / kPairsPerHead) * D + c0;  // element in the row
        rotate_pair(raw[u][0], raw[u][1], r.cos_t, r.sin_t, c0, lo, hi);
        const uint4 lo4 = pack_bf16x8(lo), hi4 = pack_bf16x8(hi);
        if (r.k_rot != nullptr) {
          store_16B(r.k_rot + e0, lo4);
          store_16B(r.k_rot + e0 + kHalf, hi4);
        }
        if (r.k_dst != nullptr) store_k_pair<F>(r.k_dst, e0, kHalf, lo4, hi4, r.inv_k);
      } else if (it < n.total()) {
        if (r.v_dst != nullptr) {
          store_v_chunk<F>(r.v_dst, int64_t(it - n.q - n.k) * kVChunkElems, raw[u][0], raw[u][1], r.inv_v);
        }
      }
    }
  }
};

template <int D, KvFormat F, bool kPdl>
__global__ void KVFUSE_LAUNCH_BOUNDS(kKvWriteMaxBlockThreads, kMinBlocks)
    kv_write_rope_kernel(KvWriteRopeArgs a) {
  constexpr int kHalf = D / 2;
  constexpr bool kFp8 = F != KvFormat::bf16;
  __shared__ float cos_s[kHalf], sin_s[kHalf];
  const KvWriteArgs& kv = a.kv;
  const PagedKvView& cache = kv.cache;
  const ItemCounts n = item_counts(a.q_heads, cache.num_kv_heads, D);
  const int64_t row_elems = cache.row_elems();
  const int64_t row_bytes = row_elems * (kFp8 ? 1 : 2);
  const int64_t num_slots = cache.num_slots();
  const int lanes = int(blockDim.x);
  pdl_handshake<kPdl>();  // PDL: q, k, v come from the kernel before

  for (int64_t t = blockIdx.x; t < kv.num_tokens; t += gridDim.x) {
    const int64_t raw_slot = kv.slot_mapping[t];
    const int32_t pos = a.positions[t];
    TokenRows r;
    r.q = a.q + t * a.q_token_stride;
    r.k = static_cast<const bf16_t*>(kv.k) + t * kv.k_token_stride;
    r.v = static_cast<const bf16_t*>(kv.v) + t * kv.v_token_stride;
    r.k_rot = a.k_rotated != nullptr ? a.k_rotated + t * kv.k_token_stride : nullptr;
    r.cos_t = cos_s;
    r.sin_t = sin_s;
    ItemGroup<D, F> g;
    g.load(r, n, int(threadIdx.x), lanes);  // independent of slot and position: overlaps their round trip
    r.inv_k = r.inv_v = 1.0f;
    if constexpr (kFp8) load_inv_scales(cache, r.inv_k, r.inv_v);  // as the fused write, per token
    // rope_kernel's expressions (rope_rows::cos_sin).
    for (int i = int(threadIdx.x); i < kHalf; i += lanes) {
      rope_rows::cos_sin(pos, a.inv_freq[i], a.attention_scaling, cos_s[i], sin_s[i]);
    }
    const int64_t slot = resolve_write_slot(raw_slot, kv.swa, num_slots);
    r.k_dst = slot < 0 ? nullptr : static_cast<uint8_t*>(cache.k) + slot * row_bytes;
    r.v_dst = slot < 0 ? nullptr : static_cast<uint8_t*>(cache.v) + slot * row_bytes;
    __syncthreads();  // cos_s, sin_s
    for (int it0 = int(threadIdx.x);;) {
      g.store(r, n, it0, lanes);
      it0 += kItemsPerLane * lanes;
      if (it0 >= n.total()) break;
      g.load(r, n, it0, lanes);
    }
    if (t + gridDim.x < kv.num_tokens) __syncthreads();  // the next token rewrites cos_s, sin_s
  }
}

const char* src_name(KvSrcDtype s) { return s == KvSrcDtype::bf16 ? "bf16" : "f16"; }

}  // namespace

int kv_write_rope_block_threads(const KvWriteRopeArgs& args) {
  const ItemCounts n = item_counts(args.q_heads, args.kv.cache.num_kv_heads, args.kv.cache.head_dim);
  const int64_t lanes = (int64_t(n.total()) + kItemsPerLane - 1) / kItemsPerLane;
  const int64_t warps = std::max<int64_t>((lanes + kWarpSize - 1) / kWarpSize, 1);
  return int(std::min<int64_t>(warps * kWarpSize, kKvWriteMaxBlockThreads));
}

std::string kv_write_rope_unsupported(const KvWriteRopeArgs& a) {
  const KvWriteArgs& kv = a.kv;
  const PagedKvView& c = kv.cache;
  std::string why;
  const auto aligned = [](const void* p, int64_t stride) { return is_aligned(p, 16) && stride % 8 == 0; };
  if (kv.src_dtype != KvSrcDtype::bf16) {
    why = "K and V must be bf16 (RoPE rotates bf16 rows)";
  } else if (a.q_heads <= 0) {
    why = "q_heads must be positive";
  } else if (kv.num_tokens > 0 && (a.q == nullptr || a.positions == nullptr || a.inv_freq == nullptr)) {
    why = "q, positions and inv_freq must be set";
  } else if (a.q_token_stride < int64_t(a.q_heads) * c.head_dim) {
    why = "the q token stride must be at least q_heads * head_dim elements";
  } else if (kv.num_tokens > 0 && (!aligned(a.q, a.q_token_stride) || !aligned(kv.k, kv.k_token_stride) ||
                                   !aligned(kv.v, kv.v_token_stride) ||
                                   (a.k_rotated != nullptr && !is_aligned(a.k_rotated, 16)))) {
    why = "q, k, v and k_rotated must be 16-byte aligned with token strides a multiple of 8 elements";
  } else if (std::string w = kv_write_unsupported(kv); !w.empty()) {
    return w;  // names the tuple itself
  }
  if (why.empty()) return why;
  return "GPU KV write with RoPE unsupported for (head_dim=" + std::to_string(c.head_dim) +
         ", q_heads=" + std::to_string(a.q_heads) + ", num_kv_heads=" + std::to_string(c.num_kv_heads) +
         ", page_size=" + std::to_string(c.page_size) + ", cache dtype=" + kv_format_name(c.format) +
         ", source dtype=" + src_name(kv.src_dtype) + "): " + why;
}

LaunchStatus launch_kv_write_rope(const KvWriteRopeArgs& args, cudaStream_t stream,
                                  const KvWriteLaunch& launch) {
  if (std::string why = kv_write_rope_unsupported(args); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  const int64_t T = args.kv.num_tokens;
  if (T == 0) return cudaSuccess;  // an empty step: no launch
  const unsigned block = unsigned(kv_write_rope_block_threads(args));
  return dispatch_head_dim_format(args.kv.cache.head_dim, args.kv.cache.format, [&](auto hd, auto fmt) {
    return with_pdl(launch.pdl, [&](auto p) {
      constexpr bool kPdl = decltype(p)::value;
      return launch_kernel(kv_write_rope_kernel<decltype(hd)::value, decltype(fmt)::value, kPdl>,
                           grid_blocks(T, 1), block, stream, kPdl, args);
    });
  });
}

}  // namespace kvfuse::gpu
