// The all-reduce over peer memory on the device (kernels/parallel/peer_allreduce.cu): the
// group's limits, the host memory its kernels signal through, and the kernels' arguments.
// The protocol, why it is safe, and the group that fills these in: src/parallel/peer_allreduce.h.
// Plain data, no vendor types: the communicator (host) and the kernels share it.
#pragma once

#include <cstdint>

namespace kvfuse {

inline constexpr int kPeerMaxRanks = 8;
inline constexpr int kPeerMaxBlocks = 64;      // the largest grid of an all-reduce call
inline constexpr int kPeerBlockThreads = 512;  // threads per block of an all-reduce call
inline constexpr int64_t kPeerVecBytes = 16;   // a thread's load and store
// A block moves kPeerBlockThreads 16-byte vectors per pass: a call's grid gets one block per
// pass of the message, up to kPeerMaxBlocks (2 MiB then takes 4 passes per block).
inline constexpr int64_t kPeerPassBytes = kPeerBlockThreads * kPeerVecBytes;

// The mapped host memory every rank's kernel reads and writes.
struct PeerHostSignals {
  uint64_t abort;  // 0; 1 after the group's abort(); 2 after a kernel's timeout
  struct Timeout {
    uint64_t timed_out;  // 1 once a block of this rank gave up
    uint64_t peer;       // the rank it waited for
    uint64_t call;       // its call number
  } timeouts[kPeerMaxRanks];
};

// One all-reduce call of one rank, by value (graph replays reuse it; the counters it points
// to advance on the device). Block b owns elements [b * chunk, (b + 1) * chunk).
struct PeerAllReduceArgs {
  void* buf;      // the rank's input, overwritten with the sum
  int64_t count;  // elements
  int64_t chunk;  // elements per block, whole 16-byte vectors; the last block may get fewer
  const void* staging[kPeerMaxRanks][2];  // [rank][parity]
  uint64_t* flags[kPeerMaxRanks];         // every rank's [kPeerMaxBlocks][kPeerMaxRanks]
  uint64_t* calls;                        // this rank's call count, a copy per block index
  PeerHostSignals* host;
  uint64_t timeout_ticks;  // of the device's wall clock
  int rank;
  int ranks;
  bool vectors;  // buf is 16-byte aligned
};

// One pushed call's norm on one rank: every rank's bf16 partial summed, then add_rmsnorm.
struct PeerPushNormArgs {
  const uint16_t* partial;  // this rank's [rows, cols]
  uint16_t* x;
  const uint16_t* w;
  uint16_t* out;
  uint16_t* inbox[kPeerMaxRanks];  // this rank's inbox at the call's slot, by source rank (its own unused)
  int64_t rows;
  int64_t cols;
  float eps;
  PeerHostSignals* host;
  uint64_t timeout_ticks;
  int rank;
  int ranks;
  int call;
  bool early_dependents;  // let the next kernel launch before the peers' partials are in
};

}  // namespace kvfuse
