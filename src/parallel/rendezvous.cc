#include "src/parallel/rendezvous.h"

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
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvfuse {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'K', 'V', 'F', 'U', 'S', 'E', 'T', 'P'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHelloBytes = 24;
constexpr size_t kReplyHeaderBytes = 20;
constexpr uint32_t kMaxMessageBytes = 4096;

void put_u32(uint8_t* p, uint32_t v) {
  const uint32_t n = htonl(v);
  std::memcpy(p, &n, 4);
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t n;
  std::memcpy(&n, p, 4);
  return ntohl(n);
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string errno_text(int err) { return std::strerror(err); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Writes all of data before the deadline (the socket may be non-blocking).
bool send_all(int fd, const uint8_t* data, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w > 0) {
      data += w;
      n -= size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

std::vector<uint8_t> reply(absl::StatusCode code, const uint8_t* payload, uint32_t length) {
  std::vector<uint8_t> out(kReplyHeaderBytes + length);
  std::memcpy(out.data(), kMagic, 8);
  put_u32(out.data() + 8, kVersion);
  put_u32(out.data() + 12, uint32_t(code));
  put_u32(out.data() + 16, length);
  if (length > 0) std::memcpy(out.data() + kReplyHeaderBytes, payload, length);
  return out;
}

std::vector<uint8_t> error_reply(const absl::Status& st) {
  const std::string msg(st.message().substr(0, kMaxMessageBytes));
  return reply(st.code(), reinterpret_cast<const uint8_t*>(msg.data()), uint32_t(msg.size()));
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

absl::StatusOr<addrinfo*> resolve(const std::string& host, int port, bool passive, const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp rendezvous: cannot resolve '", address, "': ", ::gai_strerror(rc)));
  }
  return res;
}

absl::Status check_options(const RendezvousOptions& o) {
  if (o.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: world size ", o.world_size, " must be >= 1"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp rendezvous: rank ", o.rank, " is outside [0, ", o.world_size, ")"));
  }
  if (o.timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: timeout ", o.timeout.count(), " ms must be > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> parse_host_port(const std::string& address) {
  std::string host, port_text;
  if (!address.empty() && address[0] == '[') {
    const auto close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not [host]:port"));
    }
    host = address.substr(1, close - 1);
    port_text = address.substr(close + 2);
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string::npos || address.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
    }
    host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  }
  int port = -1;
  if (host.empty()) return absl::InvalidArgumentError(absl::StrCat("'", address, "' has no host"));
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "': port '", port_text, "' is not in 0 .. 65535"));
  }
  return std::make_pair(host, port);
}

// --- rank 0 ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::listen(const RendezvousOptions& options) {
  if (auto st = check_options(options); !st.ok()) return st;
  auto hp = parse_host_port(options.address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: ", hp.status().message()));
  auto res = resolve(hp->first, hp->second, /*passive=*/true, options.address);
  if (!res.ok()) return res.status();
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* ai = *res; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = errno_text(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    last_error = errno_text(errno);
    close_fd(fd);
  }
  ::freeaddrinfo(*res);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("tp rendezvous: rank 0 cannot listen on ", options.address, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(options, fd, port));
}

RendezvousServer::~RendezvousServer() { close_fd(fd_); }

