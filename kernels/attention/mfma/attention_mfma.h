// Paged attention on AMD's matrix cores (CDNA3 gfx942, CDNA4 gfx950): one block of the
// kernel, written once for two executors. On the GPU (kernels/attention/mfma/attention_mfma.cu) the
// executor is the wavefront itself; on the host (kernels/cpu/attention/wave_emu.h) it is 64 lanes
// run one at a time that meet at every cross-lane step, with the MFMA instructions
// emulated (kernels/cpu/attention/mfma_emu.h), so the CPU tests run this code lane by lane against
// the CPU reference (tests/kernels/test_attention_mfma_lanes.cc). The contract is the CUDA
// kernel's (kernels/attention/attention.cuh): GQA packing, causal, sliding window, every KV format
// and page size, unified and split paths; the numerics are its numerics
// (kernels/attention/attention_tile.cuh, "Numerics"): FP8 becomes f16 exactly (up to a power of two
// folded into the scores and the output), Q is scaled per row by a power of two into the
// f16 range, P enters the PV product as a hi + lo pair, fp32 accumulation, the output
// rounded to bf16 once.
//
// Tiling. A block has four 64-lane waves and up to kRows = 16 query rows (tokens x the G
// heads of one KV head: a decode row alone, or 16 / G consecutive rows of a prefill
// chunk). Each wave takes every fourth tile of 32 keys of the block's key range, with an
// online softmax of its own; the waves are merged at the end. Per tile, with lane l =
// 16 q + r (r = l % 16, q = l / 16) and the 16x16x32 instruction (two 16x16x16 on gfx942,
// kernels/attention/mfma/mfma.cuh), query rows being the N dimension throughout:
//   S_h^T [16 keys x 16 rows] = K_h [16 keys x D] . Q^T [D x 16 rows]     h = 0, 1
//   O^T   [D x 16 rows]      += V^T [D x 32 keys] . P^T [32 keys x 16 rows]
// - K: lane l loads key 16 h + r of half h, the quarter q of its row: 16-byte pieces at
//   bytes 64 p + 16 q (four lanes read 64 contiguous bytes). A dot product does not care
//   in which order its dimensions are summed, so the K operand takes dimensions in load
//   order and Q's operand uses the same permutation (dim_of below).
// - S: the accumulator of half h leaves lane l holding keys 16 h + 4 q + i (i = 0..3) of
//   row r: exactly the B operand of the PV instruction (element i: key 4 q + i, element
//   4 + i: key 16 + 4 q + i, relabelling its k index), so P never moves between lanes.
//   A row's max and sum need two cross-lane steps (lanes r, r+16, r+32, r+48).
// - V: the A operand of output chunk j (16 dimensions) has row r = dimension
//   r * D/16 + j: lane l needs, for each of its 8 keys, dimensions [r D/16, (r+1) D/16),
//   one contiguous run per key (16 bytes for FP8 at D = 256 and bf16 at D = 128), and
//   the accumulators of chunk j hold dimensions (4 q + i) D/16 + j of row r, so a lane
//   writes its output as four contiguous runs.
// Pages outside the block's key range are never read (they may be -1); with page sizes a
// multiple of 16 a half tile is 16 slots of one page and a half partly in range loads
// the slots around it (in bounds, maybe NaN): their scores are masked and their V zeroed.
//
// The executor X provides: lane(), wave(), block(); sync() (the block barrier); shfl_xor
// (across the wave); mfma<kBf16>(acc, a, b) (16x16x32, fp32 accumulators, f16 or bf16
// operands as four packed words); byte_perm (CUDA's __byte_perm); cvt_fp8x4<F>(w, lo, hi)
// and fp8_factor<F>() (four FP8 codes to two f16x2 words holding decode(x) / factor);
// exp2; and the loads load_words<N>(ptr, out) (N = 1, 2, 4 words, from 4N-byte aligned
// memory).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/attention/attention_params.h"
#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu::attention_detail::mfma_attn {

