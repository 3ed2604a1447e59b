// The MFMA probe kernels (kernels/attention/mfma/mfma_probe.cuh): each loads one lane's operand and
// accumulator vectors, runs one wrapper of kernels/attention/mfma/mfma.cuh, stores the accumulators.
#include "kernels/attention/mfma/mfma_probe.cuh"

#include <string>
#include <type_traits>

#include "kernels/attention/mfma/mfma.cuh"

namespace kvfuse::gpu {

#if defined(__HIP__)
namespace {

template <MfmaInstr I>
__global__ void KVFUSE_LAUNCH_BOUNDS(kMfmaLanes, 1)
    mfma_probe_kernel(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  using Operand = std::conditional_t<mfma_instr_k(I) == 16, MfmaOperand4, MfmaOperand8>;
  constexpr int kElems = mfma_instr_k(I) / 4;
  const int lane = int(threadIdx.x);
  const Operand va = *reinterpret_cast<const Operand*>(a + lane * kElems);
  const Operand vb = *reinterpret_cast<const Operand*>(b + lane * kElems);
  MfmaAcc4 acc = *reinterpret_cast<const MfmaAcc4*>(c + lane * 4);
  if constexpr (I == MfmaInstr::bf16_16x16x16) acc = mfma_16x16x16_bf16(va, vb, acc);
  if constexpr (I == MfmaInstr::f16_16x16x16) acc = mfma_16x16x16_f16(va, vb, acc);
  if constexpr (I == MfmaInstr::bf16_16x16x32) acc = mfma_16x16x32_bf16(va, vb, acc);
  if constexpr (I == MfmaInstr::f16_16x16x32) acc = mfma_16x16x32_f16(va, vb, acc);
  *reinterpret_cast<MfmaAcc4*>(d + lane * 4) = acc;
}

template <MfmaInstr I>
cudaError_t launch(const uint16_t* a, const uint16_t* b, const float* c, float* d, cudaStream_t stream) {
  return launch_kernel(mfma_probe_kernel<I>, 1, kMfmaLanes, stream, false, a, b, c, d);
}

}  // namespace
#endif

LaunchStatus launch_mfma_probe(MfmaInstr instr, const uint16_t* a, const uint16_t* b, const float* c,
                               float* d, cudaStream_t stream) {
#if defined(__HIP__)
  // The vector loads need the vectors' alignment: 8 or 16 bytes per lane.
  const uintptr_t align = uintptr_t(mfma_instr_k(instr) / 2);
  if (!is_aligned(a, align) || !is_aligned(b, align) || !is_aligned(c, 16) || !is_aligned(d, 16)) {
    return LaunchStatus::refused("MFMA probe: operands need " + std::to_string(align) +
                                 "-byte and accumulators 16-byte alignment");
  }
  switch (instr) {
    case MfmaInstr::bf16_16x16x16:
      return launch<MfmaInstr::bf16_16x16x16>(a, b, c, d, stream);
    case MfmaInstr::f16_16x16x16:
      return launch<MfmaInstr::f16_16x16x16>(a, b, c, d, stream);
    case MfmaInstr::bf16_16x16x32:
      return launch<MfmaInstr::bf16_16x16x32>(a, b, c, d, stream);
    case MfmaInstr::f16_16x16x32:
      return launch<MfmaInstr::f16_16x16x32>(a, b, c, d, stream);
  }
  return LaunchStatus::refused("MFMA probe: unknown instruction " + std::to_string(int(instr)));
#else
  (void)instr, (void)a, (void)b, (void)c, (void)d, (void)stream;
  return LaunchStatus::refused("MFMA probe: MFMA is an AMD CDNA instruction; this is a " KVFUSE_GPU_VENDOR
                               " build");
#endif
}

}  // namespace kvfuse::gpu
