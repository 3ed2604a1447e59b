// The attention block kernel and the unified path; attention.cuh has the contract,
// attention_tile.cuh the tiling and the numerics. One kernel serves every path: a block
// takes its rows by p.mode (kModeUnified: a token grid over every row; kModePrefill: the
// same grid, prefill rows only, for the split path; kModeDecode: the split path's
// (sequence, KV head, partition) grid, attention_split.cu), so it is instantiated here
// only, behind launch_attention_blocks. Its pieces: the block's rows and keys
// (block_rows, attention_params.h, shared with the CDNA kernel), the per-tile steps
// (attention_block.cuh), RoPE and the KV write taken in (attention_rope.cuh).
#include "kernels/common/gpu.h"

#include <cmath>
#include <string>

#include "kernels/attention/attention_block.cuh"
#include "kernels/attention/attention_rope.cuh"
#include "kernels/attention/attention_tile.cuh"
#include "kernels/common/dispatch.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/rope_rows.cuh"

namespace kvfuse::gpu {
namespace {

using namespace attention_detail;

constexpr float kLog2e = 1.4426950408889634f;

template <int D, KvKind K, bool kPageTiles, bool kRope>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, kBlocksPerSm<D>) attention_kernel(Params p) {
  static_assert(!kRope || (kPageTiles && kRopeKind<K>), "the instances with RoPE and the write");
  using Gm = Geo<D, K>;
  constexpr bool kBf16 = Gm::kBf16;
  constexpr int kEb = Gm::kElemBytes;
  const AttnArgs& a = p.a;
  const int32_t H = a.cache.num_kv_heads;
  const int32_t G = a.num_q_heads / H;

  // ---- the rows and keys of this block, and the block-table entries of its first two
  // tiles: all from the step's batch metadata, which the host copies in before the step's
  // first kernel and no kernel writes, so they are read before the programmatic-launch
  // wait and their round trips overlap the kernel before. Q and the step's new K/V rows
  // come from the kernels before: everything from the Q fragment on follows the wait.
  BlockRows br;
  if (!block_rows<kRows>(p, [] { return int64_t(blockIdx.x); }, BlockFindSeq{}, br)) return;
  const int32_t seq = br.seq, kvh = br.kvh, row0 = br.row0, nrows = br.nrows, pos0 = br.pos0;
  const int32_t part = br.part, last_part = br.last_part, begin = br.begin, end = br.end;
  const bool to_scratch = br.to_scratch;

  const int l = glane(), g = l >> 2, c = l & 3, w = group_id();
  const int nvalid = nrows * G;  // rows of the 8-row tile in use: token n / G, head n % G

  const int32_t ps = a.cache.page_size;
  const int32_t* table = a.batch.block_table + int64_t(seq) * a.batch.max_pages_per_seq;
  // Block-table entry of tile t0 (kPageTiles: of its first key; else: of key t0 + lane %
  // 16), issued a tile ahead so that its latency overlaps other work. Nothing outside
  // [begin, end) is read: those pages may be -1. (A page-aligned first tile may start
  // before begin, but in begin's page.)
  const auto fetch = [&](int32_t t0) {
    Ent e{-1, 0};
    const int32_t key = kPageTiles ? t0 : t0 + (l & (kTileKeys - 1));
    if ((kPageTiles || key >= begin) && key < end) {
      int32_t idx;
      if (p.ps_shift >= 0) {
        idx = key >> p.ps_shift;
        e.inpage = key & (ps - 1);
      } else {
        idx = key / ps;
        e.inpage = key - idx * ps;
      }
      e.page = table[idx];
    }
    return e;
  };
  // The group's tiles: 16-aligned, every kGroups-th tile of [begin, end) (the loop below).
  const int32_t stride = kTileKeys * kGroups;
  const int32_t t_first = (begin & ~(kTileKeys - 1)) + kTileKeys * w;
  const Ent e_first = fetch(t_first), e_second = fetch(t_first + stride);

  // ---- kRope: the rotation's cos and sin need only the row's position, and the write
  // only the slot of the row's own key: batch metadata, before the wait too. The block
  // that holds that key writes it: the last partition of a split row (last_part), every
  // block of the unified grid (the host passes decode-only batches: one block a row and
  // KV head).
  __shared__ float rope_cos[kRope ? D / 2 : 1], rope_sin[kRope ? D / 2 : 1];
  __shared__ __align__(16) uint16_t rope_q[kRope ? kRows : 1][kRope ? D : 8];
  [[maybe_unused]] int64_t rope_slot = -1;
  if constexpr (kRope) {
    const int32_t rpos = p.rope.positions[row0];
    for (int i = int(threadIdx.x); i < D / 2; i += kThreads) {
      rope_rows::cos_sin(rpos, p.rope.inv_freq[i], p.rope.attention_scaling, rope_cos[i], rope_sin[i]);
    }
    if (p.mode != kModeDecode || part == last_part) {
      rope_slot = resolve_write_slot(p.rope.kv.slot_mapping[row0], p.rope.kv.swa, a.cache.num_slots());
    }
    __syncthreads();  // rope_cos, rope_sin
  }

  grid_dependency_wait();
  if constexpr (kRope) {
    // Q rotated into rope_q; the row's K and V into the cache, before any tile loads them
    // (the barrier orders this block's stores before its loads).
    rope_write_row<D, K>(p, row0, kvh, G, rope_slot, rope_cos, rope_sin, rope_q);
    __syncthreads();
  }

  // ---- Q fragment (B of S^T = K Q^T): lane (g, c) holds row g, its D/4 dimensions in
  // K-load order: element e is dimension (4 * (e / kPiece) + c) * kPiece + e % kPiece.
  // The fragment is the same in every group: it lives in shared memory ([chunk][lane],
  // conflict-free 8-byte reads), which leaves the registers to the tiles in flight.
  __shared__ uint2 sm_q[Gm::kChunks][kMmaLanes];
  float row_factor;  // score factor of row g: softmax scale, log2 e, k scale, Q scaling
  {
    float qv[Gm::kQElems];
    if (g < nvalid) {
      // kRope: one decode row, its G heads rotated in shared memory.
      const bf16_t* qp = kRope
                             ? reinterpret_cast<const bf16_t*>(rope_q[g % kRows])
                             : a.q + int64_t(row0 + g / G) * a.q_token_stride + int64_t(kvh * G + g % G) * D;
#pragma unroll
      for (int e = 0; e < Gm::kQElems; ++e) {
        qv[e] = bf16_bits_to_f32(qp[(4 * (e / Gm::kPiece) + c) * Gm::kPiece + e % Gm::kPiece]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < Gm::kQElems; ++e) qv[e] = 0.0f;
    }
    float k_factor = 1.0f;
    if constexpr (!kBf16) {
      // Scale the row by 2^s so that its largest magnitude lies in [2^14, 2^15): every
      // bf16 value of the row down to 2^-28 of the largest is then exact in f16.
      float qmax = 0.0f;
#pragma unroll
      for (int e = 0; e < Gm::kQElems; ++e) qmax = fmaxf(qmax, fabsf(qv[e]));
      qmax = fmaxf(qmax, warp_shfl_xor(qmax, 1));
      qmax = fmaxf(qmax, warp_shfl_xor(qmax, 2));
      const int32_t ex = int32_t((__float_as_uint(qmax) >> 23) & 0xffu);
      const int32_t s = qmax > 0.0f ? max(-126, min(126, 141 - ex)) : 0;
      const float up = __uint_as_float(uint32_t(127 + s) << 23);
#pragma unroll
      for (int e = 0; e < Gm::kQElems; ++e) qv[e] *= up;
      k_factor = __uint_as_float(uint32_t(127 - s) << 23) * fp8_raw_factor<K>() * *a.cache.k_scale;
    }
    row_factor = a.softmax_scale * kLog2e * k_factor;
    if (w == 0) {
#pragma unroll
      for (int j = 0; j < Gm::kChunks; ++j) {
        sm_q[j][l] = make_uint2(pack_rn<kBf16>(qv[4 * j], qv[4 * j + 1]), pack_rn<kBf16>(qv[4 * j + 2], qv[4 * j + 3]));
      }
    }
  }
  __syncthreads();
  // Keys every row of the block sees: tiles inside need no mask (padding rows have Q = 0
  // and are never written). The last row has the latest window start, the first row the
  // earliest causal end.
  const int32_t full_lo = max(begin, a.window > 0 ? pos0 + nrows - a.window : 0);
  const int32_t full_hi = min(end - 1, pos0);
  // This lane's C-fragment rows are 2c and 2c+1: their score factors and visible keys.
  float fac[2];
  int32_t rlo[2], rhi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int n = 2 * c + i;
    fac[i] = group_shfl(row_factor, 4 * n);
    if (n < nvalid) {
      const int32_t pos = pos0 + n / G;
      rlo[i] = max(begin, a.window > 0 ? pos - a.window + 1 : 0);
      rhi[i] = min(end - 1, pos);
    } else {
      rlo[i] = 1;  // padding row: sees nothing
      rhi[i] = 0;
    }
  }

  // ---- addressing of a tile's keys
  const int64_t row_bytes = int64_t(H) * D * kEb;
  const uint8_t* kbase = static_cast<const uint8_t*>(a.cache.k) + int64_t(kvh) * D * kEb;
  const uint8_t* vbase = static_cast<const uint8_t*>(a.cache.v) + int64_t(kvh) * D * kEb;
  // Page-aligned tiles: the 16 keys of a tile are consecutive slots of one page with a
  // valid table entry, so this lane's rows lie at fixed offsets from the tile's first
  // row, and loading keys outside [begin, end) is memory-safe: their K only yields masked
  // scores, their V is zeroed (a stale slot may hold NaN, and 0 * NaN is NaN).
  uint32_t koff[2] = {0u, 0u}, voff[4] = {0u, 0u, 0u, 0u};
  if constexpr (kPageTiles) {
    koff[0] = uint32_t(g * row_bytes + c * 16);
    koff[1] = koff[0] + uint32_t(8 * row_bytes);
#pragma unroll
    for (int vv = 0; vv < 4; ++vv) {
      voff[vv] = uint32_t((2 * c + (vv & 1) + 8 * (vv >> 1)) * row_bytes + g * (Gm::kVWords * 4));
    }
  }
  // Any page size: byte offset of the row of key t0 + i, or -1 outside [begin, end).
  const auto key_offset = [&](const Ent& e, int i) -> int64_t {
    const int32_t page = group_shfl(e.page, i), inpage = group_shfl(e.inpage, i);
    return page < 0 ? -1 : (int64_t(page) * ps + inpage) * row_bytes;
  };
  // kRope: this block may have written a key of its tiles: plain (coherent) loads.
  const auto tile_16B = [](const uint8_t* src) {
    return kRope ? *reinterpret_cast<const uint4*>(src) : load_ro_16B(src);
  };
  const auto load_k = [&](Raw<D, K>& r, const Ent& e) {
    const uint8_t* tile = kbase + (int64_t(e.page) * ps + e.inpage) * row_bytes;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int64_t off = kPageTiles ? 0 : key_offset(e, g + 8 * kk);
      const uint8_t* src = kPageTiles ? tile + koff[kk] : kbase + off + c * 16;
#pragma unroll
      for (int pc = 0; pc < Gm::kKWords / 4; ++pc) {
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (kPageTiles || off >= 0) x = tile_16B(src + 64 * pc);
        put_words(r.k[kk], 4 * pc, x);
      }
    }
  };
  const auto load_v = [&](Raw<D, K>& r, int32_t t0, const Ent& e) {
    const uint8_t* tile = vbase + (int64_t(e.page) * ps + e.inpage) * row_bytes;
#pragma unroll
    for (int vv = 0; vv < 4; ++vv) {
      const int64_t off = kPageTiles ? 0 : key_offset(e, 2 * c + (vv & 1) + 8 * (vv >> 1));
      const uint8_t* src = kPageTiles ? tile + voff[vv] : vbase + off + g * (Gm::kVWords * 4);
      if constexpr (Gm::kVWords == 2) {
        uint2 x = make_uint2(0u, 0u);
        if (kPageTiles || off >= 0) x = *reinterpret_cast<const uint2*>(src);
        r.v[vv][0] = x.x;
        r.v[vv][1] = x.y;
      } else {
#pragma unroll
        for (int pc = 0; pc < Gm::kVWords / 4; ++pc) {
          uint4 x = make_uint4(0u, 0u, 0u, 0u);
          if (kPageTiles || off >= 0) x = tile_16B(src + 16 * pc);
          put_words(r.v[vv], 4 * pc, x);
        }
      }
    }
    if (kPageTiles && (t0 < begin || t0 + kTileKeys > end)) {  // a first or last tile
#pragma unroll
      for (int vv = 0; vv < 4; ++vv) {
        const int32_t key = t0 + 2 * c + (vv & 1) + 8 * (vv >> 1);
        if (key < begin || key >= end) {
#pragma unroll
          for (int i = 0; i < Gm::kVWords; ++i) r.v[vv][i] = 0u;
        }
      }
    }
  };