constexpr int kWaves = 4;
constexpr int kLanes = 64;
constexpr int kThreads = kWaves * kLanes;
constexpr int kRows = 16;        // query rows per block: the N of every instruction
constexpr int kTile = 32;        // keys per wave step: two 16-key halves
constexpr int kBlocksPerCu = 2;  // resident blocks the kernel is built for: 2 waves per SIMD
constexpr float kLog2e = 1.4426950408889634f;

// Four FP8 codes [x0 x1 x2 x3] (x0 in the low byte) -> f16x2 {x0, x1} and {x2, x3} by bit
// manipulation, each value decode(x) / fp8_bits_factor(F), exact for every non-NaN code:
// e5m2 is the top byte of the f16 with the same value; e4m3 s.eeee.mmm becomes f16
// s.0eeee.mmm0000000, the f16 exponent bias being 15 instead of 7 (8 for FNUZ), so the
// f16 is the value times 2^-8 (2^-7). The executors use it where the target has no
// conversion instruction for the format.
template <KvFormat F>
KVFUSE_HD void fp8x4_to_f16x2_bits(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t x = (w & 0xffu) << 8 | (w & 0xff00u) << 16;    // bytes 0, 1 -> top of each half
  const uint32_t y = (w & 0xff0000u) >> 8 | (w & 0xff000000u);  // bytes 2, 3
  if constexpr (F == KvFormat::fp8_e5m2) {
    lo = x;
    hi = y;
  } else {
    lo = (x & 0x80008000u) | ((x & 0x7f007f00u) >> 1);
    hi = (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
  }
}

constexpr float fp8_bits_factor(KvFormat f) {
  return f == KvFormat::fp8_e4m3fn ? 256.0f : (f == KvFormat::fp8_e4m3fnuz ? 128.0f : 1.0f);
}

template <int D, KvFormat F>
struct Geo {
  static constexpr bool kBf16 = F == KvFormat::bf16;
  static constexpr int kEb = kBf16 ? 2 : 1;
  static constexpr int kChunks = D / 32;        // k32 steps of QK
  static constexpr int kOutChunks = D / 16;     // m16 tiles of PV
  static constexpr int kKWords = D * kEb / 16;  // per lane and K key: a quarter row
  static constexpr int kKPieces = kKWords / 4;  // 16-byte pieces of it
  static constexpr int kVWords = D * kEb / 64;  // per lane and V key: D/16 dims
  static constexpr int kAcc = kOutChunks * 4;   // fp32 accumulators per lane
  // The next tile's loads are issued before this tile's math when both tiles fit the
  // registers (about 64 words of raw cache data); bigger tiles keep enough bytes in
  // flight on their own.
  static constexpr bool kPrefetch = 2 * (2 * kKWords + 8 * kVWords) <= 64;
  // A tile's V loads wait until QK has consumed its K when K, V and the accumulators
  // together would not fit 2 waves' registers (bf16 at D = 256: 64 + 64 + 64 words).
  static constexpr bool kLateV = 2 * kKWords + 8 * kVWords + kAcc > 160;
  static_assert(kKPieces >= 1 && kVWords >= 1, "head_dim");
};

// Dimension of element e (0 .. D/4) of lane quarter q's K stream (and Q operand).
template <int D, KvFormat F>
KVFUSE_HD int dim_of(int q, int e) {
  constexpr int eb = Geo<D, F>::kEb;
  const int byte = e * eb;
  return (64 * (byte / 16) + 16 * q + byte % 16) / eb;
}

template <int D, KvFormat F>
struct Raw {
  uint32_t k[2][Geo<D, F>::kKWords];  // keys 16 h + r
  uint32_t v[8][Geo<D, F>::kVWords];  // keys 4 q + i (0..3), 16 + 4 q + i (4..7)
};

// Shared memory of a block. Q's operand is needed in the tile loop only and the wave
// merge after it only, so they share the bytes.
template <int D>
struct Smem {
  union {
    uint32_t q[D / 32][kLanes][4];  // Q operand per chunk and lane (conflict-free b128)
    float o[D / 4][kLanes];         // merge: running sum, accumulator-major
  } u;
  float fac[kRows];  // score factor per row
  float m[kWaves][kRows];
  float l[kWaves][kRows];
};

template <int D, KvFormat F, bool kPageTiles, class X>
KVFUSE_HD void block(X& x, const Params& p, Smem<D>& sm) {
  using Gm = Geo<D, F>;
  constexpr bool kBf16 = Gm::kBf16;
  constexpr int kEb = Gm::kEb;
  const AttnArgs& a = p.a;
  const int32_t H = a.cache.num_kv_heads;
  const int32_t G = a.num_q_heads / H;
  const int lane = x.lane(), w = x.wave(), r = lane & 15, q = lane >> 4;

  // ---- the rows and keys of this block (uniform over the block): block_rows, the CUDA
  // kernel's too (kernels/attention/attention_params.h)
  BlockRows br;
  if (!block_rows<kRows>(p, [&x] { return x.block(); }, BinaryFindSeq{}, br)) return;
  const int32_t seq = br.seq, kvh = br.kvh, row0 = br.row0, nrows = br.nrows, pos0 = br.pos0, part = br.part;
  const int32_t begin = br.begin, end = br.end;
  const bool to_scratch = br.to_scratch;
  const int nvalid = nrows * G;  // rows in use: row n is token n / G, head n % G

  // ---- Q operand (wave 0): lane (r, q) holds row r at dimensions dim_of(q, 8 c + i)
  // for chunk c. For FP8 caches the row is scaled by 2^s so that its largest magnitude
  // lies in [2^14, 2^15): every bf16 value of it down to 2^-28 of the largest is then
  // exact in f16 (bf16 has 8 significant bits, f16 11).
  if (w == 0) {
    float qv[D / 4];
    if (r < nvalid) {
      const bf16_t* qp = a.q + int64_t(row0 + r / G) * a.q_token_stride + int64_t(kvh * G + r % G) * D;
      for (int e = 0; e < D / 4; ++e) qv[e] = bf16_to_f32(qp[dim_of<D, F>(q, e)]);
    } else {
      for (int e = 0; e < D / 4; ++e) qv[e] = 0.0f;
    }
    float k_factor = 1.0f;
    if constexpr (!kBf16) {
      float qmax = 0.0f;
      for (int e = 0; e < D / 4; ++e)
        qmax = qv[e] < 0 ? (-qv[e] > qmax ? -qv[e] : qmax) : (qv[e] > qmax ? qv[e] : qmax);
      const float o16 = x.shfl_xor(qmax, 16);
      qmax = o16 > qmax ? o16 : qmax;
      const float o32 = x.shfl_xor(qmax, 32);
      qmax = o32 > qmax ? o32 : qmax;
      const int32_t ex = int32_t((f32_bits(qmax) >> 23) & 0xffu);
      int32_t s = 0;
      if (qmax > 0.0f) s = 141 - ex < -126 ? -126 : (141 - ex > 126 ? 126 : 141 - ex);
      const float up = f32_from_bits(uint32_t(127 + s) << 23);
      for (int e = 0; e < D / 4; ++e) qv[e] *= up;
      k_factor = f32_from_bits(uint32_t(127 - s) << 23) * x.template fp8_factor<F>() * *a.cache.k_scale;
    }
    for (int c = 0; c < Gm::kChunks; ++c) {
      for (int i = 0; i < 4; ++i) {
        sm.u.q[c][lane][i] = x.template pack_rn<kBf16>(qv[8 * c + 2 * i], qv[8 * c + 2 * i + 1]);
      }
    }
    if (q == 0) sm.fac[r] = a.softmax_scale * kLog2e * k_factor;
  }
  x.sync();
  const float fac = sm.fac[r];
  // Keys row r sees: [rlo, rhi]; none for padding rows.
  int32_t rlo = 1, rhi = 0;
  if (r < nvalid) {
    const int32_t pos = pos0 + r / G;
    rlo = a.window > 0 && pos - a.window + 1 > begin ? pos - a.window + 1 : begin;
    rhi = end - 1 < pos ? end - 1 : pos;
  }
  // Keys every row of the block sees: tiles inside need no mask.
  const int32_t wlo = a.window > 0 ? pos0 + nrows - a.window : 0;
  const int32_t full_lo = wlo > begin ? wlo : begin;
  const int32_t full_hi = end - 1 < pos0 ? end - 1 : pos0;

  // ---- addressing
  const int32_t ps = a.cache.page_size;
  const int32_t* table = a.batch.block_table + int64_t(seq) * a.batch.max_pages_per_seq;
  const int64_t row_bytes = int64_t(H) * D * kEb;
  const uint8_t* kbase = static_cast<const uint8_t*>(a.cache.k) + int64_t(kvh) * D * kEb;
  const uint8_t* vbase = static_cast<const uint8_t*>(a.cache.v) + int64_t(kvh) * D * kEb;
  // Slot of `key`, or -1 outside [begin, end).
  const auto slot_of = [&](int32_t key) -> int64_t {
    if (key < begin || key >= end) return -1;
    int32_t idx, inpage;
    if (p.ps_shift >= 0) {
      idx = key >> p.ps_shift;
      inpage = key & (ps - 1);
    } else {
      idx = key / ps;
      inpage = key - idx * ps;
    }
    return int64_t(table[idx]) * ps + inpage;
  };
  // Page-aligned halves: slot of the half's first key if any key of the half is in
  // [begin, end) (its page is then valid), else -1.
  const auto half_slot = [&](int32_t k0) -> int64_t {
    if (k0 + 16 <= begin || k0 >= end) return -1;
    const int32_t idx = p.ps_shift >= 0 ? k0 >> p.ps_shift : k0 / ps;
    return int64_t(table[idx]) * ps + (k0 - idx * ps);
  };
  const auto load_k_half = [&](Raw<D, F>& raw, int32_t t0, int h) {
    const int64_t hs = kPageTiles ? half_slot(t0 + 16 * h) : -1;
    const int64_t slot = kPageTiles ? (hs < 0 ? -1 : hs + r) : slot_of(t0 + 16 * h + r);
    const uint8_t* src = kbase + slot * row_bytes + 16 * q;
    for (int pc = 0; pc < Gm::kKPieces; ++pc) {
      if (slot >= 0) {
        x.template load_words<4>(src + 64 * pc, &raw.k[h][4 * pc]);
      } else {
        for (int i = 0; i < 4; ++i) raw.k[h][4 * pc + i] = 0u;
      }
    }
  };
  const auto load_v = [&](Raw<D, F>& raw, int32_t t0) {
    int64_t hs[2] = {-1, -1};
    if constexpr (kPageTiles) {
      hs[0] = half_slot(t0);
      hs[1] = half_slot(t0 + 16);
    }
    for (int kk = 0; kk < 8; ++kk) {
      const int h = kk >> 2;
      const int32_t key = t0 + 16 * h + 4 * q + (kk & 3);
      int64_t slot;
      if constexpr (kPageTiles) {
        // The half's slots around [begin, end) are in its page; their V is zeroed.
        slot = hs[h] < 0 || key < begin || key >= end ? -1 : hs[h] + 4 * q + (kk & 3);
      } else {
        slot = slot_of(key);
      }
      const uint8_t* src = vbase + slot * row_bytes + r * Gm::kVWords * 4;
      if (slot >= 0) {
        if constexpr (Gm::kVWords <= 4) {
          x.template load_words<Gm::kVWords>(src, raw.v[kk]);
        } else {
          for (int pc = 0; pc < Gm::kVWords / 4; ++pc)
            x.template load_words<4>(src + 16 * pc, &raw.v[kk][4 * pc]);
        }
      } else {
        for (int i = 0; i < Gm::kVWords; ++i) raw.v[kk][i] = 0u;
      }
    }
  };

  // ---- online softmax state of row r (replicated over the four lanes of the row)
  float acc[Gm::kOutChunks][4];
  for (int j = 0; j < Gm::kOutChunks; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m = -INFINITY, lsum = 0.0f;

  // A tile's loads ahead of its math; with kLateV only V's, after QK, and K's half by half
  // inside it.
  const auto load = [&](Raw<D, F>& raw, int32_t t0) {
    if constexpr (!Gm::kLateV) {
      load_k_half(raw, t0, 0);
      load_k_half(raw, t0, 1);
      load_v(raw, t0);
    }
  };

  const auto tile = [&](Raw<D, F>& raw, int32_t t0) {
    // S_h^T = K_h Q^T
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int h = 0; h < 2; ++h) {
      if constexpr (Gm::kLateV) load_k_half(raw, t0, h);
      for (int c = 0; c < Gm::kChunks; ++c) {
        uint32_t qb[4], ka[4];
        for (int i = 0; i < 4; ++i) qb[i] = sm.u.q[c][lane][i];
        if constexpr (kBf16) {
          for (int i = 0; i < 4; ++i) ka[i] = raw.k[h][4 * c + i];
        } else {
          x.template cvt_fp8x4<F>(raw.k[h][2 * c], ka[0], ka[1]);
          x.template cvt_fp8x4<F>(raw.k[h][2 * c + 1], ka[2], ka[3]);
        }
        x.template mfma<kBf16>(s[h], ka, qb);
      }
    }
    if constexpr (Gm::kLateV) load_v(raw, t0);
    // Scores of keys t0 + 16 h + 4 q + i for row r, in the exp2 domain.
    float sc[8];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) sc[4 * h + i] = s[h][i] * fac;
    if (t0 < full_lo || t0 + kTile - 1 > full_hi) {  // a tile some row sees only in part
      for (int kk = 0; kk < 8; ++kk) {
        const int32_t key = t0 + 16 * (kk >> 2) + 4 * q + (kk & 3);
        sc[kk] = key >= rlo && key <= rhi ? sc[kk] : -INFINITY;
      }
    }
    float tmax = sc[0];
    for (int kk = 1; kk < 8; ++kk) tmax = sc[kk] > tmax ? sc[kk] : tmax;
    float o = x.shfl_xor(tmax, 16);
    tmax = o > tmax ? o : tmax;
    o = x.shfl_xor(tmax, 32);
    tmax = o > tmax ? o : tmax;
    const float mn = tmax > m ? tmax : m;
    const float mu = mn == -INFINITY ? 0.0f : mn;  // no visible key yet: keep everything at 0
    const float corr = x.exp2(m - mu);
    m = mn;
    float pr[8], psum = 0.0f;
    for (int kk = 0; kk < 8; ++kk) {
      pr[kk] = x.exp2(sc[kk] - mu);
      psum += pr[kk];
    }
    lsum = lsum * corr + psum;
    if (corr != 1.0f) {  // the running max moved (rare after the first tiles)
      for (int j = 0; j < Gm::kOutChunks; ++j)
        for (int i = 0; i < 4; ++i) acc[j][i] *= corr;
    }
    // P^T as B operand, hi + lo: element kk is key kk of the lane (see the header).
    uint32_t ph[4], pl[4];
    for (int i = 0; i < 4; ++i) {
      ph[i] = x.template pack_rn<kBf16>(pr[2 * i], pr[2 * i + 1]);
      pl[i] = x.template pack_rn<kBf16>(pr[2 * i] - x.template half_lo<kBf16>(ph[i]),
                                        pr[2 * i + 1] - x.template half_hi<kBf16>(ph[i]));
    }
    // O^T += V^T P^T, output chunks j and j + 1 together (one byte permute and one
    // conversion per two keys serve both).
    for (int j = 0; j < Gm::kOutChunks; j += 2) {
      uint32_t va[2][4];
      for (int mm = 0; mm < 4; ++mm) {
        const uint32_t* v0 = raw.v[2 * mm];
        const uint32_t* v1 = raw.v[2 * mm + 1];
        if constexpr (kBf16) {
          va[0][mm] = x.byte_perm(v0[j / 2], v1[j / 2], 0x5410u);
          va[1][mm] = x.byte_perm(v0[j / 2], v1[j / 2], 0x7632u);
        } else {
          const uint32_t pick = (j & 2) ? 0x7362u : 0x5140u;  // bytes {a_j, b_j, a_j+1, b_j+1}
          x.template cvt_fp8x4<F>(x.byte_perm(v0[j / 4], v1[j / 4], pick), va[0][mm], va[1][mm]);
        }
      }
      for (int jj = 0; jj < 2; ++jj) {
        x.template mfma<kBf16>(acc[j + jj], va[jj], ph);
        x.template mfma<kBf16>(acc[j + jj], va[jj], pl);
      }
    }
  };

  // ---- this wave's tiles: every kWaves-th tile of 32 keys from begin rounded down
  const int32_t stride = kTile * kWaves;
  int32_t t = (begin & ~(kTile - 1)) + kTile * w;
  if (t < end) {
    Raw<D, F> cur;
    load(cur, t);
    for (;;) {
      const bool more = t + stride < end;
      if constexpr (Gm::kPrefetch) {
        Raw<D, F> nxt;
        if (more) load(nxt, t + stride);
        tile(cur, t);
        if (!more) break;
        cur = nxt;
      } else {
        tile(cur, t);
        if (!more) break;
        load(cur, t + stride);
      }
      t += stride;
    }
  }

  // ---- merge the waves: row maxima and sums through shared memory, then the
  // accumulators added wave after wave in a fixed order (the same bits every run); the
  // last wave writes the result.
  float o16 = x.shfl_xor(lsum, 16);
  lsum += o16;
  o16 = x.shfl_xor(lsum, 32);
  lsum += o16;
  if (q == 0) {
    sm.m[w][r] = m;
    sm.l[w][r] = lsum;
  }
  x.sync();  // also: every wave is past the tile loop, Q's bytes are free
  float mx = -INFINITY;
  for (int i = 0; i < kWaves; ++i) mx = sm.m[i][r] > mx ? sm.m[i][r] : mx;
  float total = 0.0f, mine = 0.0f;
  for (int i = 0; i < kWaves; ++i) {
    const float f = sm.m[i][r] == -INFINITY ? 0.0f : x.exp2(sm.m[i][r] - mx);
    total += sm.l[i][r] * f;
    if (i == w) mine = f;
  }
  for (int stage = 0; stage < kWaves; ++stage) {
    if (w == stage) {
      for (int j = 0; j < Gm::kOutChunks; ++j) {
        for (int i = 0; i < 4; ++i) {
          const float prev = stage == 0 ? 0.0f : sm.u.o[4 * j + i][lane];
          acc[j][i] = prev + acc[j][i] * mine;
          if (stage + 1 < kWaves) sm.u.o[4 * j + i][lane] = acc[j][i];
        }
      }
    }
    if (stage + 1 < kWaves) x.sync();
  }
  if (w != kWaves - 1 || r >= nvalid) return;
  const float v_factor = kBf16 ? 1.0f : x.template fp8_factor<F>() * *a.cache.v_scale;
  const int64_t row = int64_t(row0) + r / G;
  const int32_t qh = kvh * G + r % G;
  constexpr int kRun = D / 16;  // dimensions (4 q + i) * kRun + j, j = 0 .. kRun - 1
  if (!to_scratch) {
    bf16_t* out = a.out + row * a.out_token_stride + int64_t(qh) * D;
    for (int i = 0; i < 4; ++i) {
      uint32_t words[kRun / 2];
      for (int j = 0; j < kRun; j += 2) {
        words[j / 2] = uint32_t(f32_to_bf16(acc[j][i] * v_factor / total)) |
                       (uint32_t(f32_to_bf16(acc[j + 1][i] * v_factor / total)) << 16);
      }
      x.template store_words<kRun / 2>(out + (4 * q + i) * kRun, words);
    }
  } else {
    const int64_t idx = (row * a.num_q_heads + qh) * p.num_parts + part;
    float* po = p.part_o + idx * D;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < kRun; ++j) po[(4 * q + i) * kRun + j] = acc[j][i] * v_factor;
    if (q == 0) {
      p.part_ml[2 * idx] = mx;
      p.part_ml[2 * idx + 1] = total;
    }
  }
}

}  // namespace kvfuse::gpu::attention_detail::mfma_attn
