// Where the operands and results of AMD's 16x16 MFMA instructions live in a wavefront:
// for lane l and element i of its operand or accumulator vector, which element of the
// matrix it holds. One place, used by the device wrappers' callers (kernels/attention/mfma/mfma.cuh)
// and by the host emulator (kernels/cpu/attention/mfma_emu.h), so the two cannot disagree.
//
// D = A * B + C, A 16 x K, B K x 16, C and D 16 x 16 fp32, one wavefront of 64 lanes
// (these are CDNA instructions: the lane count is the instruction's, not kWarpSize's).
// An operand vector holds K/4 16-bit values per lane (bf16 or f16 bit patterns), element
// i in bits [16*(i%2)+15 : 16*(i%2)] of the lane's (i/2)-th operand VGPR; an accumulator
// vector holds 4 fp32 values, element i in the lane's i-th accumulator VGPR.
//
//   v_mfma_f32_16x16x16_{bf16,f16}  gfx942 (CDNA3) and gfx950 (CDNA4), K = 16:
//     A[l % 16][4 * (l / 16) + i]   i = 0..3
//     B[4 * (l / 16) + i][l % 16]   i = 0..3
//     D[4 * (l / 16) + i][l % 16]   i = 0..3 (C alike)
//   Source: AMD's matrix instruction calculator (github ROCm/amd_matrix_instruction_calculator
//   at 2ef9189, `matrix_calculator.py -a CDNA3 -i v_mfma_f32_16x16x16_bf16 -d`, same for
//   _f16): "A i: (lane % 16), A k: 4 * floor(lane / 16) + 2 * GPR_num + floor(GPR_bits /
//   16)", B alike with j for i, "C or D i: 4 * floor(lane / 16) + (GPR_num % 4), j: (lane %
//   16)". Its full --register-layout tables for A, B and D are in tests/data/mfma/ and
//   tests/kernels/test_mfma_layout.cc checks these functions against every entry.
//
//   v_mfma_f32_16x16x32_{bf16,f16}  gfx950 (CDNA4) only, K = 32:
//     A[l % 16][8 * (l / 16) + i]   i = 0..7
//     B[8 * (l / 16) + i][l % 16]   i = 0..7
//     D as for K = 16
//   The calculator at 2ef9189 has no CDNA4 (its issue #7), so this one is inferred, not
//   read off AMD's table: composable_kernel's xdlops_gemm.hpp describes
//   mfma_f32_16x16x32bf16 (and _f16) as 4 input blocks of 16 lanes with k_per_blk = 8,
//   exactly its description of CDNA3's v_mfma_f32_16x16x32_fp8_fp8, whose calculator
//   layout is "A k: 8 * floor(lane / 16) + 4 * GPR_num + floor(GPR_bits / 8)" (8 fp8 per
//   lane); Triton's gfx950 16x16x32 dot operands use kWidth = 8 (8 consecutive k per lane).
//   Not yet run on a gfx950: the first AMD run of tests/gpu/test_mfma_gpu confirms it.
//
// What a wrong k order would and would not break: D sums over k, so any relabelling of k
// applied to A and B alike leaves D unchanged. The instruction itself cannot tell the
// k orders apart; what must hold is that A's and B's agree and that rows and columns are
// right. This is also why 16x16x32 equals two 16x16x16 on the halves of each lane's
// vector (elements 0-3, then 4-7): each half is a 16x16x16 over its own 16 k's
// (kernels/attention/mfma/mfma.cuh uses it on gfx942, tests/kernels/test_mfma_layout.cc checks it).
#pragma once

#include "kernels/common/host_device.h"

namespace kvfuse {

// Lanes of the wavefront that executes one MFMA: 64 on every CDNA target.
constexpr int kMfmaLanes = 64;

struct MfmaElem {  // an element of a matrix
  int row;
  int col;
};

struct MfmaSlot {  // where a lane holds it: lane, element of the lane's vector
  int lane;
  int elem;
};

// The 16x16xK instructions, K = 16 or 32.
template <int K>
struct Mfma16x16Layout {
  static_assert(K == 16 || K == 32, "16x16x16 (gfx942, gfx950) or 16x16x32 (gfx950)");
  static constexpr int kM = 16;
  static constexpr int kN = 16;
  static constexpr int kK = K;
  // 16-bit operand values per lane (A and B alike) and fp32 accumulators per lane.
  static constexpr int kOperandElems = kM * K / kMfmaLanes;  // 4 or 8
  static constexpr int kAccElems = kM * kN / kMfmaLanes;     // 4
  // Lanes l, l + 16, l + 32, l + 48 share a row of A (a column of B, D).
  static constexpr int kLaneGroups = kMfmaLanes / kM;  // 4

  // (lane, elem) -> the element of A (row, k), B (k, col), C/D (row, col) it holds.
  static KVFUSE_HD constexpr MfmaElem a(int lane, int elem) {
    return {lane % kM, kOperandElems * (lane / kM) + elem};
  }
  static KVFUSE_HD constexpr MfmaElem b(int lane, int elem) {
    return {kOperandElems * (lane / kN) + elem, lane % kN};
  }
  static KVFUSE_HD constexpr MfmaElem d(int lane, int elem) {
    return {kAccElems * (lane / kN) + elem, lane % kN};
  }

  // The inverses: which lane and element hold A[row][k], B[k][col], C/D[row][col].
  static KVFUSE_HD constexpr MfmaSlot a_slot(int row, int k) {
    return {kM * (k / kOperandElems) + row, k % kOperandElems};
  }
  static KVFUSE_HD constexpr MfmaSlot b_slot(int k, int col) {
    return {kN * (k / kOperandElems) + col, k % kOperandElems};
  }
  static KVFUSE_HD constexpr MfmaSlot d_slot(int row, int col) {
    return {kN * (row / kAccElems) + col, row % kAccElems};
  }
};

using Mfma16x16x16Layout = Mfma16x16Layout<16>;
using Mfma16x16x32Layout = Mfma16x16Layout<32>;

// Spot checks at compile time (the tests check every entry against AMD's tables).
static_assert(Mfma16x16x16Layout::a(16, 1).row == 0 && Mfma16x16x16Layout::a(16, 1).col == 5,
              "calculator: A[0][5] is v0{16}.[31:16]");
static_assert(Mfma16x16x16Layout::d(63, 3).row == 15 && Mfma16x16x16Layout::d(63, 3).col == 15,
              "calculator: D[15][15] is v3{63}");
static_assert(Mfma16x16x32Layout::b(17, 7).row == 15 && Mfma16x16x32Layout::b(17, 7).col == 1,
              "16x16x32: lane 17 holds B[8..15][1]");

}  // namespace kvfuse
