#include "src/parallel/init_watch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "src/parallel/socket_io.h"

namespace kvfuse {

GroupInitWatch::GroupInitWatch(std::chrono::milliseconds timeout, std::vector<Peer> peers)
    : deadline_(std::chrono::steady_clock::now() + timeout), peers_(std::move(peers)) {}

nccl::InitWatch GroupInitWatch::for_rank(int rank) {
  nccl::InitWatch w;
  w.deadline = deadline_;
  w.peers = [this, rank] { return check(rank); };
  return w;
}

absl::Status GroupInitWatch::failed(int rank, absl::Status st) {
  if (st.ok()) return st;
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_rank_ < 0) {
    failed_rank_ = rank;
    failure_ = st;
  }
  return st;
}

absl::Status GroupInitWatch::check(int asking_rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_rank_ >= 0 && failed_rank_ != asking_rank) {
      return absl::Status(failure_.code(),
                          absl::StrCat("rank ", failed_rank_, " failed: ", failure_.message()));
    }
  }
  for (const Peer& p : peers_) {
    if (p.fd >= 0 && net::peer_closed(p.fd)) {
      return absl::UnavailableError(
          absl::StrCat(p.what, " closed its connection (it failed or was stopped; its own log says why)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
