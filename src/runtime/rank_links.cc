#include "src/runtime/rank_links.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace kvfuse {

namespace {

using net::Clock;

// What the leader takes from a follower: its one error report. A longer frame is not one
// (and is refused before its payload is read); the message is cut to kMaxErrorText.
constexpr uint64_t kMaxFollowerFrameBytes = 64 << 10;
constexpr size_t kMaxErrorText = 4096;

// error payload: u32 absl::StatusCode, then the message.
std::vector<uint8_t> encode_error(const absl::Status& st) {
  const std::string msg(st.message().substr(0, kMaxErrorText));
  std::vector<uint8_t> out(4 + msg.size());
  net::put_u32(out.data(), uint32_t(st.code()));
  std::copy(msg.begin(), msg.end(), out.begin() + 4);
  return out;
}

absl::Status decode_error(const std::vector<uint8_t>& p, int rank) {
  const uint32_t code = p.size() >= 4 ? net::get_u32(p.data()) : uint32_t(absl::StatusCode::kUnknown);
  const auto status_code = code >= 1 && code <= 16 ? absl::StatusCode(code) : absl::StatusCode::kUnknown;
  const std::string msg =
      p.size() > 4
          ? net::printable(std::string_view(reinterpret_cast<const char*>(p.data()) + 4, p.size() - 4),
                           kMaxErrorText)
          : std::string("(no message)");
  return absl::Status(status_code, absl::StrCat("rank ", rank, ": ", msg));
}

}  // namespace

WakePipe::WakePipe() {
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
    read_.reset(fds[0]);
    write_.reset(fds[1]);
  }
}

void WakePipe::wake() {
  const char c = 1;
  (void)!::write(write_.get(), &c, 1);
}

// --- the leader's side ----------------------------------------------------------------

FollowerLinks::FollowerLinks(std::vector<net::UniqueFd> fds, std::chrono::milliseconds send_timeout,
                             std::function<void()> on_failure)
    : fds_(std::move(fds)),
      send_timeout_(send_timeout),
      on_failure_(std::move(on_failure)),
      closed_(fds_.size(), false) {
  thread_ = std::thread([this] { monitor(); });
}

FollowerLinks::~FollowerLinks() { stop_monitor(); }

void FollowerLinks::stop_monitor() {
  if (!thread_.joinable()) return;
  wake_.wake();
  thread_.join();
}

void FollowerLinks::record(absl::Status st) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return;
    failure_ = std::move(st);
    failed_ = true;
  }
  cv_.notify_all();
  if (on_failure_) on_failure_();
}

void FollowerLinks::monitor() {
  for (;;) {
    std::vector<pollfd> p{{wake_.fd(), POLLIN, 0}};
    std::vector<size_t> which;
    for (size_t r = 1; r < fds_.size(); ++r) {
      if (fds_[r].valid() && !closed_[r]) {
        p.push_back({fds_[r].get(), POLLIN | POLLRDHUP, 0});
        which.push_back(r);
      }
    }
    const int n = ::poll(p.data(), p.size(), -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || p[0].revents != 0) return;
    for (size_t k = 1; k < p.size(); ++k) {
      if (p[k].revents == 0) continue;
      const size_t r = which[k - 1];
      closed_[r] = true;  // a follower says something only once: its failure
      auto m = recv_rank_frame(fds_[r].get(), Clock::now() + std::chrono::seconds(5),
                               absl::StrCat("rank ", r), kMaxFollowerFrameBytes);
      if (m.ok() && m->command == RankCommand::error) {
        record(decode_error(m->payload, int(r)));
      } else if (m.ok()) {
        record(absl::DataLossError(
            absl::StrCat("rank ", r, " sent an unexpected ", to_string(m->command), " command to rank 0")));
      } else if (m.status().code() == absl::StatusCode::kUnavailable) {
        record(absl::UnavailableError(absl::StrCat(
            "rank ", r, " closed its control connection to rank 0 (its process exited or was killed)")));
      } else {
        // Bytes that are not a whole report: a stalled, broken or foreign peer, alive or not.
        record(absl::DataLossError(absl::StrCat("rank ", r,
                                                "'s control connection to rank 0 carried no valid report (",
                                                m.status().message(), ")")));
      }
    }
  }
}

absl::Status FollowerLinks::post(const std::vector<uint8_t>& frame) {
  const auto deadline = Clock::now() + send_timeout_;
  for (size_t r = 1; r < fds_.size(); ++r) {
    if (!fds_[r].valid()) continue;
    if (auto st = send_rank_frame(fds_[r].get(), frame, deadline, absl::StrCat("rank 0 sending to rank ", r));
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status FollowerLinks::failure() const {
  if (!failed_.load()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

absl::Status FollowerLinks::wait_failure(std::chrono::milliseconds wait) const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [this] { return !failure_.ok(); });
  return failure_;
}

void FollowerLinks::shutdown() {
  stop_monitor();
  const auto frame = rank_frame(RankCommand::shutdown, {});
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (size_t r = 1; r < fds_.size(); ++r) {
    if (fds_[r].valid()) (void)send_rank_frame(fds_[r].get(), frame, deadline, "shutdown");
    fds_[r].reset();
  }
}

// --- a follower's side ----------------------------------------------------------------

LeaderLink::LeaderLink(net::UniqueFd fd, std::string leader, std::function<void()> on_hangup)
    : fd_(std::move(fd)), leader_(std::move(leader)), on_hangup_(std::move(on_hangup)) {
  thread_ = std::thread([this] {
    for (;;) {
      pollfd p[2] = {{wake_.fd(), POLLIN, 0}, {fd_.get(), POLLRDHUP, 0}};
      const int n = ::poll(p, 2, -1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 || p[0].revents != 0) return;
      if (p[1].revents != 0) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          hung_up_ = true;
        }
        cv_.notify_all();
        if (on_hangup_) on_hangup_();
        return;
      }
    }
  });
}

LeaderLink::~LeaderLink() {
  wake_.wake();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<RankMessage> LeaderLink::next() {
  auto m = recv_rank_frame(fd_.get(), net::kNoDeadline, absl::StrCat("rank 0 at ", leader_));
  if (m.status().code() == absl::StatusCode::kUnavailable) return closed_error();
  return m;
}

absl::Status LeaderLink::closed_error() const {
  return absl::UnavailableError(absl::StrCat("rank 0 at ", leader_,
                                             " closed the control connection without a shutdown (it exited, "
                                             "was killed, or its group failed)"));
}

absl::Status LeaderLink::hangup(std::chrono::milliseconds wait) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, wait, [this] { return hung_up_; }) ? closed_error() : absl::OkStatus();
}

void LeaderLink::report(const absl::Status& st) {
  (void)send_rank_frame(fd_.get(), rank_frame(RankCommand::error, encode_error(st)),
                        Clock::now() + std::chrono::seconds(2), "report");
}

}  // namespace kvfuse
