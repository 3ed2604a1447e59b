// One MFMA instruction run once on given lane registers: the device half of the MFMA
// parity test (tests/gpu/test_mfma_gpu.cu compares it with kernels/cpu/attention/mfma_emu.h) and
// the kernels whose machine code scripts/ci/hip-kernel-report.py checks for v_mfma
// instructions on gfx942 and gfx950. AMD (HIP) only: on CUDA the launcher refuses.
#pragma once

#include <cstdint>

#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

enum class MfmaInstr {
  bf16_16x16x16,  // v_mfma_f32_16x16x16_bf16
  f16_16x16x16,   // v_mfma_f32_16x16x16_f16
  bf16_16x16x32,  // v_mfma_f32_16x16x32_bf16 (gfx950; two 16x16x16 on gfx942)
  f16_16x16x32,   // v_mfma_f32_16x16x32_f16 (gfx950; two 16x16x16 on gfx942)
};

// K of the instruction (16 or 32).
constexpr int mfma_instr_k(MfmaInstr i) {
  return i == MfmaInstr::bf16_16x16x32 || i == MfmaInstr::f16_16x16x32 ? 32 : 16;
}

// One wavefront of 64 lanes runs `instr` once. Device arrays, lane-major, in the
// order of kernels/cpu/attention/mfma_emu.h's MfmaOperandRegs / MfmaAccRegs: a and b hold
// 64 * K/4 bit patterns (lane l's element i at l * K/4 + i), c and d 64 * 4 floats.
// d may alias c. Refused (cudaErrorInvalidValue) on CUDA.
LaunchStatus launch_mfma_probe(MfmaInstr instr, const uint16_t* a, const uint16_t* b, const float* c,
                               float* d, cudaStream_t stream);

}  // namespace kvfuse::gpu