  // ---- online softmax over the group's tiles: its state (the output accumulators, the
  // rows' running max and sum) and its steps (OnlineSoftmax, kernels/attention/attention_block.cuh)
  float acc[Gm::kChunks][4];
#pragma unroll
  for (int j = 0; j < Gm::kChunks; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
  const OnlineSoftmax<D, K> st{acc, m, lsum, fac, rlo, rhi, full_lo, full_hi, g, c};

  // ---- the group's tiles (t_first, + stride, ...: their first two table entries were
  // read before the wait). One buffer per operand: the next tile's K loads are issued as
  // soon as QK has consumed this tile's K (kEarlyK), its V loads once PV has consumed
  // this V, so a tile is always in flight while the block table runs one more tile ahead.
  int32_t t = t_first;
  if (t < end) {
    Raw<D, K> r;
    load_k(r, e_first);
    load_v(r, t, e_first);
    Ent e_next = e_second;
    for (;;) {
      const Ent e_after = fetch(t + 2 * stride);
      const bool more = t + stride < end;
      float s[4];
      tile_scores<D, K>(r, sm_q, l, s);
      if (Gm::kEarlyK && more) load_k(r, e_next);
      uint32_t ph[2], pl[2];
      st.update(s, t, ph, pl);
      st.accumulate(r, ph, pl);
      if (more) {
        if (!Gm::kEarlyK) load_k(r, e_next);
        load_v(r, t + stride, e_next);
      }
      if (!more) break;
      t += stride;
      e_next = e_after;
    }
  }
  launch_dependents();

  // ---- merge the groups' states; every thread then finishes D/16 values of one row
#pragma unroll
  for (int off = 4; off < kMmaLanes; off *= 2) {
    lsum[0] += warp_shfl_xor(lsum[0], off);
    lsum[1] += warp_shfl_xor(lsum[1], off);
  }
  __shared__ float sm_acc[kGroups][kRows][D + 4];
  __shared__ float sm_m[kGroups][kRows], sm_l[kGroups][kRows];
  if (g == 0) {
    sm_m[w][2 * c] = m[0];
    sm_m[w][2 * c + 1] = m[1];
    sm_l[w][2 * c] = lsum[0];
    sm_l[w][2 * c + 1] = lsum[1];
  }
#pragma unroll
  for (int j = 0; j < Gm::kChunks; ++j) {
    const int d = g * (D / 8) + 2 * j;
    sm_acc[w][2 * c][d] = acc[j][0];
    sm_acc[w][2 * c][d + 1] = acc[j][2];
    sm_acc[w][2 * c + 1][d] = acc[j][1];
    sm_acc[w][2 * c + 1][d + 1] = acc[j][3];
  }
  __syncthreads();
  constexpr int kPer = D / kEpiThreadsPerRow;
  const int n = int(threadIdx.x) / kEpiThreadsPerRow;
  const int d0 = (int(threadIdx.x) % kEpiThreadsPerRow) * kPer;
  if (n < nvalid) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) mx = fmaxf(mx, sm_m[i][n]);
    float f[kGroups], total = 0.0f;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      f[i] = sm_m[i][n] == -INFINITY ? 0.0f : exp2f(sm_m[i][n] - mx);
      total += sm_l[i][n] * f[i];
    }
    const float v_factor = kBf16 ? 1.0f : fp8_raw_factor<K>() * *a.cache.v_scale;
    const int64_t row = int64_t(row0) + n / G;
    const int32_t qh = kvh * G + n % G;
    if (!to_scratch) {
      bf16_t* out = a.out + row * a.out_token_stride + int64_t(qh) * D + d0;
#pragma unroll
      for (int d = 0; d < kPer; ++d) {
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < kGroups; ++i) o += sm_acc[i][n][d0 + d] * f[i];
        out[d] = f32_to_bf16(o * v_factor / total);
      }
    } else {
      const int64_t idx = (row * a.num_q_heads + qh) * p.num_parts + part;
      float* po = p.part_o + idx * D + d0;
#pragma unroll
      for (int d = 0; d < kPer; ++d) {
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < kGroups; ++i) o += sm_acc[i][n][d0 + d] * f[i];
        po[d] = o * v_factor;
      }
      if (d0 == 0) {
        p.part_ml[2 * idx] = mx;
        p.part_ml[2 * idx + 1] = total;
      }
    }
  }
  if (!to_scratch || p.part_done == nullptr) return;

  // ---- split path: the last of this row's partitions to finish merges them (for the
  // block's G query heads), in partition order as the merge kernel would, then sets the
  // count back to 0 for the next launch.
  __shared__ int32_t sm_last;
  __threadfence();  // this block's partial results, visible before its count
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* done = p.part_done + int64_t(row0) * H + kvh;
    sm_last = atomicAdd(done, 1) == last_part;
    if (sm_last) atomicExch(done, 0);
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  constexpr int kMergePer = D / kMmaLanes;
  constexpr int kPieces = D / kMergePer;
  for (int item = int(threadIdx.x); item < G * kPieces; item += kThreads) {
    merge_partitions<D, kMergePer>(a, p.part_o, p.part_ml, p.part_len, p.num_parts, seq, kvh * G + item / kPieces,
                                   (item % kPieces) * kMergePer, L2Load{});
  }
}

