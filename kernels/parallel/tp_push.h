// The producer side of the tensor-parallel reduction that is fused into the next RMSNorm
// (src/parallel/peer_allreduce.h, "Pushed partial sums"): a row-parallel projection stores
// its bf16 partial sums into every peer's inbox as well as into its own output, and the
// peer's norm kernel sums them. Plain data, no vendor types: the backend, the communicator
// and the kernels share it.
#pragma once

#include <cstdint>

namespace kvfuse {

// Where a projection also stores its [m, n] bf16 result: `count` peer buffers of the same
// layout (device pointers another GPU of the process maps, or the same GPU's). count 0:
// none (the launch then behaves as the plain projection).
struct PushTargets {
  static constexpr int kMax = 7;  // peers of a group of up to 8 ranks
  uint16_t* dst[kMax] = {};
  int count = 0;
};

// An inbox element no peer has written yet. The inboxes are filled with it, and a reader
// resets each element to it once consumed. The producer never stores it: a result with these
// bits (a NaN with every payload bit set, which no arithmetic makes) is pushed as the
// canonical quiet NaN kPushNaN instead, still a NaN (push_bits, kernels/parallel/tp_push.cuh).
constexpr uint16_t kPushEmpty = 0xffffu;
constexpr uint16_t kPushNaN = 0x7fffu;

}  // namespace kvfuse
