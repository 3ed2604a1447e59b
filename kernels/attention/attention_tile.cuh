// The pieces every attention kernel shares: the block's tile geometry, the kernel
// parameters, the split-KV partition arithmetic, and the host's one entry to the block
// kernel (launch_attention_blocks, kernels/attention/attention_unified.cu). The paths:
// attention_unified.cu (the block kernel; the unified launcher; prefill rows of the split
// path run through it too), attention_split.cu (split-KV decode: partition choice and
// launcher), attention_merge.cuh (the log-sum-exp merge of the partitions).
//
// Tiling. Every block has four 32-lane groups (a warp on NVIDIA, half a wavefront on
// CDNA). A group works on tiles of 16 keys with warp-level MMAs m16n8k16 (fp32
// accumulators), transposed so that the 8 query rows of the block (tokens x the G heads
// of one KV head) are the N dimension:
//   S^T [16 keys x 8 rows]  = K [16 keys x D]    . Q^T [D x 8 rows]
//   O^T [D x 8 rows]       += V^T [D x 16 keys] . P^T [16 keys x 8 rows]
// Lane (g = lane / 4, c = lane % 4) loads, per tile, D/4 elements of keys g and g+8 (the
// K fragment: four lanes read a 64-byte run of a row per 16-byte load) and D/8 elements
// of keys 2c, 2c+1, 2c+8, 2c+9 (the V fragment: eight lanes read a whole row). A dot
// product does not care in which order its dimensions are summed, so the fragments take
// dimensions in load order and Q (and the output) use the same permutation; only Q's
// fragment and the final merge of the groups go through shared memory. One register
// buffer per operand: the next tile's K is loaded once QK has consumed this tile's K, its
// V once PV has consumed this V, so a tile is always in flight per group.
//
// Numerics. FP8 keys/values become f16 exactly (e4m3fn via cvt.rn.f16x2.e4m3x2 on sm_89+
// or bit manipulation, e4m3fnuz by bit manipulation, e5m2 is the top byte of an f16), up
// to a power of two that is folded, with the layer's scale, into the scores and the
// output: float(stored) * scale is applied as a factor after the fp32 sums instead of to
// every element. Q is bf16; against f16 keys it is scaled per row by a power of two into
// the f16 range (exact: bf16 has 8 significant bits, f16 11). Probabilities enter the PV
// MMA as a hi + lo pair of f16 (bf16 for bf16 caches), 22 (16) significant bits. Scores
// are in the exp2 domain (softmax scale * log2 e folded into the score factor). Result:
// the CPU reference's fp32 math in another summation order, within one bf16 ulp of it.
// Pages outside a block's key range are never read (they may be -1). With page sizes a
// multiple of 16 a tile is 16 slots of one page, so its first/last tile may load slots
// just outside the range (in bounds; maybe NaN): their scores are masked and their V
// zeroed. Keys inside the range but outside one row's window get probability 0.
//
// Vendor differences (the MMA, the FP8 and f16 conversions) live in
// kernels/attention/attention_mma.cuh. On CDNA (HIP) the blocks are not this kernel's but the MFMA
// kernel's (kernels/attention/mfma/attention_mfma.h): same Params, same modes, same numerics, tiles
// shaped for 64-lane matrix instructions; launch_attention_blocks picks it.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/attention/attention.cuh"
#include "kernels/attention/mfma/attention_mfma.h"
#include "kernels/attention/attention_mma.cuh"
#include "kernels/attention/attention_params.h"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu::attention_detail {

constexpr int kRows = 8;                       // N: query rows (token x head) per block
constexpr int kGroups = 4;                     // 32-lane groups per block
constexpr int kThreads = kGroups * kMmaLanes;  // 128
constexpr int kEpiThreadsPerRow = kThreads / kRows;
// Resident blocks per multiprocessor the kernel is built for (KVFUSE_LAUNCH_BOUNDS):
// at most 128 registers a thread for 4; D = 256 needs more. (The CDNA kernel has its
// own, mfma_attn::kBlocksPerCu.)
template <int D>
constexpr int kBlocksPerSm = D == 256 ? 2 : 4;

