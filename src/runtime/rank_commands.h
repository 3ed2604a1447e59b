// What rank 0 (the leader) sends to the ranks held by other processes (followers) when a
// tensor-parallel group spans processes: one command per operation that makes the ranks
// work, sent before the leader runs its own part so that every rank runs it at once and
// they meet in the collectives. The followers answer only when they fail.
//
// Frame (over the connection the rendezvous left open; header integers big-endian):
//   "KVFUSECM" u32 version u32 command u64 length, payload
// Payloads hold host-order integers and floats: every process of a group runs the same
// kvfuse build on the same kind of machine (the rendezvous checks the version).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/parallel/socket_io.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/model_runner.h"

namespace kvfuse {

enum class RankCommand : uint32_t {
  forward = 1,          // leader -> follower: a step's ForwardBatch, its ForwardOptions, SWA table changes
  collectives = 2,      // leader -> follower: Engine::collectives_ms(tokens, reps)
  shutdown = 3,         // leader -> follower: the engine is going away; exit cleanly
  error = 4,            // follower -> leader: the follower failed (its message); it aborts and exits
  end_gemm_tuning = 5,  // leader -> follower: Engine::end_gemm_tuning (no payload)
};
const char* to_string(RankCommand c);

struct RankMessage {
  RankCommand command = RankCommand::shutdown;
  std::vector<uint8_t> payload;
};

// The whole frame of a command: header and payload, ready to send to every follower.
std::vector<uint8_t> rank_frame(RankCommand command, const std::vector<uint8_t>& payload);
// Sends a frame; UNAVAILABLE starting with `what` when the peer is gone or the deadline passes.
absl::Status send_rank_frame(int fd, const std::vector<uint8_t>& frame, net::Clock::time_point deadline,
                             const std::string& what);
// The largest payload a frame may carry (a forward pass of the largest batch fits).
inline constexpr uint64_t kMaxRankPayloadBytes = uint64_t(1) << 31;
// Reads one frame. UNAVAILABLE (starting with `what`) when the peer closed the connection,
// DEADLINE_EXCEEDED at the deadline, DATA_LOSS for a frame that is not one or whose
// payload is over `max_payload` bytes (checked before any of it is read).
absl::StatusOr<RankMessage> recv_rank_frame(int fd, net::Clock::time_point deadline, const std::string& what,
                                            uint64_t max_payload = kMaxRankPayloadBytes);

// Payloads.
std::vector<uint8_t> encode_forward(const ForwardBatch& batch, const ForwardOptions& opts,
                                    const std::vector<SwaPageMapping>& swa_changes);
absl::Status decode_forward(const std::vector<uint8_t>& payload, ForwardBatch& batch, ForwardOptions& opts,
                            std::vector<SwaPageMapping>& swa_changes);
std::vector<uint8_t> encode_collectives(int32_t tokens, int32_t reps);
absl::Status decode_collectives(const std::vector<uint8_t>& payload, int32_t& tokens, int32_t& reps);

}  // namespace kvfuse
