// The tensor-parallel ranks of an engine (docs/tensor-parallel.md): the ranks this process
// runs beside its first one (each a thread, a backend, a communicator, a model shard and a
// runner), every local rank's communicator, and, when the group spans processes, the
// control connections to the other processes (FollowerLinks on rank 0's process, a
// LeaderLink on a follower's) and the RankCommand protocol over them.
//
// The engine (src/runtime/engine.h) runs the step; it owns the pool, its backend (this
// process's first rank's) and that rank's model and runner, and asks the group to run a
// pass, or anything else every rank must do at once, on all ranks. At tensor_parallel 1
// the group is empty: one rank, no communicator, no thread.
//
// Files: rank_group.cc (running on every rank, failures, the collectives benchmark),
// rank_group_setup.cc (forming the group in one process, the models and weights),
// rank_group_processes.cc (a group across processes: the rendezvous, the followers' loop).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/common/arith.h"
#include "src/loading/config.h"
#include "src/loading/model_spec.h"
#include "src/parallel/communicator.h"
#include "src/parallel/socket_io.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/model.h"
#include "src/runtime/model_runner.h"
#include "src/runtime/rank_thread.h"

namespace kvfuse {

class FollowerLinks;
class LeaderLink;
enum class RankCommand : uint32_t;

// The runner's size limits from the engine's config (every rank's runner has the same).
inline ModelLimits model_limits(const Config& cfg) {
  ModelLimits limits;
  limits.max_tokens = cfg.max_batch_tokens;
  limits.max_seqs = cfg.max_running_seqs;
  limits.max_pages_per_seq = int32_t(ceil_div(cfg.max_seq_len, cfg.page_size));
  return limits;
}

class RankGroup {
 public:
  // The group of an engine whose config is `cfg` and whose first local rank runs on
  // `backend0`; both are the engine's and outlive the group.
  RankGroup(const Config& cfg, Backend& backend0);
  ~RankGroup();  // stop(), if the engine did not
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  // --- Set-up, at tensor_parallel > 1, in this order ---
  // Forms the group the config asks for, with every local rank's communicator: rank 0
  // alone (Config::tp_rank_alone), every rank in this process, or this process's ranks of
  // a group across processes (tp_rendezvous; `pc` goes into the group's fingerprint).
  absl::Status form(const ModelSpec& spec, const KvPoolConfig& pc);
  // One rank's shard of the model (its heads: the pool's num_kv_heads), once formed.
  const TensorParallelShard& shard() const { return shard_; }
  // Every local rank's storage in `pool` (a pool of num_local_ranks() storages) and model
  // shard; rank 0's model is returned (the engine owns it, the group keeps a pointer).
  // Across processes the control connections start here: from now on a process that goes
  // away aborts this one's communicators, and rank 0's pool records its SWA changes.
  absl::StatusOr<std::unique_ptr<Model>> add_models(const ModelSpec& spec, KvPool& pool);
  // Every rank's weights, read once from `weights` (`after_layer(n)` once n layers are on
  // every rank), then every local rank's runner; rank 0's is returned (the engine owns it,
  // the group keeps a pointer).
  absl::StatusOr<std::unique_ptr<ModelRunner>> load_weights(HostWeightSource& weights,
                                                            const std::function<void(int32_t)>& after_layer);
  // The engine's creation failed: the other processes that joined see their connections
  // close, without the shutdown command stop() sends.
  void drop_links();
  // Before the engine releases rank 0's runner and model and the pool: the followers are
  // sent the shutdown command (they exit cleanly), then every other local rank's objects
  // are released on its own thread (its device current) and the threads stop. Rank 0's
  // communicator stays until the group goes.
  void stop();

  // --- The group ---
  int32_t num_local_ranks() const { return 1 + int32_t(ranks_.size()); }
  Backend& backend(int32_t local_rank);
  // One rank in this process and no other process to send to (tensor_parallel 1, rank 0
  // alone, or a follower holding one rank): the engine launches the pass on rank 0 itself.
  bool single_rank() const { return ranks_.empty() && !follower_links_; }
  bool is_follower() const { return leader_link_ != nullptr; }
  // OK, or why the group was aborted (a rank failed mid-step); every later run is refused
  // with it (FAILED_PRECONDITION).
  const absl::Status& failure() const { return failed_; }
  const std::string& collectives_path() const { return collectives_path_; }
  const std::string& collectives_library() const { return collectives_library_; }

  // --- Work on every rank (rank 0's process) ---
  // One forward pass of `batch` on every rank: sent to the followers first (with the SWA
  // table changes `pool` recorded), then run to the end by every local rank at once, rank
  // 0's on the calling thread into `fwd0`. A rank that fails aborts the group.
  absl::Status forward(const ForwardBatch& batch, KvPool& pool, const ForwardOptions& opts,
                       ForwardResult& fwd0);
  // Backend::end_gemm_tuning on every rank, here and in the followers; rank 0's answer.
  // FAILED_PRECONDITION on a follower.
  absl::StatusOr<bool> end_gemm_tuning();
  // Engine::collectives_ms: the preconditions, then every rank's timing; rank 0's.
  absl::StatusOr<double> collectives_ms(int32_t tokens, int reps);
  // A follower's loop (Engine::follow): runs rank 0's commands on every local rank, the
  // passes over `batch` (decoded into it) with `pool`, rank 0's result into `fwd0`.
  absl::Status follow(KvPool& pool, ForwardBatch& batch, ForwardResult& fwd0);