template <int D, KvKind K>
cudaError_t launch_main(const Params& p, int64_t blocks, cudaStream_t stream, bool pdl) {
  if (blocks <= 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  if (p.rope_write) {
    if constexpr (kRopeKind<K>) {
      if (p.page_tiles) {
        return launch_kernel(attention_kernel<D, K, true, true>, unsigned(blocks), kThreads, stream, pdl, p);
      }
    }
    return cudaErrorInvalidValue;  // attention_rope_unsupported refuses these
  }
  return p.page_tiles
             ? launch_kernel(attention_kernel<D, K, true, false>, unsigned(blocks), kThreads, stream, pdl, p)
             : launch_kernel(attention_kernel<D, K, false, false>, unsigned(blocks), kThreads, stream, pdl,
                             p);
}

}  // namespace

namespace attention_detail {

cudaError_t launch_attention_blocks(const Params& p, int64_t blocks, const AttnLaunch& l,
                                    cudaStream_t stream) {
  return dispatch_head_dim_format(p.a.cache.head_dim, p.a.cache.format, [&](auto hd, auto fmt) {
    constexpr int D = decltype(hd)::value;
    constexpr KvFormat F = decltype(fmt)::value;
    if constexpr (kWarpSize == 64) {
      return launch_attention_mfma(p, blocks, stream);  // CDNA: the matrix-core kernel
    } else if constexpr (F == KvFormat::bf16) {
      return launch_main<D, KvKind::bf16>(p, blocks, stream, l.pdl);
    } else if constexpr (F == KvFormat::fp8_e4m3fn) {
      return l.fp8_decode == 1 ? launch_main<D, KvKind::e4m3fn_bits>(p, blocks, stream, l.pdl)
                               : launch_main<D, KvKind::e4m3fn_hw>(p, blocks, stream, l.pdl);
    } else if constexpr (F == KvFormat::fp8_e4m3fnuz) {
      return launch_main<D, KvKind::e4m3fnuz>(p, blocks, stream, l.pdl);
    } else {
      static_assert(F == KvFormat::fp8_e5m2, "a KV format without an attention kernel");
      return launch_main<D, KvKind::e5m2>(p, blocks, stream, l.pdl);
    }
  });
}

}  // namespace attention_detail

