#include "src/parallel/rendezvous.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvfuse {

namespace {

using net::Clock;
using net::get_u32;
using net::put_u32;
using net::recv_all;
using net::RecvResult;
using net::send_all;
using net::UniqueFd;

constexpr char kMagic[8] = {'K', 'V', 'F', 'U', 'S', 'E', 'T', 'P'};
// 2: the hello's last word is the length of a config fingerprint that follows it.
// 3: the hello says how many consecutive ranks from its first the process holds.
constexpr uint32_t kVersion = 3;
constexpr size_t kHelloBytes = 28;
// Offsets of the hello's words, after the magic: the version first (where every version
// has it), then this version's fields.
constexpr size_t kHelloVersion = 8, kHelloWorld = 12, kHelloRank = 16, kHelloRanks = 20, kHelloFpLength = 24;
static_assert(kHelloFpLength + 4 == kHelloBytes, "the fingerprint length is the fixed part's last word");
constexpr size_t kReplyHeaderBytes = 20;
constexpr uint32_t kMaxMessageBytes = 4096;

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

// "key=value" lines into key -> value (a line without '=' is its own key).
std::map<std::string, std::string> fingerprint_entries(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    const size_t eq = line.find('=');
    if (!line.empty()) out[line.substr(0, eq)] = eq == std::string::npos ? "" : line.substr(eq + 1);
    pos = end + 1;
  }
  return out;
}

// "" when the fingerprints agree; otherwise each key that differs, with both values.
std::string fingerprint_diff(const std::string& mine, const std::string& theirs, int rank) {
  if (mine == theirs) return "";
  const auto a = fingerprint_entries(mine), b = fingerprint_entries(theirs);
  std::vector<std::string> diffs;
  auto value = [](const std::map<std::string, std::string>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? std::string("(unset)") : absl::StrCat(k, "=", it->second);
  };
  std::map<std::string, int> keys;
  for (const auto& [k, _] : a) keys[k] = 0;
  for (const auto& [k, _] : b) keys[k] = 0;
  for (const auto& [k, _] : keys) {
    if (value(a, k) != value(b, k)) {
      // The peer's side is its own text: quoted safely, and cut short.
      diffs.push_back(absl::StrCat("rank ", rank, " has ", net::printable(value(b, k), 256), ", rank 0 has ",
                                   value(a, k)));
    }
  }
  if (diffs.empty()) diffs.push_back("the fingerprints differ in their order");
  return absl::StrJoin(diffs, "; ");
}

absl::Status check_options(const RendezvousOptions& o) {
  if (o.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: world size ", o.world_size, " must be >= 1"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp rendezvous: rank ", o.rank, " is outside [0, ", o.world_size, ")"));
  }
  if (o.ranks < 1 || o.rank + o.ranks > o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: ", o.ranks, " rank(s) from rank ", o.rank,
                                                   " do not fit in a world of ", o.world_size));
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
  int port = 0;
  auto fd = net::listen_tcp(hp->first, hp->second, absl::StrCat("tp rendezvous: rank 0 on ", options.address),
                            &port);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(options, *std::move(fd), port));
}

RendezvousServer::~RendezvousServer() = default;

absl::Status RendezvousServer::serve(const RendezvousId& id) { return serve_impl(id, nullptr); }

absl::StatusOr<std::vector<UniqueFd>> RendezvousServer::serve_group(const RendezvousId& id) {
  std::vector<UniqueFd> keep;
  if (auto st = serve_impl(id, &keep); !st.ok()) return st;
  return keep;
}