// ---- tile geometry -----------------------------------------------------------------------

template <int D, KvKind K>
struct Geo {
  static constexpr bool kBf16 = K == KvKind::bf16;
  static constexpr int kElemBytes = kBf16 ? 2 : 1;
  static constexpr int kPiece = 16 / kElemBytes;       // elements per 16-byte load
  static constexpr int kKWords = D * kElemBytes / 16;  // per lane and K key: D/4 elements
  static constexpr int kVWords = D * kElemBytes / 32;  // per lane and V key: D/8 elements
  static constexpr int kChunks = D / 16;               // k16 steps of QK = m16 tiles of PV
  static constexpr int kQElems = D / 4;                // Q elements per lane (its row)
  // Next tile's K loads issued right after QK (small tiles) or with the V loads after PV
  // (tiles above 128 bytes a lane, which keep enough bytes in flight on their own and
  // would not fit the registers twice).
  static constexpr bool kEarlyK = 2 * kKWords + 4 * kVWords <= 32;
  static_assert(kKWords % 4 == 0 && kVWords >= 2, "head_dim");
};

// Raw cache words of one tile in one lane: K keys g, g+8; V keys 2c, 2c+1, 2c+8, 2c+9.
template <int D, KvKind K>
struct Raw {
  uint32_t k[2][Geo<D, K>::kKWords];
  uint32_t v[4][Geo<D, K>::kVWords];
};

// Block-table state of a tile, fetched ahead of its loads: the page (or -1) and the
// position in the page, of the tile's first key (page-aligned tiles, all lanes) or of key
// `lane % 16` (any page size).
struct Ent {
  int32_t page;
  int32_t inpage;
};

// Four cache words of a tile from one 16-byte load: w[at .. at + 4).
template <int N>
KVFUSE_DEVICE void put_words(uint32_t (&w)[N], int at, uint4 x) {
  w[at] = x.x;
  w[at + 1] = x.y;
  w[at + 2] = x.z;
  w[at + 3] = x.w;
}

// ---- host side ------------------------------------------------------------------------

// Launches `blocks` blocks of the block kernel with p (p.mode says which rows they take)
// for the cache's head_dim and format: kernels/attention/attention_unified.cu, the one place the
// attention kernel is instantiated.
cudaError_t launch_attention_blocks(const Params& p, int64_t blocks, const AttnLaunch& l,
                                    cudaStream_t stream);

// RoPE and the KV write taken into p's blocks (rope not null; the launcher has checked
// attention_rope_unsupported).
inline void take_rope(const KvWriteRopeArgs* rope, Params& p) {
  if (rope == nullptr) return;
  p.rope = *rope;
  p.rope_write = 1;
}

// On CDNA the blocks are the MFMA kernel's (kernels/attention/mfma/attention_mfma.h, launched from
// kernels/attention/mfma/attention_mfma.cu); elsewhere this returns cudaErrorInvalidValue.
cudaError_t launch_attention_mfma(const Params& p, int64_t blocks, cudaStream_t stream);

// Resident blocks of the MFMA kernel instance on a CU of the current device, from the
// runtime's occupancy calculator (per arch and per instance, asked once); off HIP,
// mfma_attn::kBlocksPerCu.
int32_t attention_mfma_blocks_per_cu(int32_t head_dim, KvFormat format, bool page_tiles);

// Blocks of the kernel that launch_attention_blocks runs resident on one multiprocessor:
// the split path's partition choice sizes its waves with it. NVIDIA: the launch bound the
// mma.sync kernel is built for (fitted on the H200). CDNA: what the device reports for
// the instance, since its register count (2 to 4 waves per SIMD across instances) and
// the CU's LDS differ per arch.
inline int32_t attention_blocks_per_sm(int32_t head_dim, KvFormat format, bool page_tiles) {
  if (kWarpSize == 64) return attention_mfma_blocks_per_cu(head_dim, format, page_tiles);
  return head_dim == 256 ? kBlocksPerSm<256> : kBlocksPerSm<128>;
}

}  // namespace kvfuse::gpu::attention_detail