std::string attention_unsupported(const AttnArgs& a) {
  const PagedKvView& c = a.cache;
  std::string why = model_shape_unsupported(c.head_dim, a.num_q_heads, c.num_kv_heads, c.format);
  const auto add = [&why](const char* s) { why += (why.empty() ? "" : "; ") + std::string(s); };
  if (c.page_size <= 0) add("page size must be positive");
  if (a.window < 0) add("window must be >= 0");
  if (c.format != KvFormat::bf16 && (c.k_scale == nullptr || c.v_scale == nullptr)) {
    add("an FP8 cache needs k/v scales");
  }
  if (why.empty()) return why;
  return "attention: unsupported (head_dim " + std::to_string(c.head_dim) + ", q heads " +
         std::to_string(a.num_q_heads) + ", kv heads " + std::to_string(c.num_kv_heads) + ", page size " +
         std::to_string(c.page_size) + ", window " + std::to_string(a.window) + ", " +
         kv_format_name(c.format) + "): " + why;
}

std::string attention_rope_unsupported(const AttnArgs& a, const KvWriteRopeArgs& r, const AttnLaunch& l) {
  const PagedKvView &c = a.cache, &rc = r.kv.cache;
  std::string why;
  if (kWarpSize != 32) {
    why = "the CDNA attention kernel does not take the write in";
  } else if (a.batch.max_query_len != 1) {
    why = "a batch with prefill rows (max_query_len " + std::to_string(a.batch.max_query_len) + ")";
  } else if (c.page_size % kTileKeys != 0) {
    why = "page size " + std::to_string(c.page_size) + " not a multiple of " + std::to_string(kTileKeys);
  } else if (c.format == KvFormat::fp8_e4m3fnuz || (c.format == KvFormat::fp8_e4m3fn && l.fp8_decode != 0)) {
    why = std::string("cache dtype ") + kv_format_name(c.format) + " with this decode";
  } else if (r.k_rotated != nullptr) {
    why = "k_rotated is kv_write_rope's alone";
  } else if (r.q != a.q || r.q_token_stride != a.q_token_stride || r.q_heads != a.num_q_heads ||
             r.kv.num_tokens != a.batch.num_tokens || rc.k != c.k || rc.v != c.v || rc.format != c.format ||
             rc.head_dim != c.head_dim || rc.num_kv_heads != c.num_kv_heads || rc.page_size != c.page_size ||
             rc.num_pages != c.num_pages || rc.k_scale != c.k_scale || rc.v_scale != c.v_scale ||
             rc.k_inv_scale != c.k_inv_scale || rc.v_inv_scale != c.v_inv_scale) {
    why = "the write's q, tokens or cache differ from the attention's";
  } else if (std::string w = kv_write_rope_unsupported(r); !w.empty()) {
    return w;
  }
  return why.empty() ? why : "attention with RoPE and the KV write: " + why;
}

LaunchStatus launch_attention_unified(const AttnArgs& a, cudaStream_t stream, const AttnLaunch& l,
                                      const KvWriteRopeArgs* rope) {
  if (std::string why = attention_unsupported(a); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
  if (rope != nullptr) {
    if (std::string why = attention_rope_unsupported(a, *rope, l); !why.empty()) {
      return LaunchStatus::refused(std::move(why));
    }
  }
  if (a.batch.num_tokens <= 0 || a.batch.num_seqs <= 0) return cudaSuccess;
  Params p = base_params(a);
  take_rope(rope, p);
  p.mode = kModeUnified;
  return launch_attention_blocks(p, a.batch.num_tokens * a.cache.num_kv_heads, l, stream);
}

}  // namespace kvfuse::gpu