absl::Status RendezvousServer::serve_impl(const RendezvousId& id, std::vector<UniqueFd>* keep) {
  struct Conn {
    UniqueFd fd;
    std::string peer;
    std::vector<uint8_t> hello;  // the fixed part, then the fingerprint
    int rank = -1;               // its first rank, once the hello is complete and valid
    int count = 0;               // and how many it holds
  };
  const RendezvousOptions& o = options_;
  const auto start = Clock::now();
  const auto deadline = start + o.timeout;
  std::vector<Conn> conns;
  std::map<int, size_t> arrived;  // a process's first rank -> index in conns
  std::vector<int> holder(size_t(o.world_size), -1);  // rank -> the first rank of its process
  for (int r = 0; r < o.ranks; ++r) holder[size_t(r)] = 0;
  int covered = o.ranks;
  absl::Status failure;

  auto finish = [&](const std::vector<uint8_t>& message, bool only_arrived) {
    for (Conn& c : conns) {
      if (!c.fd.valid()) continue;
      if (!only_arrived || c.rank > 0) {
        send_all(c.fd.get(), message.data(), message.size(), deadline + std::chrono::seconds(1));
      }
      c.fd.reset();
    }
  };

  while (covered < o.world_size) {
    const int wait = net::remaining_ms(deadline);
    if (wait == 0) {
      std::vector<int> have, missing;
      for (int r = 0; r < o.world_size; ++r) (holder[size_t(r)] >= 0 ? have : missing).push_back(r);
      failure = absl::DeadlineExceededError(absl::StrCat(
          "tp rendezvous at ", o.address, " (port ", port_, "): ", have.size(), " of ", o.world_size,
          " ranks arrived (", absl::StrJoin(have, ", "), ") in ", o.timeout.count(), " ms; missing rank(s) ",
          absl::StrJoin(missing, ", ")));
      break;
    }
    std::vector<pollfd> fds;
    fds.push_back({fd_.get(), POLLIN, 0});
    std::vector<size_t> which;
    size_t owing = 0, oldest_owing = 0;  // connections still owing their hello; the first
    for (size_t i = 0; i < conns.size(); ++i) {
      // Arrived processes too: one that goes away before the group forms gives its ranks
      // back (restarted, it may arrive again).
      if (conns[i].fd.valid()) {
        fds.push_back({conns[i].fd.get(), short(POLLIN | POLLRDHUP), 0});
        which.push_back(i);
        if (conns[i].rank < 0 && owing++ == 0) oldest_owing = i;
      }
    }
    const int n = ::poll(fds.data(), fds.size(), wait);
    if (n < 0 && errno != EINTR) {
      failure = absl::InternalError(
          absl::StrCat("tp rendezvous at ", o.address, ": poll: ", net::errno_text(errno)));
      break;
    }
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int cfd =
          ::accept4(fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (cfd >= 0) {
        // Past net::kMaxPendingHellos connections that owe their hello, the oldest goes: a
        // flood of silent clients cannot starve the real ranks of descriptors.
        if (owing >= net::kMaxPendingHellos) conns[oldest_owing].fd.reset();
        conns.push_back(Conn{UniqueFd(cfd), net::peer_name(ss), {}, -1, 0});
      }
    }
    for (size_t k = 1; k < fds.size() && failure.ok(); ++k) {
      if (fds[k].revents == 0) continue;
      Conn& c = conns[which[k - 1]];
      if (!c.fd.valid()) continue;  // dropped above as the oldest
      if (c.rank > 0) {
        // An arrived process says nothing more until the reply: this is its connection
        // closing (or bytes it should not send). Either way its ranks are free again.
        uint8_t byte;
        const ssize_t r = ::recv(c.fd.get(), &byte, 1, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        for (int q = c.rank; q < c.rank + c.count; ++q) holder[size_t(q)] = -1;
        covered -= c.count;
        arrived.erase(c.rank);
        c.rank = -1;
        c.fd.reset();
        continue;
      }
      // The fixed part first, then the fingerprint whose length it gives.
      const size_t want =
          c.hello.size() < kHelloBytes
              ? kHelloBytes
              : kHelloBytes + std::min(get_u32(c.hello.data() + kHelloFpLength), kMaxMessageBytes);
      uint8_t buf[kHelloBytes + kMaxMessageBytes];
      const ssize_t r = ::recv(c.fd.get(), buf, want - c.hello.size(), 0);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (r <= 0) {  // closed before its hello was complete: forget it
        c.fd.reset();
        continue;
      }
      c.hello.insert(c.hello.end(), buf, buf + r);
      // The magic is checked as soon as its bytes are in: a stray client goes at once.
      if (std::memcmp(c.hello.data(), kMagic, std::min<size_t>(8, c.hello.size())) != 0) {
        c.fd.reset();
        continue;
      }
      // The version as soon as its word is in: an older peer's hello is shorter than this
      // one's fixed part, and it is told about its version rather than left waiting.
      const bool other_version =
          c.hello.size() >= kHelloVersion + 4 && get_u32(c.hello.data() + kHelloVersion) != kVersion;
      if (c.hello.size() < kHelloBytes && !other_version) continue;
      const uint32_t version = get_u32(c.hello.data() + kHelloVersion);
      const uint32_t world = other_version ? 0 : get_u32(c.hello.data() + kHelloWorld);
      const uint32_t rank = other_version ? 0 : get_u32(c.hello.data() + kHelloRank);
      const uint32_t count = other_version ? 0 : get_u32(c.hello.data() + kHelloRanks);
      const uint32_t fp_length = other_version ? 0 : get_u32(c.hello.data() + kHelloFpLength);
      if (!other_version && fp_length <= kMaxMessageBytes && c.hello.size() < kHelloBytes + fp_length) continue;
      const bool in_world =
          rank >= 1 && rank < uint32_t(o.world_size) && count >= 1 && count <= uint32_t(o.world_size) - rank;
      int twice = -1;  // a rank of this process that another holds already
      for (uint32_t r = rank; in_world && r < rank + count && twice < 0; ++r) {
        if (holder[r] >= 0) twice = int(r);
      }
      const std::string who = absl::StrCat("a peer at ", c.peer);
      const std::string diff =
          version == kVersion && fp_length <= kMaxMessageBytes
              ? fingerprint_diff(o.fingerprint, std::string(c.hello.begin() + kHelloBytes, c.hello.end()),
                                 int(rank))
              : "";
      if (version != kVersion) {
        failure = absl::FailedPreconditionError(absl::StrCat("tp rendezvous at ", o.address, ": ", who,
                                                             " speaks protocol version ", version, ", rank 0 speaks ",
                                                             kVersion, " (mixed kvfuse versions?)"));
      } else if (world != uint32_t(o.world_size)) {
        failure = absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": rank ", rank, " (", who,
                                                          ") has world size ", world, ", rank 0 has ", o.world_size));
      } else if (!in_world) {
        failure = absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": ", who,
                                                          " announced ", count, " rank(s) from rank ", rank,
                                                          ", outside [1, ", o.world_size, ")"));
      } else if (fp_length > kMaxMessageBytes) {
        failure =
            absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": ", who,
                                                    " sent a config fingerprint of ", fp_length, " bytes"));
      } else if (twice >= 0) {
        const int first = holder[size_t(twice)];
        failure = absl::AlreadyExistsError(absl::StrCat(
            "tp rendezvous at ", o.address, ": rank ", twice, " arrived twice (from ",
            first == 0 ? std::string("rank 0's process") : conns[arrived.at(first)].peer, " and ", c.peer, ")"));
      } else if (!diff.empty()) {
        failure = absl::InvalidArgumentError(absl::StrCat("tp rendezvous at ", o.address, ": rank ", rank,
                                                          " (", who, ") has another config: ", diff));
      } else {
        c.rank = int(rank);
        c.count = int(count);
        arrived[int(rank)] = which[k - 1];
        for (uint32_t r = rank; r < rank + count; ++r) holder[r] = int(rank);
        covered += int(count);
      }
      if (!failure.ok()) {
        // The offending peer hears it too, even though it never became a rank.
        const auto msg = error_reply(failure);
        send_all(c.fd.get(), msg.data(), msg.size(), deadline + std::chrono::seconds(1));
        c.fd.reset();
      }
    }
    if (!failure.ok()) break;
    // Closed connections go once they outnumber the open ones (and past a few): a storm of
    // connections that come and go leaves neither records nor work behind in each poll.
    if (conns.size() > 2 * which.size() + 64) {
      std::vector<Conn> open;
      arrived.clear();
      for (Conn& c : conns) {
        if (!c.fd.valid()) continue;
        if (c.rank > 0) arrived[c.rank] = open.size();
        open.push_back(std::move(c));
      }
      conns = std::move(open);
    }
  }

  if (!failure.ok()) {
    finish(error_reply(failure), /*only_arrived=*/true);
    return failure;
  }
  const auto ok = reply(absl::StatusCode::kOk, id.data(), uint32_t(id.size()));
  for (auto& [r, i] : arrived) {
    Conn& c = conns[i];
    if (!send_all(c.fd.get(), ok.data(), ok.size(), Clock::now() + o.timeout)) {
      failure = absl::UnavailableError(
          absl::StrCat("tp rendezvous at ", o.address, ": sending the id to rank ", r, " (", c.peer, ") failed"));
    }
  }
  if (failure.ok() && keep != nullptr) {
    keep->resize(size_t(o.world_size));
    for (auto& [r, i] : arrived) {
      net::tune_connection(conns[i].fd.get());
      (*keep)[size_t(r)] = std::move(conns[i].fd);
    }
  }
  finish({}, /*only_arrived=*/false);  // closes whatever is left (strays included)
  return failure;
}

