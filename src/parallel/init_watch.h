// What bounds the NCCL/RCCL set-up of one process's ranks (nccl::InitWatch for each): the
// group's deadline (tp_rendezvous_timeout_s), a rank of this process that failed (its
// error stops the others' wait, which would otherwise last for ever), and, in a process
// group, another process whose control connection closed (it failed or was killed).
// Plain C++: the NCCL set-up's poll loop runs it (src/parallel/nccl_api.h).
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/parallel/nccl_api.h"

namespace kvfuse {

class GroupInitWatch {
 public:
  // A connection to watch: `fd` stays owned by the caller and open while the watch is used.
  struct Peer {
    int fd = -1;
    std::string what;  // names it in errors: "rank 1's process" or "rank 0's process (host:port)"
  };
  GroupInitWatch(std::chrono::milliseconds timeout, std::vector<Peer> peers);

  // The watch for local rank `rank`'s set-up: not OK once another rank recorded a failure,
  // or a peer's connection closed.
  nccl::InitWatch for_rank(int rank);
  // Records `rank`'s failure `st` (the first one is kept) for the others to see, and
  // returns `st` (OK: nothing is recorded).
  absl::Status failed(int rank, absl::Status st);
  // OK, or the first failure or closed connection seen, as for_rank's check words it.
  absl::Status check(int asking_rank);

 private:
  const std::chrono::steady_clock::time_point deadline_;
  const std::vector<Peer> peers_;
  std::mutex mu_;
  int failed_rank_ = -1;
  absl::Status failure_;
};

}  // namespace kvfuse
