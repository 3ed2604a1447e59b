#include "src/parallel/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/parallel/cpu_communicator.h"

namespace kvfuse {

namespace {

using net::Clock;
using net::get_u32;
using net::get_u64;
using net::put_u32;
using net::put_u64;

constexpr char kMagic[8] = {'K', 'V', 'F', 'U', 'S', 'E', 'T', 'C'};
constexpr size_t kHelloBytes = 24;   // magic, u64 token, u32 rank, u32 size
constexpr size_t kAckBytes = 12;     // magic, u32 0
constexpr size_t kHeaderBytes = 32;  // u32 op, u32 dtype, u64 count, u32 root, u32 0, u64 seq
constexpr int64_t kMaxErrorBytes = 4096;

Clock::time_point after(std::chrono::milliseconds t) { return Clock::now() + t; }

}  // namespace

absl::StatusOr<std::unique_ptr<TcpCommListener>> TcpCommListener::open(const std::string& host) {
  std::unique_ptr<TcpCommListener> l(new TcpCommListener());
  auto fd = net::listen_tcp(host, 0, absl::StrCat("tcp communicator: rank 0 on ", host), &l->port_);
  if (!fd.ok()) return fd.status();
  l->fd_ = *std::move(fd);
  std::random_device rd;
  l->token_ = (uint64_t(rd()) << 32) ^ rd();
  std::memcpy(l->id_.data(), kMagic, 8);
  put_u32(l->id_.data() + 8, uint32_t(l->port_));
  put_u64(l->id_.data() + 12, l->token_);
  return l;
}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::accept(
    std::unique_ptr<TcpCommListener> listener, int size, std::chrono::milliseconds timeout) {
  if (listener == nullptr || size < 2 || timeout.count() <= 0) {
    return absl::InvalidArgumentError("tcp communicator: a listener, size >= 2 and a positive timeout");
  }
  std::unique_ptr<TcpCommunicator> c(new TcpCommunicator(0, size, timeout));
  c->peers_.resize(size_t(size));
  c->scratch_.resize(size_t(size));
  const auto deadline = after(timeout);
  // Connections whose hello is not complete yet, read together: a client that connects
  // and says nothing (a port scanner, a stalled peer) delays nobody. Past
  // net::kMaxPendingHellos the oldest is dropped, so a flood cannot starve the real ranks of
  // descriptors.
  struct Pending {
    net::UniqueFd fd;
    std::vector<uint8_t> hello;
  };
  std::vector<Pending> pending;
  uint8_t token[8];  // as a hello carries it
  put_u64(token, listener->token_);
  int arrived = 0;
  while (arrived < size - 1) {
    const int wait = net::remaining_ms(deadline);
    if (wait == 0) {
      std::vector<int> missing;
      for (int r = 1; r < size; ++r) {
        if (!c->peers_[size_t(r)].valid()) missing.push_back(r);
      }
      return absl::DeadlineExceededError(absl::StrCat("tcp communicator: rank 0 (port ", listener->port_,
                                                      ") waited ", timeout.count(), " ms for rank(s) ",
                                                      absl::StrJoin(missing, ", "), " to connect"));
    }
    std::vector<pollfd> p{{listener->fd_.get(), POLLIN, 0}};
    for (const Pending& q : pending) p.push_back({q.fd.get(), POLLIN, 0});
    if (::poll(p.data(), p.size(), wait) <= 0) continue;  // EINTR, or the deadline (checked above)
    for (size_t k = p.size() - 1; k >= 1; --k) {
      if (p[k].revents == 0) continue;
      Pending& q = pending[k - 1];
      uint8_t buf[kHelloBytes];
      const ssize_t got = ::recv(q.fd.get(), buf, kHelloBytes - q.hello.size(), 0);
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      bool drop = got <= 0;  // closed before its hello was complete
      if (!drop) {
        q.hello.insert(q.hello.end(), buf, buf + got);
        // Without this group's magic and token, a stray: dropped as soon as that shows.
        const size_t magic = std::min<size_t>(q.hello.size(), 8);
        const size_t token_bytes = q.hello.size() > 8 ? std::min<size_t>(q.hello.size() - 8, 8) : 0;
        drop = std::memcmp(q.hello.data(), kMagic, magic) != 0 ||
               std::memcmp(q.hello.data() + 8, token, token_bytes) != 0;
      }
      if (!drop && q.hello.size() == kHelloBytes) {
        const int rank = int(get_u32(q.hello.data() + 16)), peer_size = int(get_u32(q.hello.data() + 20));
        if (peer_size != size || rank < 1 || rank >= size || c->peers_[size_t(rank)].valid()) {
          return absl::InvalidArgumentError(absl::StrCat("tcp communicator: a peer announced rank ", rank,
                                                         " of ", peer_size, " to rank 0 of ", size,
                                                         " (a duplicate, or outside the group)"));
        }
        net::tune_connection(q.fd.get());
        c->peers_[size_t(rank)] = std::move(q.fd);
        ++arrived;
        drop = true;  // no longer pending
      }
      if (drop) pending.erase(pending.begin() + std::ptrdiff_t(k - 1));
    }
    if (p[0].revents & POLLIN) {
      net::UniqueFd fd(::accept4(listener->fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (fd.valid()) {
        if (pending.size() >= net::kMaxPendingHellos) pending.erase(pending.begin());
        pending.push_back({std::move(fd), {}});
      }
    }
  }
  uint8_t ack[kAckBytes] = {};
  std::memcpy(ack, kMagic, 8);
  for (int r = 1; r < size; ++r) {
    if (!net::send_all(c->peers_[size_t(r)].get(), ack, sizeof ack, deadline)) {
      return absl::UnavailableError(
          absl::StrCat("tcp communicator: rank ", r, " left before the group formed"));
    }
  }
  return c;
}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::connect(const std::string& host,
                                                                          const RendezvousId& id, int rank,
                                                                          int size,
                                                                          std::chrono::milliseconds timeout) {
  if (rank < 1 || rank >= size || timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("tcp communicator: rank ", rank, " of ", size,
                                                   " cannot connect (rank 0 accepts; timeout must be > 0)"));
  }
  if (std::memcmp(id.data(), kMagic, 8) != 0) {
    return absl::InvalidArgumentError(
        "tcp communicator: the id is not a tcp communicator's (rank 0 on a GPU?)");
  }
  const int port = int(get_u32(id.data() + 8));
  const auto deadline = after(timeout);
  const std::string me = absl::StrCat("tcp communicator: rank ", rank, " of ", size, " at ", host, ":", port);
  auto fd = net::connect_tcp(host, port, deadline, absl::StrCat(me, ": could not reach rank 0"));
  if (!fd.ok()) return fd.status();
  uint8_t hello[kHelloBytes];
  std::memcpy(hello, kMagic, 8);
  std::memcpy(hello + 8, id.data() + 12, 8);  // the token, as rank 0 wrote it
  put_u32(hello + 16, uint32_t(rank));
  put_u32(hello + 20, uint32_t(size));
  uint8_t ack[kAckBytes];
  if (!net::send_all(fd->get(), hello, sizeof hello, deadline) ||
      net::recv_all(fd->get(), ack, sizeof ack, deadline) != net::RecvResult::ok ||
      std::memcmp(ack, kMagic, 8) != 0) {
    return absl::UnavailableError(absl::StrCat(me, ": rank 0 did not accept this rank"));
  }
  net::tune_connection(fd->get());
  std::unique_ptr<TcpCommunicator> c(new TcpCommunicator(rank, size, timeout));
  c->peers_.push_back(*std::move(fd));
  return c;
}

TcpCommunicator::~TcpCommunicator() = default;

const char* TcpCommunicator::op_name(Op op) const {
  switch (op) {
    case Op::all_reduce_sum:
      return "all_reduce_sum";
    case Op::all_gather:
      return "all_gather";
    case Op::broadcast:
      return "broadcast";
    case Op::barrier:
      return "barrier";
    case Op::error:
      return "error";
  }
  return "?";
}

void TcpCommunicator::abort() {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.ok())
      error_ = absl::AbortedError(absl::StrCat("tcp communicator: rank ", rank_, " was aborted"));
  }
  aborted_ = true;
  for (auto& fd : peers_) {
    if (fd.valid()) ::shutdown(fd.get(), SHUT_RDWR);
  }
}

