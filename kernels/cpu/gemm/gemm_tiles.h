// The GEMM tile loops, included by each per-ISA translation unit (gemm.cc, gemm_avx2.cc,
// gemm_avx512.cc) with its own vector type V. Everything here has internal linkage and
// uses no standard-library template: those units are compiled with different -m flags,
// and an inline function shared between them could be merged by the linker into the
// AVX-512 copy and run on a machine without AVX-512.
//
// V provides: reg, kLanes, kMaxRows, kMaxAcc, zero(), load(p), store(p, r), set1(x),
// load_w(p) (kLanes bf16 weights widened to fp32, exactly), fma(a, b, c) = a * b + c
// rounded once.
#pragma once

#include <cstdint>

namespace kvfuse::cpu {
namespace {

constexpr int64_t kTilePanel = 16;  // = kGemmPanel
constexpr int64_t kTileKc = 256;    // k block: a block of weight panels stays in L1/L2
constexpr int64_t kTileGroup = 6;   // panels per block, reused by every row tile

inline int64_t tile_min(int64_t a, int64_t b) { return a < b ? a : b; }

// A panel row of weights as fp32: bf16 widened (exactly), or already fp32.
template <class V>
typename V::reg load_weights(const uint16_t* p) {
  return V::load_w(p);
}
template <class V>
typename V::reg load_weights(const float* p) {
  return V::load(p);
}

// MR rows x NP panels of y, over kc steps of k, weights W (bf16 or widened fp32).
// `first` starts the chains at +0; otherwise they continue from y (the previous k
// block's partial sums).
template <class V, class W, int MR, int NP>
void tile(const float* a, int64_t lda, const W* b, int64_t panel_stride, int64_t kc, float* c, int64_t ldc,
          bool first) {
  constexpr int VP = int(kTilePanel / V::kLanes);  // vectors per panel
  typename V::reg acc[MR][NP * VP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * VP; ++j)
      acc[r][j] = first ? V::zero() : V::load(c + r * ldc + (j / VP) * kTilePanel + (j % VP) * V::kLanes);
  for (int64_t p = 0; p < kc; ++p) {
    typename V::reg bv[NP * VP];
    for (int j = 0; j < NP * VP; ++j)
      bv[j] = load_weights<V>(b + (j / VP) * panel_stride + p * kTilePanel + (j % VP) * V::kLanes);
    for (int r = 0; r < MR; ++r) {
      const typename V::reg av = V::set1(a[r * lda + p]);
      for (int j = 0; j < NP * VP; ++j) acc[r][j] = V::fma(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * VP; ++j)
      V::store(c + r * ldc + (j / VP) * kTilePanel + (j % VP) * V::kLanes, acc[r][j]);
}

// Panels per tile for MR rows: as many accumulators as the register file holds.
template <class V, int MR>
constexpr int panels_per_tile() {
  constexpr int per_panel = int(kTilePanel / V::kLanes) * MR;
  constexpr int np = V::kMaxAcc / per_panel;
  return np < 1 ? 1 : np > 8 ? 8 : np;
}

template <class V, class W, int MR, int NP>
void tail_panels(int64_t left, const float* a, int64_t lda, const W* b, int64_t ps, int64_t kc, float* c,
                 int64_t ldc, bool first) {
  if constexpr (NP > 0) {
    if (left == NP) return tile<V, W, MR, NP>(a, lda, b, ps, kc, c, ldc, first);
    tail_panels<V, W, MR, NP - 1>(left, a, lda, b, ps, kc, c, ldc, first);
  }
}

template <class V, class W, int MR>
void row_tile(const float* a, int64_t lda, const W* b, int64_t ps, int64_t panels, int64_t kc, float* c,
              int64_t ldc, bool first) {
  constexpr int NP = panels_per_tile<V, MR>();
  int64_t p = 0;
  for (; p + NP <= panels; p += NP)
    tile<V, W, MR, NP>(a, lda, b + p * ps, ps, kc, c + p * kTilePanel, ldc, first);
  if (p < panels)
    tail_panels<V, W, MR, NP - 1>(panels - p, a, lda, b + p * ps, ps, kc, c + p * kTilePanel, ldc, first);
}

template <class V, class W, int MR>
void rows_dispatch(int mr, const float* a, int64_t lda, const W* b, int64_t ps, int64_t panels, int64_t kc,
                   float* c, int64_t ldc, bool first) {
  if constexpr (MR > 0) {
    if (mr == MR) return row_tile<V, W, MR>(a, lda, b, ps, panels, kc, c, ldc, first);
    rows_dispatch<V, W, MR - 1>(mr, a, lda, b, ps, panels, kc, c, ldc, first);
  }
}

// Every row tile of one block: rows [0, m) against `panels` panels of kc weight rows.
template <class V, class W>
void block_rows(const float* x, int64_t m, int64_t lda, const W* b, int64_t ps, int64_t panels, int64_t kc,
                float* y, int64_t ldy, bool first) {
  for (int64_t i = 0; i < m; i += V::kMaxRows) {
    const int mr = int(tile_min(V::kMaxRows, m - i));
    rows_dispatch<V, W, V::kMaxRows>(mr, x + i * lda, lda, b, ps, panels, kc, y + i * ldy, ldy, first);
  }
}

// Row tiles per weight block above which the block is widened to fp32 once (into wbuf)
// and every tile reads fp32: the widening then costs nothing per tile. Either way the
// tiles see the same fp32 weights, so the bits do not change.
constexpr int64_t kWidenAboveTiles = 2;

// y[m, panels * 16] (row stride ldy) = x[m, k] * packed^T. wbuf, if not null, holds
// kTileGroup * kTileKc * kTilePanel floats.
template <class V>
void gemm_tiles(const float* x, int64_t m, int64_t k, const uint16_t* packed, int64_t panels, float* y,
                int64_t ldy, float* wbuf) {
  const int64_t ps = k * kTilePanel;  // weights between panels
  const bool widen = wbuf != nullptr && m > kWidenAboveTiles * V::kMaxRows;
  for (int64_t pc = 0; pc < k; pc += kTileKc) {
    const int64_t kc = tile_min(kTileKc, k - pc);
    for (int64_t jp = 0; jp < panels; jp += kTileGroup) {
      const int64_t gp = tile_min(kTileGroup, panels - jp);
      const uint16_t* block = packed + jp * ps + pc * kTilePanel;
      float* yb = y + jp * kTilePanel;
      if (!widen) {
        block_rows<V>(x + pc, m, k, block, ps, gp, kc, yb, ldy, pc == 0);
        continue;
      }
      const int64_t wps = kc * kTilePanel;  // floats between widened panels
      for (int64_t p = 0; p < gp; ++p)
        for (int64_t e = 0; e < wps; e += V::kLanes)
          V::store(wbuf + p * wps + e, V::load_w(block + p * ps + e));
      block_rows<V>(x + pc, m, k, static_cast<const float*>(wbuf), wps, gp, kc, yb, ldy, pc == 0);
    }
  }
}

}  // namespace
}  // namespace kvfuse::cpu
