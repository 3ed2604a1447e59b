// Runs one GPU block on the host, lane by lane: every thread of the block is a fiber
// (ucontext) on the calling thread, and the fibers switch only where the GPU's lanes
// meet: at a wave's cross-lane step (a shuffle, a matrix instruction) and at the block
// barrier. Between those points a lane runs alone, as plain C++, so kernel code written
// against an executor interface (kernels/attention/mfma/attention_mfma.h) runs here unchanged; the
// cross-lane steps are emulated from the lanes' registers (kernels/cpu/attention/mfma_emu.h for
// the MFMA instructions).
//
// Rules the kernel code must keep (they are the hardware's too): the lanes of a wave
// take the same cross-lane steps in the same order (MFMA and shuffles execute with the
// whole wave), and every thread still running reaches each block barrier. A block that
// breaks them deadlocks here; run() reports it instead of hanging.
#pragma once

#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/attention/mfma_emu.h"

namespace kvfuse::cpu {

class BlockEmu {
 public:
  static constexpr int kLanes = kMfmaLanes;

  explicit BlockEmu(int waves) : waves_(waves), wave_state_(size_t(waves)) {}
  BlockEmu(const BlockEmu&) = delete;
  BlockEmu& operator=(const BlockEmu&) = delete;

  // Runs body(wave, lane) for every thread of the block to completion.
  void run(const std::function<void(int wave, int lane)>& body) {
    const int n = waves_ * kLanes;
    fibers_.clear();
    fibers_.resize(size_t(n));
    body_ = &body;
    for (WaveState& ws : wave_state_) ws.arrived = 0;
    block_arrived_ = 0;
    for (int t = 0; t < n; ++t) make_fiber(t);
    int done = 0;
    while (done < n) {
      bool progressed = false;
      for (int t = 0; t < n; ++t) {
        Fiber& f = fibers_[size_t(t)];
        if (f.done || f.waiting) continue;
        current_ = t;
        swapcontext(&main_, &f.ctx);
        progressed = true;
        if (f.done) ++done;
      }
      if (!progressed && done < n) {
        throw std::runtime_error("wave_emu: block deadlocked: " + std::to_string(n - done) +
                                 " threads wait at a barrier that the others never reach");
      }
    }
    body_ = nullptr;
  }

  // ---- called from inside the fibers
  // The wave's lanes meet: returns once all 64 have arrived. The last to arrive runs
  // on_release (if any) before the others resume.
  template <class F = void (*)()>
  void wave_barrier(int wave, F&& on_release = nullptr) {
    WaveState& ws = wave_state_[size_t(wave)];
    if (++ws.arrived == kLanes) {
      if constexpr (!std::is_same_v<std::decay_t<F>, void (*)()>) on_release();
      ws.arrived = 0;
      for (int l = 0; l < kLanes; ++l) fibers_[size_t(wave * kLanes + l)].waiting = false;
      return;
    }
    park();
  }

  // Every thread still running meets.
  void block_barrier() {
    int live = 0;
    for (const Fiber& f : fibers_) live += f.done ? 0 : 1;
    if (++block_arrived_ == live) {
      block_arrived_ = 0;
      for (Fiber& f : fibers_) f.waiting = false;
      return;
    }
    park();
  }

  // Lane `lane` of `wave` offers 32 bits and gets those of lane `src`.
  uint32_t exchange(int wave, int lane, uint32_t mine, int src) {
    const int ph = phase();
    WaveState& ws = wave_state_[size_t(wave)];
    ws.word[ph][lane] = mine;
    wave_barrier(wave);
    return ws.word[ph][src];
  }