 private:
  // A local rank other than 0: its thread, device, communicator and model.
  struct Rank {
    std::unique_ptr<RankThread> thread;
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Communicator> comm;
    std::unique_ptr<Model> model;
    std::unique_ptr<ModelRunner> runner;
    ForwardResult fwd;
  };

  // rank_group.cc
  // Runs f(rank) for every local rank at once, rank 0 on the calling thread, the others on
  // their threads; the first error. With abort_on_error, a failing rank aborts the group so
  // that no rank waits on it in a collective, and later runs are refused.
  absl::Status for_each_rank(const std::function<absl::Status(int32_t)>& f, bool abort_on_error);
  // Aborts every local rank's communicator: no rank waits on another any more.
  void abort_communicators();
  // Marks the group failed (later runs are refused naming `cause`), aborting every local
  // communicator; returns `cause`.
  absl::Status fail_group(absl::Status cause);
  Communicator& comm(int32_t local_rank);
  Model& model(int32_t local_rank);
  // One local rank's pass over `batch`, then its communicator's asynchronous error (a
  // collective that failed on the device after its launch fails the pass).
  absl::Status run_pass(int32_t local_rank, const ForwardBatch& batch, KvPool& pool,
                        const ForwardOptions& opts, ForwardResult& fwd0);
  // One rank's part of collectives_ms.
  absl::Status run_collectives(int32_t local_rank, int32_t tokens, int reps, double& ms);

  // rank_group_setup.cc
  // The shard of a rank, once its shapes are known to run on the backend; into shard_.
  absl::Status check_shard(const ModelSpec& spec, KvFormat format);
  // This process's ranks other than its first (threads, backends: cfg_.tp_local_ranks()).
  absl::Status start_local_ranks();
  // Every rank in this process; rank 0 alone.
  absl::Status form_in_process(const ModelSpec& spec, KvFormat format);
  absl::Status form_rank_alone(const ModelSpec& spec, KvFormat format);
  // Keeps the local ranks' communicators (element r is local rank r's).
  void take_communicators(std::vector<std::unique_ptr<Communicator>> comms);
  // comms.size() CPU communicators of one new group, rank order (the CPU ranks, or
  // tp_share_gpu's host meetings); the group in comm_group_.
  absl::Status cpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms);
  // GPU ranks: puts the peer all-reduce (src/parallel/peer_allreduce.h) in front of each
  // rank's NCCL communicator where it applies; sets collectives_path_.
  absl::Status use_peer_allreduce(std::vector<std::unique_ptr<Communicator>>& comms);
  // Config::tp_share_gpu: every rank's communicator over one peer group whose ranks share
  // the GPU (SharedGpuCommunicator); sets collectives_path_.
  absl::Status share_gpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms);

  // rank_group_processes.cc
  // This process's ranks of a group across processes: the rendezvous (rank 0 keeps a
  // connection to each other process, in follower_fds_; a follower its leader_fd_) and
  // the communicators.
  absl::Status form_process_group(const ModelSpec& spec, const KvPoolConfig& pc);
  // The control connections, once every local rank's model exists (add_models).
  void link_processes(KvPool& pool);
  // Rank 0's process: sends a command to every follower before its own ranks run it. A
  // follower that already failed, or cannot be reached, fails the group.
  absl::Status post_to_followers(RankCommand command, const std::vector<uint8_t>& payload);

  const Config& cfg_;
  Backend& backend0_;
  Model* model0_ = nullptr;         // the engine's, from add_models
  ModelRunner* runner0_ = nullptr;  // the engine's, from load_weights
  TensorParallelShard shard_;
  std::unique_ptr<Communicator> comm0_;  // rank 0's, at tensor_parallel > 1
  std::vector<std::unique_ptr<Rank>> ranks_;  // local ranks 1 ..
  std::shared_ptr<void> comm_group_;          // the CPU ranks' group (or tp_share_gpu's host meeting)
  std::string collectives_path_;
  std::string collectives_library_;
  absl::Status failed_;  // a rank failed mid-step: the group is aborted
  // Across processes: the rendezvous's connections until add_models links them, then the
  // links (a leader's to the other processes, a follower's to the leader).
  std::vector<net::UniqueFd> follower_fds_;
  net::UniqueFd leader_fd_;
  std::unique_ptr<FollowerLinks> follower_links_;
  std::unique_ptr<LeaderLink> leader_link_;
};

}  // namespace kvfuse