absl::Status TcpCommunicator::fail(absl::Status st) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.ok()) error_ = st;
  }
  abort();
  return st;
}

absl::Status TcpCommunicator::usable(const char* what) const {
  if (!aborted_.load()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(error_mu_));
  return absl::FailedPreconditionError(absl::StrCat("tcp communicator ", what, " on rank ", rank_,
                                                    ": the group was aborted (", error_.message(), ")"));
}

absl::Status TcpCommunicator::send_to(int peer, const Header& h, const void* data, size_t bytes,
                                      const char* what) {
  uint8_t head[kHeaderBytes] = {};
  put_u32(head, uint32_t(h.op));
  put_u32(head + 4, uint32_t(h.dtype));
  put_u64(head + 8, uint64_t(h.count));
  put_u32(head + 16, uint32_t(h.root));
  put_u64(head + 24, h.seq);
  const int fd = peers_[rank_ == 0 ? size_t(peer) : 0].get();
  const auto deadline = after(timeout_);
  if (!net::send_all(fd, head, sizeof head, deadline) ||
      (bytes > 0 && !net::send_all(fd, data, bytes, deadline))) {
    if (auto st = usable(what); !st.ok()) return st;
    return fail(absl::UnavailableError(absl::StrCat("tcp communicator ", what, " on rank ", rank_,
                                                    ": sending to rank ", peer,
                                                    " failed (its process exited or aborted?)")));
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::recv_from(int peer, Header& h, void* data, size_t bytes, const char* what) {
  const int fd = peers_[rank_ == 0 ? size_t(peer) : 0].get();
  auto lost = [&](net::RecvResult r) {
    if (auto st = usable(what); !st.ok()) return st;
    if (r == net::RecvResult::timeout) {
      return fail(absl::DeadlineExceededError(absl::StrCat(
          "tcp communicator ", what, ": rank ", rank_, " waited ", timeout_.count(), " ms for rank ", peer)));
    }
    return fail(absl::UnavailableError(absl::StrCat("tcp communicator ", what, ": rank ", peer,
                                                    " closed its connection to rank ", rank_,
                                                    " (its process exited, or its group was aborted)")));
  };
  uint8_t head[kHeaderBytes];
  if (auto r = net::recv_all(fd, head, sizeof head, after(timeout_)); r != net::RecvResult::ok)
    return lost(r);
  h.op = Op(get_u32(head));
  h.dtype = DType(get_u32(head + 4));
  h.count = int64_t(get_u64(head + 8));
  h.root = int32_t(get_u32(head + 16));
  h.seq = get_u64(head + 24);
  if (h.op == Op::error) {
    std::string msg(size_t(std::clamp<int64_t>(h.count, 0, kMaxErrorBytes)), '\0');
    if (auto r = net::recv_all(fd, msg.data(), msg.size(), after(timeout_)); r != net::RecvResult::ok)
      return lost(r);
    if (rank_ == 0) {  // only rank 0 reports to the others: this peer is broken or foreign
      return fail(absl::DataLossError(absl::StrCat(
          "tcp communicator ", what, " on rank 0: rank ", peer,
          " sent an error report, which only rank 0 sends: ", net::printable(msg, kMaxErrorBytes))));
    }
    return fail(absl::InvalidArgumentError(net::printable(msg, kMaxErrorBytes)));
  }
  if (bytes > 0) {
    if (auto r = net::recv_all(fd, data, bytes, after(timeout_)); r != net::RecvResult::ok) return lost(r);
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::gather(const Header& mine, const char* what,
                                     std::vector<std::vector<uint8_t>>* in, size_t in_bytes) {
  // Headers first from everyone, so that a disagreement is named in full.
  std::vector<Header> heads(static_cast<size_t>(size_));
  heads[0] = mine;
  for (int r = 1; r < size_; ++r) {
    if (auto st = recv_from(r, heads[size_t(r)], nullptr, 0, what); !st.ok()) return st;
    const Header& h = heads[size_t(r)];
    const bool agree =
        h.op == mine.op && h.seq == mine.seq &&
        (mine.op == Op::barrier ||
         (h.count == mine.count && (mine.op == Op::broadcast ? h.root == mine.root : h.dtype == mine.dtype)));
    if (!agree) {
      std::vector<std::string> calls;
      for (int k = 0; k <= r; ++k) {
        const Header& x = heads[size_t(k)];
        calls.push_back(absl::StrCat("rank ", k, " ", op_name(x.op), " #", x.seq, "(",
                                     x.op == Op::broadcast ? absl::StrCat(x.count, " bytes, root ", x.root)
                                     : x.op == Op::barrier
                                         ? std::string()
                                         : absl::StrCat("count ", x.count, ", ", to_string(x.dtype)),
                                     ")"));
      }
      const std::string msg =
          absl::StrCat("tcp communicator: ranks disagree on the collective: ", absl::StrJoin(calls, "; "));
      Header err;
      err.op = Op::error;
      err.count = int64_t(msg.size());
      for (int k = 1; k < size_; ++k) (void)send_to(k, err, msg.data(), msg.size(), what);
      return fail(absl::InvalidArgumentError(msg));
    }
    // The contribution follows its header on the same connection.
    const bool sends = in != nullptr && (mine.op != Op::broadcast || mine.root == r);
    if (sends && in_bytes > 0) {
      auto& buf = (*in)[size_t(r)];
      buf.resize(in_bytes);
      const int fd = peers_[size_t(r)].get();
      if (net::recv_all(fd, buf.data(), in_bytes, after(timeout_)) != net::RecvResult::ok) {
        if (auto st = usable(what); !st.ok()) return st;
        return fail(absl::UnavailableError(
            absl::StrCat("tcp communicator ", what, ": rank ", r, " closed its connection mid-message")));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::all_reduce_sum(void* buf, int64_t count, DType dtype) {
  if (auto st = check_collective_args("all_reduce_sum", buf, count, *this); !st.ok()) return fail(st);
  if (auto st = usable("all_reduce_sum"); !st.ok()) return st;
  const Header h{Op::all_reduce_sum, dtype, count, 0, seq_++};
  const size_t bytes = size_t(count) * dtype_size(dtype);
  if (rank_ != 0) {
    if (auto st = send_to(0, h, buf, bytes, "all_reduce_sum"); !st.ok()) return st;
    Header reply;
    return recv_from(0, reply, buf, bytes, "all_reduce_sum");
  }
  if (auto st = gather(h, "all_reduce_sum", &scratch_, bytes); !st.ok()) return st;
  // Rank order, as CpuCommGroup: element i is ((x_0 + x_1) + x_2) ... in fp32, written in
  // place (each element is read before it is written).
  if (dtype == DType::f32) {
    std::vector<const float*> in{static_cast<const float*>(buf)};
    for (int r = 1; r < size_; ++r) in.push_back(reinterpret_cast<const float*>(scratch_[size_t(r)].data()));
    reference_sum_f32(in, count, static_cast<float*>(buf));
  } else {
    std::vector<const uint16_t*> in{static_cast<const uint16_t*>(buf)};
    for (int r = 1; r < size_; ++r)
      in.push_back(reinterpret_cast<const uint16_t*>(scratch_[size_t(r)].data()));
    reference_sum_bf16(in, count, static_cast<uint16_t*>(buf));
  }
  for (int r = 1; r < size_; ++r) {
    if (auto st = send_to(r, h, buf, bytes, "all_reduce_sum"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) {
  if (auto st = check_collective_args("all_gather", send, count_per_rank, *this); !st.ok()) return fail(st);
  if (auto st = check_collective_args("all_gather", recv, count_per_rank, *this); !st.ok()) return fail(st);
  if (auto st = usable("all_gather"); !st.ok()) return st;
  const Header h{Op::all_gather, dtype, count_per_rank, 0, seq_++};
  const size_t bytes = size_t(count_per_rank) * dtype_size(dtype);
  auto* out = static_cast<uint8_t*>(recv);
  if (rank_ != 0) {
    if (auto st = send_to(0, h, send, bytes, "all_gather"); !st.ok()) return st;
    Header reply;
    return recv_from(0, reply, out, bytes * size_t(size_), "all_gather");
  }
  if (auto st = gather(h, "all_gather", &scratch_, bytes); !st.ok()) return st;
  if (bytes > 0 && out != send) std::memmove(out, send, bytes);
  for (int r = 1; r < size_; ++r) {
    if (bytes > 0) std::memcpy(out + size_t(r) * bytes, scratch_[size_t(r)].data(), bytes);
  }
  for (int r = 1; r < size_; ++r) {
    if (auto st = send_to(r, h, out, bytes * size_t(size_), "all_gather"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::broadcast(void* buf, int64_t bytes, int root) {
  if (auto st = check_collective_args("broadcast", buf, bytes, *this); !st.ok()) return fail(st);
  if (auto st = check_root("broadcast", root, *this); !st.ok()) return fail(st);
  if (auto st = usable("broadcast"); !st.ok()) return st;
  const Header h{Op::broadcast, DType::f32, bytes, root, seq_++};
  if (rank_ != 0) {
    const bool mine = rank_ == root;
    if (auto st = send_to(0, h, buf, mine ? size_t(bytes) : 0, "broadcast"); !st.ok()) return st;
    Header reply;
    return recv_from(0, reply, buf, mine ? 0 : size_t(bytes), "broadcast");
  }
  if (auto st = gather(h, "broadcast", &scratch_, size_t(bytes)); !st.ok()) return st;
  if (root != 0 && bytes > 0) std::memcpy(buf, scratch_[size_t(root)].data(), size_t(bytes));
  for (int r = 1; r < size_; ++r) {
    if (auto st = send_to(r, h, buf, r == root ? 0 : size_t(bytes), "broadcast"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::barrier() {
  if (auto st = usable("barrier"); !st.ok()) return st;
  const Header h{Op::barrier, DType::f32, 0, 0, seq_++};
  if (rank_ != 0) {
    if (auto st = send_to(0, h, nullptr, 0, "barrier"); !st.ok()) return st;
    Header reply;
    return recv_from(0, reply, nullptr, 0, "barrier");
  }
  if (auto st = gather(h, "barrier", nullptr, 0); !st.ok()) return st;
  for (int r = 1; r < size_; ++r) {
    if (auto st = send_to(r, h, nullptr, 0, "barrier"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
