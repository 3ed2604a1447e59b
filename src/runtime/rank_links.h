// The control connections of a tensor-parallel group that spans processes, one per
// follower, left open by the rendezvous (src/parallel/rendezvous.h).
//
// FollowerLinks is the leader's side: it sends each command to every follower, and a
// monitor thread watches the connections without any cost to a step: a follower sends
// only when it fails (its error) and a follower that dies closes its connection; either
// way the monitor records the failure and calls `on_failure` at once (the engine aborts
// its communicator there, so that a collective waiting on the dead rank returns).
//
// LeaderLink is a follower's side: it reads the leader's commands, reports a failure,
// and a watcher calls `on_hangup` as soon as the leader's connection closes (so that a
// follower waiting in a collective on a leader that died does not wait forever).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "src/parallel/socket_io.h"
#include "src/runtime/rank_commands.h"

namespace kvfuse {

// A pipe whose write end wakes a poll() on its read end: stops a watcher thread.
class WakePipe {
 public:
  WakePipe();
  void wake();
  int fd() const { return read_.get(); }

 private:
  net::UniqueFd read_, write_;
};

class FollowerLinks {
 public:
  // `fds[r]` is rank r's connection (element 0, the leader's own rank, is empty).
  FollowerLinks(std::vector<net::UniqueFd> fds, std::chrono::milliseconds send_timeout,
                std::function<void()> on_failure);
  ~FollowerLinks();  // stops the monitor; sends nothing (see shutdown)

  // Sends one frame (rank_frame) to every follower that is still connected. UNAVAILABLE
  // naming the first rank it could not reach.
  absl::Status post(const std::vector<uint8_t>& frame);
  // OK, or the first failure: a follower's reported error, or its closed connection.
  absl::Status failure() const;
  // failure(), waiting up to `wait` for one to arrive (a follower's report may trail the
  // collective error it caused on the leader).
  absl::Status wait_failure(std::chrono::milliseconds wait) const;
  // Stops the monitor and sends every follower the shutdown command: they exit cleanly.
  void shutdown();

 private:
  void monitor();
  void record(absl::Status st);
  void stop_monitor();

  std::vector<net::UniqueFd> fds_;
  const std::chrono::milliseconds send_timeout_;
  std::function<void()> on_failure_;
  WakePipe wake_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  absl::Status failure_;
  std::atomic<bool> failed_{false};
  std::vector<bool> closed_;  // per rank: its connection ended (read by the monitor only)
  std::thread thread_;
};

class LeaderLink {
 public:
  LeaderLink(net::UniqueFd fd, std::string leader, std::function<void()> on_hangup);
  ~LeaderLink();

  // The next command; UNAVAILABLE naming the leader when it closed the connection.
  absl::StatusOr<RankMessage> next();
  // Sends the failure to the leader (best effort: it may be gone).
  void report(const absl::Status& st);
  // UNAVAILABLE naming the leader once the watcher saw its connection close (a follower's
  // collective that failed then only echoes that), waiting up to `wait` for it; else OK.
  absl::Status hangup(std::chrono::milliseconds wait) const;

 private:
  absl::Status closed_error() const;

  net::UniqueFd fd_;
  std::string leader_;
  std::function<void()> on_hangup_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool hung_up_ = false;  // the watcher saw the leader's connection close (guarded by mu_)
  WakePipe wake_;
  std::thread thread_;
};

}  // namespace kvfuse
