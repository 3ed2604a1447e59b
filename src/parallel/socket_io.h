// Plain POSIX TCP plumbing shared by the rendezvous, the TCP communicator and the engine's
// control channel: an owning fd, whole-buffer send/receive with a deadline, listening and
// connecting (with retries while nothing listens yet). Every socket is close-on-exec and
// every send uses MSG_NOSIGNAL: a peer that went away is an error return, never SIGPIPE.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"

struct sockaddr_storage;

namespace kvfuse::net {

using Clock = std::chrono::steady_clock;
// No deadline (a follower waits for its leader's next command for as long as it takes).
inline constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

// Owns a file descriptor; -1 is none.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Connections a listener (the rendezvous, the TCP communicator's rank 0) keeps while they
// still owe their hello; past it the oldest is dropped, so that a flood of silent clients
// cannot starve the real ranks of descriptors.
inline constexpr size_t kMaxPendingHellos = 64;

// Milliseconds to the deadline, clamped to [0, 2^30].
int remaining_ms(Clock::time_point deadline);
std::string errno_text(int err);
std::string peer_name(const sockaddr_storage& ss);
// Text a peer sent, safe to quote in an error or a log line: at most `max_bytes` of it
// ("... (N bytes)" says how much there was), each byte that is not printable ASCII, and
// '"' and '\\', written as \xNN.
std::string printable(std::string_view text, size_t max_bytes);

// Big-endian integers of the wire headers.
void put_u32(uint8_t* p, uint32_t v);
uint32_t get_u32(const uint8_t* p);
void put_u64(uint8_t* p, uint64_t v);
uint64_t get_u64(const uint8_t* p);

// Writes all of data before the deadline (the socket may be non-blocking). False on a
// closed connection, an error or the deadline.
bool send_all(int fd, const void* data, size_t n, Clock::time_point deadline);
enum class RecvResult { ok, timeout, closed };
// Reads exactly n bytes before the deadline; `closed` covers errors and a peer's shutdown.
RecvResult recv_all(int fd, void* data, size_t n, Clock::time_point deadline);

// True when the peer of the connected socket `fd` has closed or reset it (POLLRDHUP,
// POLLHUP or POLLERR). Reads nothing and does not wait.
bool peer_closed(int fd);

// Binds and listens on host:port (port 0: any free one; host "" or "*": every address),
// non-blocking. `what` starts error messages. The bound port comes back in *bound_port.
absl::StatusOr<UniqueFd> listen_tcp(const std::string& host, int port, const std::string& what,
                                    int* bound_port);
// Connects to host:port before the deadline, retrying every 50 ms while it is refused or
// unresolvable (the listener may start later). The socket is non-blocking with TCP_NODELAY.
// DEADLINE_EXCEEDED starting with `what`, naming the last error.
absl::StatusOr<UniqueFd> connect_tcp(const std::string& host, int port, Clock::time_point deadline,
                                     const std::string& what);
// TCP_NODELAY, and keepalive probes after 30 s idle (every 10 s, 3 of them) so that a
// connection to a host that vanished without closing it fails within about a minute.
void tune_connection(int fd);

}  // namespace kvfuse::net
