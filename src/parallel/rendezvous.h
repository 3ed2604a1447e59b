// Rendezvous of the ranks of a tensor-parallel group that spans processes or nodes: they
// must agree on one opaque 128-byte id (NCCL's ncclUniqueId) before ncclCommInitRank.
// A process holds one rank or several consecutive ones (a node's GPUs). Rank 0's process
// listens on a TCP address (config key tp_rendezvous), makes the id, and waits until the
// other processes have connected and announced their ranks, every rank of the world
// held once; only then does it send the id to all of them, so that a misconfigured group
// fails everywhere with one message instead of hanging in NCCL. Plain POSIX sockets, one
// thread.
//
// Wire format (integers big-endian):
//   hello, peer -> rank 0:  "KVFUSETP" u32 version u32 world_size u32 first rank
//                           u32 ranks u32 length, fingerprint (length bytes)
//   reply, rank 0 -> peer:  "KVFUSETP" u32 version u32 code u32 length, payload
// code 0 (OK) carries the id; any other code is an absl::StatusCode with its message.
// A connection that does not open with the magic (a port scanner, a stray client) is
// closed and ignored; a peer that announces another version, another world size, ranks
// outside [1, world_size), a rank that another process holds or another config
// fingerprint fails the whole rendezvous.
//
// The fingerprint is what the ranks must agree on, as "key=value" lines (the engine sends
// its model's shape, the pool's geometry, the KV dtype...); a mismatch names each key
// with both values. serve_group/rendezvous_join_group keep the connections open
// afterwards: the engine's rank 0 sends its commands to the other ranks over them.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/parallel/socket_io.h"

namespace kvfuse {

constexpr size_t kRendezvousIdBytes = 128;
using RendezvousId = std::array<uint8_t, kRendezvousIdBytes>;

struct RendezvousOptions {
  std::string address;  // host:port ([v6]:port); rank 0 listens there (port 0: any free port)
  int world_size = 1;
  int rank = 0;   // this process's first rank
  int ranks = 1;  // how many consecutive ranks from `rank` this process holds
  // How long rank 0 waits for all peers, and a peer for rank 0 (retrying while it is not
  // listening yet) and its answer.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // "key=value" lines every rank must have the same (at most 4096 bytes); "" checks nothing
  // beyond the world size, as long as every rank sends "".
  std::string fingerprint;
};

// "host:port" or "[v6 address]:port", port in [0, 65535]. INVALID_ARGUMENT otherwise.
absl::StatusOr<std::pair<std::string, int>> parse_host_port(const std::string& address);

// Rank 0's side: listen() binds at once (so peers may connect before serve()), serve()
// does the rendezvous.
class RendezvousServer {
 public:
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> listen(const RendezvousOptions& options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // The bound port (the chosen one when the address asked for port 0).
  int port() const { return port_; }
  // Waits for every peer, then sends each the id. DEADLINE_EXCEEDED naming the address and
  // the ranks that arrived when the timeout passes first; the peers' own errors otherwise.
  absl::Status serve(const RendezvousId& id);
  // The same, keeping each peer's connection open: element r is that of the process
  // whose first rank is r, empty for every other r (rank 0's among them). The peers'
  // ends are what rendezvous_join_group returns.
  absl::StatusOr<std::vector<net::UniqueFd>> serve_group(const RendezvousId& id);

 private:
  absl::Status serve_impl(const RendezvousId& id, std::vector<net::UniqueFd>* keep);
  RendezvousServer(RendezvousOptions options, net::UniqueFd fd, int port)
      : options_(std::move(options)), fd_(std::move(fd)), port_(port) {}
  RendezvousOptions options_;
  net::UniqueFd fd_;
  int port_ = 0;
};

// A peer's side (first rank >= 1): connects to rank 0 (retrying until the timeout while
// nothing listens there), announces its ranks and returns the id.
absl::StatusOr<RendezvousId> rendezvous_join(const RendezvousOptions& options);
// The same, keeping the connection to rank 0 open.
struct RendezvousMember {
  RendezvousId id;
  net::UniqueFd leader;
};
absl::StatusOr<RendezvousMember> rendezvous_join_group(const RendezvousOptions& options);

// Either side, by options.rank: rank 0 listens, calls make_id and serves it; the others join.
absl::StatusOr<RendezvousId> rendezvous(const RendezvousOptions& options,
                                        const std::function<absl::StatusOr<RendezvousId>()>& make_id);

}  // namespace kvfuse
