// Tensor parallelism on the CPU backend across processes (or nodes): a star of TCP
// connections through rank 0. Every collective sends each rank's header and contribution
// to rank 0, which checks that the ranks agree (collective, count, dtype, root), computes
// the result and sends each rank its part. all_reduce_sum is the CPU communicator's sum
// (src/parallel/cpu_communicator.h: fp32 in rank order, bf16 widened and rounded once), so
// a group of processes computes the bits a group of threads does.
//
// Set-up: rank 0 opens a TcpCommListener on the rendezvous host; its id (port and a random
// token) travels to the other ranks through the rendezvous (src/parallel/rendezvous.h) as
// NCCL's unique id does, and each connects back to the same host.
//
// Failures: a rank's abort(), a peer that closes its connection (a process that exited or
// aborted), ranks that disagree, or a wait longer than the timeout end the collective with
// an error on every rank: rank 0 closes every connection, so nobody waits forever.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/parallel/communicator.h"
#include "src/parallel/rendezvous.h"
#include "src/parallel/socket_io.h"

namespace kvfuse {

// Rank 0's listening socket, open from before the rendezvous until the group has formed.
class TcpCommListener {
 public:
  // Binds `host` (the rendezvous host: the other ranks reach rank 0 there) on a free port.
  static absl::StatusOr<std::unique_ptr<TcpCommListener>> open(const std::string& host);
  // What the other ranks need: magic, port, token.
  const RendezvousId& id() const { return id_; }
  int port() const { return port_; }

 private:
  friend class TcpCommunicator;
  TcpCommListener() = default;
  net::UniqueFd fd_;
  int port_ = 0;
  uint64_t token_ = 0;
  RendezvousId id_{};
};

class TcpCommunicator final : public Communicator {
 public:
  // Rank 0: waits until ranks 1 .. size-1 have connected (stray connections without the
  // id's token are dropped). DEADLINE_EXCEEDED naming the missing ranks after `timeout`,
  // which also bounds every later wait for a peer.
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> accept(std::unique_ptr<TcpCommListener> listener,
                                                                 int size, std::chrono::milliseconds timeout);
  // Rank `rank` >= 1: connects to rank 0 at `host` and the id's port.
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> connect(const std::string& host,
                                                                  const RendezvousId& id, int rank, int size,
                                                                  std::chrono::milliseconds timeout);
  ~TcpCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "tcp"; }
  absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) override;
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override;
  absl::Status broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status barrier() override;
  // Shuts every connection down (safe from another thread while a collective waits): the
  // waiting call and every later one here fail, and so do the peers' (rank 0's closed
  // connections end theirs; a peer's closed connection ends rank 0's, which closes the rest).
  void abort() override;

 private:
  enum class Op : uint32_t { all_reduce_sum = 1, all_gather, broadcast, barrier, error };
  struct Header {
    Op op = Op::barrier;
    DType dtype = DType::f32;
    int64_t count = 0;  // elements; bytes for broadcast; message bytes for error
    int32_t root = 0;
    uint64_t seq = 0;  // collectives so far on this communicator
  };
  TcpCommunicator(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {}
  // Rank 0: every peer's header, checked against `mine` (a disagreement is sent to every
  // peer and fails the group), and each contributing peer's `in_bytes` into (*in)[r]
  // (null: no payloads; a broadcast's only contributor is its root).
  absl::Status gather(const Header& mine, const char* what, std::vector<std::vector<uint8_t>>* in,
                      size_t in_bytes);
  // One header and `bytes` of data to / from a peer (rank 0: any; others: only 0).
  absl::Status send_to(int peer, const Header& h, const void* data, size_t bytes, const char* what);
  absl::Status recv_from(int peer, Header& h, void* data, size_t bytes, const char* what);
  // Records the first failure and aborts: every peer's wait ends too.
  absl::Status fail(absl::Status st);
  absl::Status usable(const char* what) const;
  const char* op_name(Op op) const;

  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  // Rank 0: [size], element r the connection to rank r (0 unused). Others: [1], to rank 0.
  std::vector<net::UniqueFd> peers_;
  uint64_t seq_ = 0;
  std::atomic<bool> aborted_{false};
  std::mutex error_mu_;
  absl::Status error_;                         // the first failure: later calls return it
  std::vector<std::vector<uint8_t>> scratch_;  // rank 0: the peers' contributions
};

}  // namespace kvfuse