absl::Status RendezvousServer::serve(const RendezvousId& id) {
  struct Conn {
    int fd = -1;
    std::string peer;
    std::vector<uint8_t> hello;
    int rank = -1;  // once the hello is complete and valid
  };
  const RendezvousOptions& o = options_;
  const auto start = Clock::now();
  const auto deadline = start + o.timeout;
  std::vector<Conn> conns;
  std::map<int, size_t> arrived;  // rank -> index in conns
  absl::Status failure;

  auto finish = [&](const std::vector<uint8_t>& message, bool only_arrived) {
    for (Conn& c : conns) {
      if (c.fd < 0) continue;
      if (!only_arrived || c.rank > 0) send_all(c.fd, message.data(), message.size(), deadline + std::chrono::seconds(1));
      close_fd(c.fd);
    }
  };

  while (int(arrived.size()) < o.world_size - 1) {
    const int wait = remaining_ms(deadline);
    if (wait == 0) {
      std::vector<int> have = {0}, missing;
      for (const auto& [r, _] : arrived) have.push_back(r);
      for (int r = 1; r < o.world_size; ++r) {
        if (!arrived.count(r)) missing.push_back(r);
      }
      failure = absl::DeadlineExceededError(absl::StrCat(
          "tp rendezvous at ", o.address, " (port ", port_, "): ", have.size(), " of ", o.world_size,
          " ranks arrived (", absl::StrJoin(have, ", "), ") in ", o.timeout.count(), " ms; missing rank(s) ",
          absl::StrJoin(missing, ", ")));
      break;
    }
    std::vector<pollfd> fds;
    fds.push_back({fd_, POLLIN, 0});
    std::vector<size_t> which;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (conns[i].fd >= 0 && conns[i].rank < 0) {
        fds.push_back({conns[i].fd, POLLIN, 0});
        which.push_back(i);
      }
    }
    const int n = ::poll(fds.data(), fds.size(), wait);
    if (n < 0 && errno != EINTR) {
      failure = absl::InternalError(absl::StrCat("tp rendezvous at ", o.address, ": poll: ", errno_text(errno)));
      break;
    }
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int cfd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (cfd >= 0) conns.push_back(Conn{cfd, peer_name(ss), {}, -1});
    }
    for (size_t k = 1; k < fds.size() && failure.ok(); ++k) {
      if (fds[k].revents == 0) continue;
      Conn& c = conns[which[k - 1]];
      uint8_t buf[kHelloBytes];
      const ssize_t r = ::recv(c.fd, buf, kHelloBytes - c.hello.size(), 0);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (r <= 0) {  // closed before its hello was complete: forget it
        close_fd(c.fd);
        continue;
      }
      c.hello.insert(c.hello.end(), buf, buf + r);
      // The magic is checked as soon as its bytes are in: a stray client goes at once.
      if (std::memcmp(c.hello.data(), kMagic, std::min<size_t>(8, c.hello.size())) != 0) {
        close_fd(c.fd);
        continue;
      }
      if (c.hello.size() < kHelloBytes) continue;
      const uint32_t version = get_u32(c.hello.data() + 8);
      const uint32_t world = get_u32(c.hello.data() + 12);
      const uint32_t rank = get_u32(c.hello.data() + 16);
      const std::string who = absl::StrCat("a peer at ", c.peer);
      if (version != kVersion) {
        failure = absl::FailedPreconditionError(absl::StrCat("tp rendezvous at ", o.address, ": ", who,
                                                             " speaks protocol version ", version, ", rank 0 speaks ",
                                                             kVersion, " (mixed kvfuse versions?)"));
      } else if (world != uint32_t(o.world_size)) {
        failure = absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": rank ", rank, " (", who,
                                                          ") has world size ", world, ", rank 0 has ", o.world_size));
      } else if (rank < 1 || rank >= uint32_t(o.world_size)) {
        failure = absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": ", who,
                                                          " announced rank ", rank, ", outside [1, ", o.world_size,
                                                          ")"));
      } else if (auto it = arrived.find(int(rank)); it != arrived.end()) {
        failure = absl::AlreadyExistsError(absl::StrCat("tp rendezvous at ", o.address, ": rank ", rank,
                                                        " arrived twice (from ", conns[it->second].peer, " and ",
                                                        c.peer, ")"));
      } else {
        c.rank = int(rank);
        arrived[int(rank)] = which[k - 1];
      }
      if (!failure.ok()) {
        // The offending peer hears it too, even though it never became a rank.
        const auto msg = error_reply(failure);
        send_all(c.fd, msg.data(), msg.size(), deadline + std::chrono::seconds(1));
        close_fd(c.fd);
      }
    }
    if (!failure.ok()) break;
  }

  if (!failure.ok()) {
    finish(error_reply(failure), /*only_arrived=*/true);
    return failure;
  }
  const auto ok = reply(absl::StatusCode::kOk, id.data(), uint32_t(id.size()));
  for (auto& [r, i] : arrived) {
    Conn& c = conns[i];
    if (!send_all(c.fd, ok.data(), ok.size(), Clock::now() + o.timeout)) {
      failure = absl::UnavailableError(
          absl::StrCat("tp rendezvous at ", o.address, ": sending the id to rank ", r, " (", c.peer, ") failed"));
    }
  }
  finish({}, /*only_arrived=*/false);  // closes whatever is left (strays included)
  return failure;
}

// --- ranks >= 1 -----------------------------------------------------------------------

namespace {

// One connection attempt before the deadline: the fd, or -1 and the reason.
int connect_once(const addrinfo* ai, Clock::time_point deadline, std::string& error) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) {
    error = errno_text(errno);
    return -1;
  }
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    error = errno_text(errno);
    close_fd(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, remaining_ms(deadline)) <= 0) {
    error = "connect timed out";
    close_fd(fd);
    return -1;
  }
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    error = errno_text(err);
    close_fd(fd);
    return -1;
  }
  return fd;
}