  // v_mfma_f32_16x16x32_{bf16,f16} for one lane: a, b are its operand words (two 16-bit
  // values each, the low half first), d its accumulators (C in, D out).
  void mfma_16x16x32(int wave, int lane, MfmaInput in, float (&d)[4], const uint32_t (&a)[4],
                     const uint32_t (&b)[4]) {
    using L = Mfma16x16x32Layout;
    const int ph = phase();
    WaveState& ws = wave_state_[size_t(wave)];
    for (int i = 0; i < 4; ++i) {
      ws.a[ph][lane][i] = a[i];
      ws.b[ph][lane][i] = b[i];
    }
    // The last lane to arrive lays the operands out as matrices (kernels/attention/mfma/mfma_layout.h);
    // each lane then sums its own accumulators in k order onto C, as
    // mfma_16x16_emulate does.
    wave_barrier(wave, [&] {
      for (int l = 0; l < kLanes; ++l) {
        for (int e = 0; e < L::kOperandElems; ++e) {
          const MfmaElem ea = L::a(l, e), eb = L::b(l, e);
          const int sh = 16 * (e % 2);
          ws.ma[ph][ea.row][ea.col] = mfma_operand_to_f32(in, uint16_t(ws.a[ph][l][e / 2] >> sh));
          ws.mb[ph][eb.col][eb.row] = mfma_operand_to_f32(in, uint16_t(ws.b[ph][l][e / 2] >> sh));
        }
      }
    });
    for (int i = 0; i < 4; ++i) {
      const MfmaElem e = L::d(lane, i);
      const std::array<float, L::kK>& row = ws.ma[ph][e.row];
      const std::array<float, L::kK>& col = ws.mb[ph][e.col];
      float acc = d[i];
      for (int k = 0; k < L::kK; ++k) acc += row[k] * col[k];
      d[i] = acc;
    }
  }

 private:
  static constexpr size_t kStackBytes = 256 * 1024;

  struct Fiber {
    ucontext_t ctx{};
    bool done = false;
    bool waiting = false;
    uint32_t collectives = 0;  // cross-lane steps taken: picks the slot buffer
  };
  // Two buffers per kind, alternating by step: a lane writes step n + 2's buffer only
  // after the barrier of step n + 1, which every lane passes after reading step n's.
  struct WaveState {
    int arrived = 0;
    std::array<std::array<uint32_t, kLanes>, 2> word{};
    std::array<std::array<std::array<uint32_t, 4>, kLanes>, 2> a{}, b{};
    // The operands as matrices: A[row][k] and B^T[col][k], fp32.
    std::array<std::array<std::array<float, 32>, 16>, 2> ma{}, mb{};
  };

  // getcontext returns twice; kept out of run() so that run's locals need no care
  // (-Wclobbered).
  [[gnu::noinline]] void make_fiber(int t) {
    Fiber& f = fibers_[size_t(t)];
    if (stacks_.size() <= size_t(t)) stacks_.push_back(std::make_unique<char[]>(kStackBytes));
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks_[size_t(t)].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &main_;
    // makecontext passes ints: the emulator's address in two halves, and the thread.
    const uint64_t self = uint64_t(reinterpret_cast<uintptr_t>(this));
    makecontext(&f.ctx, reinterpret_cast<void (*)()>(&BlockEmu::entry), 3, int(uint32_t(self)),
                int(uint32_t(self >> 32)), t);
  }

  static void entry(int lo, int hi, int t) {
    auto* self = reinterpret_cast<BlockEmu*>(uintptr_t(uint32_t(lo)) | (uintptr_t(uint32_t(hi)) << 32));
    (*self->body_)(t / kLanes, t % kLanes);
    self->fibers_[size_t(t)].done = true;  // uc_link returns to the scheduler
  }

  int phase() { return int(fibers_[size_t(current_)].collectives++ & 1u); }

  void park() {
    Fiber& f = fibers_[size_t(current_)];
    f.waiting = true;
    swapcontext(&f.ctx, &main_);
  }

  int waves_;
  std::vector<WaveState> wave_state_;
  std::vector<Fiber> fibers_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  ucontext_t main_{};
  const std::function<void(int, int)>* body_ = nullptr;
  int current_ = 0;
  int block_arrived_ = 0;
};

}  // namespace kvfuse::cpu
