#include "src/parallel/socket_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvfuse::net {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int remaining_ms(Clock::time_point deadline) {
  if (deadline == kNoDeadline) return 1 << 30;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string errno_text(int err) { return std::strerror(err); }

bool peer_closed(int fd) {
  pollfd p{fd, short(POLLRDHUP), 0};
  int rc;
  do {
    rc = ::poll(&p, 1, 0);
  } while (rc < 0 && errno == EINTR);
  return rc > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

std::string printable(std::string_view text, size_t max_bytes) {
  std::string out;
  const size_t n = std::min(text.size(), max_bytes);
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out.push_back(char(c));
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (n < text.size()) absl::StrAppend(&out, "... (", text.size(), " bytes)");
  return out;
}

std::string peer_name(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return absl::StrCat(host, ":", port);
}

void put_u32(uint8_t* p, uint32_t v) {
  const uint32_t n = htonl(v);
  std::memcpy(p, &n, 4);
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t n;
  std::memcpy(&n, p, 4);
  return ntohl(n);
}
void put_u64(uint8_t* p, uint64_t v) {
  put_u32(p, uint32_t(v >> 32));
  put_u32(p + 4, uint32_t(v));
}
uint64_t get_u64(const uint8_t* p) { return (uint64_t(get_u32(p)) << 32) | get_u32(p + 4); }

bool send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd, POLLOUT, 0};
      const int rc = ::poll(&pf, 1, remaining_ms(deadline));
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0 || (pf.revents & (POLLERR | POLLHUP | POLLNVAL))) return false;
      continue;
    }
    return false;
  }
  return true;
}

RecvResult recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    const int rc = ::poll(&pf, 1, remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      if (remaining_ms(deadline) > 0) continue;  // the no-deadline wait is taken in slices
      return RecvResult::timeout;
    }
    if (rc < 0) return RecvResult::closed;
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (r <= 0) return RecvResult::closed;
    p += r;
    n -= size_t(r);
  }
  return RecvResult::ok;
}

namespace {

absl::StatusOr<addrinfo*> resolve(const std::string& host, int port, bool passive, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot resolve '", host, "': ", ::gai_strerror(rc)));
  }
  return res;
}

// One connection attempt before the deadline: the fd, or -1 and the reason.
int connect_once(const addrinfo* ai, Clock::time_point deadline, std::string& error) {
  UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (!fd.valid()) {
    error = errno_text(errno);
    return -1;
  }
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) return fd.release();
  if (errno != EINPROGRESS) {
    error = errno_text(errno);
    return -1;
  }
  pollfd p{fd.get(), POLLOUT, 0};
  if (::poll(&p, 1, remaining_ms(deadline)) <= 0) {
    error = "connect timed out";
    return -1;
  }
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    error = errno_text(err);
    return -1;
  }
  return fd.release();
}

}  // namespace

absl::StatusOr<UniqueFd> listen_tcp(const std::string& host, int port, const std::string& what,
                                    int* bound_port) {
  auto res = resolve(host, port, /*passive=*/true, what);
  if (!res.ok()) return res.status();
  std::string last_error = "no address";
  UniqueFd fd;
  for (addrinfo* ai = *res; ai != nullptr; ai = ai->ai_next) {
    fd.reset(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) {
      last_error = errno_text(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), 128) == 0) break;
    last_error = errno_text(errno);
    fd.reset();
  }
  ::freeaddrinfo(*res);
  if (!fd.valid()) return absl::UnavailableError(absl::StrCat(what, ": cannot listen: ", last_error));
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  if (bound_port != nullptr) {
    *bound_port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) | O_NONBLOCK);
  return fd;
}

absl::StatusOr<UniqueFd> connect_tcp(const std::string& host, int port, Clock::time_point deadline,
                                     const std::string& what) {
  std::string last_error;
  for (;;) {
    int fd = -1;
    auto res = resolve(host, port, /*passive=*/false, what);
    if (res.ok()) {
      for (addrinfo* ai = *res; ai != nullptr && fd < 0; ai = ai->ai_next)
        fd = connect_once(ai, deadline, last_error);
      ::freeaddrinfo(*res);
    } else {
      last_error = std::string(res.status().message());
    }
    if (fd >= 0) {
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return UniqueFd(fd);
    }
    if (remaining_ms(deadline) == 0) {
      return absl::DeadlineExceededError(absl::StrCat(what, " (last error: ", last_error, ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, remaining_ms(deadline))));
  }
}

void tune_connection(int fd) {
  const int one = 1, idle = 30, interval = 10, count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

}  // namespace kvfuse::net