// Reads exactly n bytes before the deadline. 0: done, 1: timeout, 2: closed or error.
int recv_all(int fd, uint8_t* data, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) return 1;
    if (rc < 0) return 2;
    const ssize_t r = ::recv(fd, data, n, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (r <= 0) return 2;
    data += r;
    n -= size_t(r);
  }
  return 0;
}

}  // namespace

absl::StatusOr<RendezvousId> rendezvous_join(const RendezvousOptions& o) {
  if (auto st = check_options(o); !st.ok()) return st;
  if (o.rank == 0) return absl::InvalidArgumentError("tp rendezvous: rank 0 serves, it does not join");
  auto hp = parse_host_port(o.address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: ", hp.status().message()));
  if (hp->second == 0) return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: '", o.address, "' has port 0"));
  const auto deadline = Clock::now() + o.timeout;
  const std::string me = absl::StrCat("tp rendezvous at ", o.address, ": rank ", o.rank, " of ", o.world_size);

  // Connect, retrying while rank 0 is not listening yet.
  int fd = -1;
  std::string last_error;
  while (fd < 0) {
    auto res = resolve(hp->first, hp->second, /*passive=*/false, o.address);
    if (res.ok()) {
      for (addrinfo* ai = *res; ai != nullptr && fd < 0; ai = ai->ai_next) fd = connect_once(ai, deadline, last_error);
      ::freeaddrinfo(*res);
    } else {
      last_error = std::string(res.status().message());
    }
    if (fd >= 0) break;
    if (remaining_ms(deadline) == 0) {
      return absl::DeadlineExceededError(absl::StrCat(me, " could not reach rank 0 in ", o.timeout.count(),
                                                      " ms (last error: ", last_error, ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, remaining_ms(deadline))));
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  uint8_t hello[kHelloBytes] = {};
  std::memcpy(hello, kMagic, 8);
  put_u32(hello + 8, kVersion);
  put_u32(hello + 12, uint32_t(o.world_size));
  put_u32(hello + 16, uint32_t(o.rank));
  if (!send_all(fd, hello, sizeof hello, deadline)) {
    close_fd(fd);
    return absl::UnavailableError(absl::StrCat(me, ": sending the hello failed"));
  }
  uint8_t header[kReplyHeaderBytes];
  const int rc = recv_all(fd, header, sizeof header, deadline);
  if (rc != 0) {
    close_fd(fd);
    return rc == 1 ? absl::DeadlineExceededError(absl::StrCat(me, ": connected, but rank 0 did not answer in ",
                                                              o.timeout.count(), " ms (are all ranks started?)"))
                   : absl::UnavailableError(absl::StrCat(me, ": rank 0 closed the connection without an answer"));
  }
  if (std::memcmp(header, kMagic, 8) != 0) {
    close_fd(fd);
    return absl::FailedPreconditionError(absl::StrCat(me, ": what listens there is not a kvfuse rendezvous"));
  }
  const uint32_t version = get_u32(header + 8), code = get_u32(header + 12), length = get_u32(header + 16);
  if (version != kVersion || length > kMaxMessageBytes) {
    close_fd(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(me, ": rank 0 answers with protocol version ", version, ", this rank speaks ", kVersion));
  }
  std::vector<uint8_t> payload(length);
  if (length > 0 && recv_all(fd, payload.data(), length, deadline) != 0) {
    close_fd(fd);
    return absl::UnavailableError(absl::StrCat(me, ": rank 0's answer was cut short"));
  }
  close_fd(fd);
  if (code != 0) {
    const auto status_code = code <= 16 ? absl::StatusCode(code) : absl::StatusCode::kUnknown;
    return absl::Status(status_code, absl::StrCat("rank 0 refused the group: ",
                                                  std::string(payload.begin(), payload.end())));
  }
  if (length != kRendezvousIdBytes) {
    return absl::FailedPreconditionError(absl::StrCat(me, ": rank 0 sent an id of ", length, " bytes"));
  }
  RendezvousId id;
  std::memcpy(id.data(), payload.data(), id.size());
  return id;
}

absl::StatusOr<RendezvousId> rendezvous(const RendezvousOptions& options,
                                        const std::function<absl::StatusOr<RendezvousId>()>& make_id) {
  if (auto st = check_options(options); !st.ok()) return st;
  if (options.rank != 0) return rendezvous_join(options);
  auto server = RendezvousServer::listen(options);
  if (!server.ok()) return server.status();
  auto id = make_id();
  if (!id.ok()) return id.status();
  if (auto st = (*server)->serve(*id); !st.ok()) return st;
  return *id;
}

}  // namespace kvfuse
