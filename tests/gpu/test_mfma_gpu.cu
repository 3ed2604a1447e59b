// The MFMA instructions on an AMD GPU (kernels/attention/mfma/mfma_probe.cu, through kernels/attention/mfma/mfma.cuh's
// wrappers) against the host emulator (kernels/cpu/attention/mfma_emu.h), lane register by lane
// register: the hardware check of the lane layouts in kernels/attention/mfma/mfma_layout.h.
// - integer-valued operands and accumulators, whose every partial sum is exact in any
//   order: the accumulators must be equal, bit for bit;
// - random bf16 / f16 operands and fp32 accumulators: within twice mfma_sum_error_bound
//   (AMD leaves the order of the fp32 additions open; emulator and hardware are each
//   within the bound of the exact value).
// On CUDA, and without a GPU, it skips: MFMA is a CDNA instruction. The layouts and the
// emulator are also tested on the CPU (tests/kernels/test_mfma_layout.cc).
#include "kernels/common/gpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "kernels/common/bf16.h"
#include "kernels/cpu/attention/mfma_emu.h"
#include "kernels/attention/mfma/mfma_probe.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using cpu::MfmaAccRegs;
using cpu::MfmaInput;
using cpu::MfmaOperandRegs;
using gpu::MfmaInstr;
using gpu_test::check;

const char* instr_name(MfmaInstr i) {
  switch (i) {
    case MfmaInstr::bf16_16x16x16:
      return "v_mfma_f32_16x16x16_bf16";
    case MfmaInstr::f16_16x16x16:
      return "v_mfma_f32_16x16x16_f16";
    case MfmaInstr::bf16_16x16x32:
      return "v_mfma_f32_16x16x32_bf16";
    case MfmaInstr::f16_16x16x32:
      return "v_mfma_f32_16x16x32_f16";
  }
  return "?";
}

uint16_t to_bits(MfmaInput in, float x) { return in == MfmaInput::bf16 ? f32_to_bf16(x) : f32_to_f16(x); }

// The device's accumulators for one run of `instr` on the given lane registers.
template <int K>
MfmaAccRegs run_device(MfmaInstr instr, const MfmaOperandRegs<K>& a, const MfmaOperandRegs<K>& b,
                       const MfmaAccRegs& c) {
  gpu_test::DeviceMem da(sizeof a), db(sizeof b), dc(sizeof c), dd(sizeof c);
  da.upload(a.data(), sizeof a);
  db.upload(b.data(), sizeof b);
  dc.upload(c.data(), sizeof c);
  const gpu::LaunchStatus st = gpu::launch_mfma_probe(instr, da.get<uint16_t>(), db.get<uint16_t>(),
                                                      dc.get<float>(), dd.get<float>(), nullptr);
  KVFUSE_TEST_GPU(st.code());
  KVFUSE_TEST_GPU(cudaDeviceSynchronize());
  const std::vector<float> flat = dd.download<float>(kMfmaLanes * 4);
  MfmaAccRegs d{};
  std::memcpy(d.data(), flat.data(), sizeof d);
  return d;
}

template <int K>
void test_instr(MfmaInstr instr, MfmaInput in, std::mt19937& rng) {
  const std::string name = instr_name(instr);
  for (int trial = 0; trial < 8; ++trial) {
    const bool integers = trial < 4;
    std::uniform_int_distribution<int> small(-8, 8);
    std::uniform_real_distribution<float> real(-2.0f, 2.0f);
    MfmaOperandRegs<K> a{}, b{};
    MfmaAccRegs c{};
    for (int l = 0; l < kMfmaLanes; ++l) {
      for (int i = 0; i < K / 4; ++i) {
        a[l][i] = to_bits(in, integers ? float(small(rng)) : real(rng));
        b[l][i] = to_bits(in, integers ? float(small(rng)) : real(rng));
      }
      for (int i = 0; i < 4; ++i) c[l][i] = integers ? float(small(rng) * 64) : real(rng);
    }
    const MfmaAccRegs want = cpu::mfma_16x16_emulate<K>(in, a, b, c);
    const MfmaAccRegs got = run_device<K>(instr, a, b, c);
    int bad = 0;
    for (int l = 0; l < kMfmaLanes; ++l) {
      for (int i = 0; i < 4; ++i) {
        // |C| + sum |A * B| of this element, for the tolerance.
        const MfmaElem e = Mfma16x16Layout<K>::d(l, i);
        double abs_terms = std::fabs(c[l][i]);
        for (int k = 0; k < K; ++k) {
          const MfmaSlot sa = Mfma16x16Layout<K>::a_slot(e.row, k);
          const MfmaSlot sb = Mfma16x16Layout<K>::b_slot(k, e.col);
          abs_terms += std::fabs(double(cpu::mfma_operand_to_f32(in, a[sa.lane][sa.elem])) *
                                 cpu::mfma_operand_to_f32(in, b[sb.lane][sb.elem]));
        }
        const double tol = integers ? 0.0 : 2 * cpu::mfma_sum_error_bound(K, abs_terms);
        if (!(std::fabs(double(got[l][i]) - want[l][i]) <= tol) && bad++ < 4) {
          std::printf("  %s lane %d acc %d (D[%d][%d]): device %.9g, emulator %.9g, tolerance %.3g\n",
                      name.c_str(), l, i, e.row, e.col, got[l][i], want[l][i], tol);
        }
      }
    }
    check(bad == 0, name + (integers ? " integer" : " random") + " trial " + std::to_string(trial) + ": " +
                        std::to_string(bad) + " accumulators differ");
  }
}

}  // namespace

int main() {
  if (std::strcmp(KVFUSE_GPU_VENDOR, "hip") != 0) {
    std::printf("SKIP test_mfma_gpu: MFMA is an AMD CDNA instruction (this is a %s build)\n",
                KVFUSE_GPU_VENDOR);
    return 0;
  }
  if (gpu_test::gpu_available("test_mfma_gpu")) {
    std::mt19937 rng(20250601);
    test_instr<16>(MfmaInstr::bf16_16x16x16, MfmaInput::bf16, rng);
    test_instr<16>(MfmaInstr::f16_16x16x16, MfmaInput::f16, rng);
    test_instr<32>(MfmaInstr::bf16_16x16x32, MfmaInput::bf16, rng);
    test_instr<32>(MfmaInstr::f16_16x16x32, MfmaInput::f16, rng);
  }
  return gpu_test::tally().report("test_mfma_gpu");
}
