// Host emulator of AMD's 16x16 MFMA instructions (v_mfma_f32_16x16x16_{bf16,f16},
// v_mfma_f32_16x16x32_{bf16,f16}) at the level of lane registers: given the 64 lanes'
// operand and accumulator vectors, what the instruction leaves in each lane's
// accumulators. Plain C++, no HIP: the CPU tests check the layouts with it, and a GPU
// parity test compares the hardware (kernels/attention/mfma/mfma_probe.cu) with it.
//
// Numerics assumed (what AMD documents, and what it leaves open):
// - Operands are bf16 or f16 bit patterns, widened exactly to fp32. A product of two
//   of them is exact in fp32 (at most 11 + 11 significant bits) unless it overflows
//   or underflows fp32 (bf16 has fp32's exponent range; f16 products cannot). Because
//   products are exact, fma(a, b, acc) and acc + a * b round alike.
// - D[r][c] = C[r][c] + sum over k of A[r][k] * B[k][c], accumulated in fp32. AMD does
//   not specify the order (or the grouping) of the fp32 additions within one
//   instruction. The emulator adds in k order onto C, rounding each addition to nearest
//   even. So results agree with the hardware exactly only where every partial sum is
//   exact in any order (small integers, tests/kernels/test_mfma_layout.cc), and otherwise
//   within mfma_sum_error_bound below.
// - Not modelled: denormal flushing (the MODE register), NaN payloads, the instructions'
//   CBSZ/ABID/BLGP broadcast and negation modifiers (kvfuse's wrappers pass 0).
#pragma once

#include <array>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/attention/mfma/mfma_layout.h"

namespace kvfuse::cpu {

enum class MfmaInput { bf16, f16 };

template <int K>
using MfmaOperandRegs = std::array<std::array<uint16_t, Mfma16x16Layout<K>::kOperandElems>, kMfmaLanes>;
using MfmaAccRegs = std::array<std::array<float, Mfma16x16Layout<16>::kAccElems>, kMfmaLanes>;
template <int K>
using MfmaAMatrix = std::array<std::array<uint16_t, K>, 16>;  // A[row][k], bit patterns
template <int K>
using MfmaBMatrix = std::array<std::array<uint16_t, 16>, K>;  // B[k][col], bit patterns
using MfmaCMatrix = std::array<std::array<float, 16>, 16>;    // C, D [row][col]

inline float mfma_operand_to_f32(MfmaInput in, uint16_t bits) {
  return in == MfmaInput::bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
}

// What one v_mfma_f32_16x16xK instruction leaves in the accumulators, lane by lane.
template <int K>
MfmaAccRegs mfma_16x16_emulate(MfmaInput in, const MfmaOperandRegs<K>& a, const MfmaOperandRegs<K>& b,
                               const MfmaAccRegs& c) {
  using L = Mfma16x16Layout<K>;
  MfmaAccRegs d{};
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < L::kAccElems; ++i) {
      const MfmaElem e = L::d(lane, i);
      float acc = c[lane][i];
      for (int k = 0; k < K; ++k) {
        const MfmaSlot sa = L::a_slot(e.row, k);
        const MfmaSlot sb = L::b_slot(k, e.col);
        acc += mfma_operand_to_f32(in, a[sa.lane][sa.elem]) * mfma_operand_to_f32(in, b[sb.lane][sb.elem]);
      }
      d[lane][i] = acc;
    }
  }
  return d;
}

// Matrices to lane registers and back, as the instruction lays them out.
template <int K>
MfmaOperandRegs<K> mfma_distribute_a(const MfmaAMatrix<K>& m) {
  MfmaOperandRegs<K> r{};
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < Mfma16x16Layout<K>::kOperandElems; ++i) {
      const MfmaElem e = Mfma16x16Layout<K>::a(lane, i);
      r[lane][i] = m[e.row][e.col];
    }
  }
  return r;
}

template <int K>
MfmaOperandRegs<K> mfma_distribute_b(const MfmaBMatrix<K>& m) {
  MfmaOperandRegs<K> r{};
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < Mfma16x16Layout<K>::kOperandElems; ++i) {
      const MfmaElem e = Mfma16x16Layout<K>::b(lane, i);
      r[lane][i] = m[e.row][e.col];
    }
  }
  return r;
}

inline MfmaAccRegs mfma_distribute_acc(const MfmaCMatrix& m) {
  MfmaAccRegs r{};
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < Mfma16x16x16Layout::kAccElems; ++i) {
      const MfmaElem e = Mfma16x16x16Layout::d(lane, i);
      r[lane][i] = m[e.row][e.col];
    }
  }
  return r;
}

inline MfmaCMatrix mfma_gather_acc(const MfmaAccRegs& r) {
  MfmaCMatrix m{};
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < Mfma16x16x16Layout::kAccElems; ++i) {
      const MfmaElem e = Mfma16x16x16Layout::d(lane, i);
      m[e.row][e.col] = r[lane][i];
    }
  }
  return m;
}

// How far a D element computed in fp32 in an unspecified order may be from the exact
// value C + sum(A * B): n = K additions, each rounding with relative error at most u,
// give at most gamma(n) * (|C| + sum |A * B|), gamma(n) = n u / (1 - n u) (Higham,
// Accuracy and Stability of Numerical Algorithms, 2nd ed., (4.4)), whatever the order.
// u = 2^-23 also covers rounding toward zero, in case the hardware truncates partial
// sums; round to nearest alone would give 2^-24. `abs_terms` is |C| + sum |A * B|. Two
// implementations (the emulator and the hardware) may be twice this apart.
inline double mfma_sum_error_bound(int k, double abs_terms) {
  const double nu = double(k) * 0x1p-23;
  return nu / (1.0 - nu) * abs_terms;
}

}  // namespace kvfuse::cpu