// --- ranks >= 1 -----------------------------------------------------------------------

absl::StatusOr<RendezvousId> rendezvous_join(const RendezvousOptions& o) {
  auto m = rendezvous_join_group(o);
  if (!m.ok()) return m.status();
  return m->id;
}

absl::StatusOr<RendezvousMember> rendezvous_join_group(const RendezvousOptions& o) {
  if (auto st = check_options(o); !st.ok()) return st;
  if (o.rank == 0) return absl::InvalidArgumentError("tp rendezvous: rank 0 serves, it does not join");
  if (o.fingerprint.size() > kMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: a fingerprint of ", o.fingerprint.size(),
                                                   " bytes is over ", kMaxMessageBytes));
  }
  auto hp = parse_host_port(o.address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: ", hp.status().message()));
  if (hp->second == 0) return absl::InvalidArgumentError(absl::StrCat("tp rendezvous: '", o.address, "' has port 0"));
  const auto deadline = Clock::now() + o.timeout;
  const std::string me = absl::StrCat("tp rendezvous at ", o.address, ": rank ", o.rank, " of ", o.world_size);

  // Connect, retrying while rank 0 is not listening yet.
  auto conn = net::connect_tcp(hp->first, hp->second, deadline,
                               absl::StrCat(me, " could not reach rank 0 in ", o.timeout.count(), " ms"));
  if (!conn.ok()) return conn.status();
  UniqueFd fd = *std::move(conn);

  std::vector<uint8_t> hello(kHelloBytes + o.fingerprint.size());
  std::memcpy(hello.data(), kMagic, 8);
  put_u32(hello.data() + kHelloVersion, kVersion);
  put_u32(hello.data() + kHelloWorld, uint32_t(o.world_size));
  put_u32(hello.data() + kHelloRank, uint32_t(o.rank));
  put_u32(hello.data() + kHelloRanks, uint32_t(o.ranks));
  put_u32(hello.data() + kHelloFpLength, uint32_t(o.fingerprint.size()));
  std::memcpy(hello.data() + kHelloBytes, o.fingerprint.data(), o.fingerprint.size());
  if (!send_all(fd.get(), hello.data(), hello.size(), deadline)) {
    return absl::UnavailableError(absl::StrCat(me, ": sending the hello failed"));
  }
  uint8_t header[kReplyHeaderBytes];
  const RecvResult rc = recv_all(fd.get(), header, sizeof header, deadline);
  if (rc != RecvResult::ok) {
    return rc == RecvResult::timeout
               ? absl::DeadlineExceededError(absl::StrCat(me, ": connected, but rank 0 did not answer in ",
                                                          o.timeout.count(), " ms (are all ranks started?)"))
               : absl::UnavailableError(absl::StrCat(me, ": rank 0 closed the connection without an answer"));
  }
  if (std::memcmp(header, kMagic, 8) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(me, ": what listens there is not a kvfuse rendezvous"));
  }
  const uint32_t version = get_u32(header + 8), code = get_u32(header + 12), length = get_u32(header + 16);
  if (length > kMaxMessageBytes || (version != kVersion && code == 0)) {
    return absl::FailedPreconditionError(
        absl::StrCat(me, ": rank 0 answers with protocol version ", version, ", this rank speaks ", kVersion));
  }
  std::vector<uint8_t> payload(length);
  if (length > 0 && recv_all(fd.get(), payload.data(), length, deadline) != RecvResult::ok) {
    return absl::UnavailableError(absl::StrCat(me, ": rank 0's answer was cut short"));
  }
  if (code != 0) {
    const auto status_code = code <= 16 ? absl::StatusCode(code) : absl::StatusCode::kUnknown;
    return absl::Status(status_code, absl::StrCat("rank 0 refused the group: ",
                                                  std::string(payload.begin(), payload.end())));
  }
  if (length != kRendezvousIdBytes) {
    return absl::FailedPreconditionError(absl::StrCat(me, ": rank 0 sent an id of ", length, " bytes"));
  }
  RendezvousMember m;
  std::memcpy(m.id.data(), payload.data(), m.id.size());
  net::tune_connection(fd.get());
  m.leader = std::move(fd);
  return m;
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
