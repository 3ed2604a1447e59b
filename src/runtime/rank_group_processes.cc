// A group across processes (docs/tensor-parallel.md#spanning-processes-and-nodes): how the
// group (src/runtime/rank_group.h) forms — the rendezvous, then the communicators; a process
// holds one rank or several consecutive ones, each on its own thread and device — the
// leader's commands to the other processes and a follower's loop that runs them on every
// rank it holds.
//
// Rank 0 (the leader) is an ordinary engine: scheduler, page allocator, gRPC service.
// Its pool records the SWA table changes of its allocations; each forward pass goes to
// every follower as a command (the batch, the options, those changes) before the leader
// runs its own part, so that all ranks run the step at once and meet in its collectives.
// No rank waits for an answer: a follower speaks only to report its failure.
#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"
#include "src/parallel/init_watch.h"
#include "src/parallel/rendezvous.h"
#include "src/parallel/tcp_communicator.h"
#include "src/runtime/rank_commands.h"
#include "src/runtime/rank_group.h"

#include <vector>
#include "src/runtime/rank_links.h"
#if defined(KVFUSE_HAVE_GPU)
#include "src/parallel/nccl_communicator.h"
#endif

namespace kvfuse {

namespace {

// What every process of the group must have the same, as "key=value" lines: the
// rendezvous refuses a process whose lines differ, naming each key with both values.
// Per-process keys (tp_rank, devices) and the per-step paths (kv_write, attention,
// graphs: the leader sends them with every step) are left out.
std::string group_fingerprint(const Config& cfg, const ModelSpec& s, const KvPoolConfig& pc, Device device) {
  std::vector<std::string> lines;
  auto add = [&](const char* key, const auto& value) { lines.push_back(absl::StrCat(key, "=", value)); };
  add("kvfuse_version", KVFUSE_VERSION);
  add("device", to_string(device));
  add("model", s.name);
  add("weights", cfg.model_path.empty() ? absl::StrCat("synthetic, seed ", cfg.seed) : "model_path");
  add("shape",
      absl::StrFormat("vocab %d hidden %d intermediate %d layers %d heads %d/%d head_dim %d", s.vocab,
                      s.hidden, s.intermediate, s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim));
  add("sliding_window", s.sliding_window);
  std::string swa;
  for (bool b : s.layer_is_swa) swa += b ? '1' : '0';
  add("swa_layers", swa.empty() ? "none" : swa);
  add("tensor_parallel", cfg.tensor_parallel);
  add("kv_cache_dtype", kv_format_name(pc.format));
  add("page_size", pc.page_size);
  add("num_pages", pc.num_pages);
  add("swa_num_pages", pc.swa_num_pages);
  auto scales = [](const std::vector<float>& v) {
    return absl::StrJoin(v, ",", [](std::string* out, float x) { absl::StrAppendFormat(out, "%.9g", x); });
  };
  add("k_scale", scales(pc.k_scale));
  add("v_scale", scales(pc.v_scale));
  add("max_batch_tokens", cfg.max_batch_tokens);
  add("max_running_seqs", cfg.max_running_seqs);
  add("max_seq_len", cfg.max_seq_len);
  return absl::StrJoin(lines, "\n");
}

}  // namespace

absl::Status RankGroup::form_process_group(const ModelSpec& s, const KvPoolConfig& pc) {
  const int32_t tp = cfg_.tensor_parallel;
  const int32_t first = cfg_.tp_rank;  // this process's ranks: first .. first + local - 1
  KVFUSE_RETURN_IF_ERROR(check_shard(s, pc.format));
  KVFUSE_RETURN_IF_ERROR(backend0_.bind_thread());
  KVFUSE_RETURN_IF_ERROR(start_local_ranks());
  const int32_t local = num_local_ranks();
  auto host_port = parse_host_port(cfg_.tp_rendezvous);
  if (!host_port.ok()) return host_port.status();
  const std::string& host = host_port->first;
  const auto timeout = std::chrono::milliseconds(int64_t(cfg_.tp_rendezvous_timeout_s) * 1000);

  RendezvousOptions ro;
  ro.address = cfg_.tp_rendezvous;
  ro.world_size = tp;
  ro.rank = first;
  ro.ranks = local;
  ro.timeout = timeout;
  ro.fingerprint = group_fingerprint(cfg_, s, pc, backend0_.device());
  const bool cpu = backend0_.device() == Device::cpu;

  // The rendezvous hands out the communicator's id: NCCL's unique id on GPUs, the TCP
  // communicator's port and token on the CPU (rank 0 listens for it from before). The
  // connections to the other processes stay in follower_fds_ (rank 0) or leader_fd_.
  std::unique_ptr<TcpCommListener> listener;
  RendezvousId id{};
#if defined(KVFUSE_HAVE_GPU)
  const nccl::NcclLibrary* lib = nullptr;
  if (!cpu) {
    auto l = nccl::NcclLibrary::load();
    if (!l.ok()) return l.status();
    lib = *l;
    collectives_library_ = lib->description();
  }
#endif
  if (first == 0) {
    auto server = RendezvousServer::listen(ro);
    if (!server.ok()) return server.status();
    if (cpu) {
      auto l = TcpCommListener::open(host);
      if (!l.ok()) return l.status();
      listener = std::move(*l);
      id = listener->id();
    } else {
#if defined(KVFUSE_HAVE_GPU)
      auto nid = NcclCommunicator::unique_id(*lib);
      if (!nid.ok()) return nid.status();
      std::memcpy(id.data(), nid->internal, id.size());
#else
      return absl::FailedPreconditionError("tensor parallelism on a GPU needs a GPU build");
#endif
    }
    auto fds = (*server)->serve_group(id);
    if (!fds.ok()) return fds.status();
    follower_fds_ = std::move(*fds);
  } else {
    auto m = rendezvous_join_group(ro);
    if (!m.ok()) return m.status();
    id = m->id;
    leader_fd_ = std::move(m->leader);
  }

  // Every local rank's communicator at once, each on its rank's thread: rank 0's TCP
  // accept waits for the connections of the other ranks (its own process's among them),
  // and NCCL's init for the whole group.
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(local));
  // NCCL's set-up waits for every rank of the group: a rank of this process that fails, or
  // another process whose connection closes, stops the wait (so does the timeout).
  std::vector<GroupInitWatch::Peer> peers;
  if (first == 0) {
    for (size_t r = 0; r < follower_fds_.size(); ++r) {
      if (follower_fds_[r].valid()) peers.push_back({follower_fds_[r].get(), absl::StrCat("rank ", r, "'s process")});
    }
  } else {
    peers.push_back({leader_fd_.get(), absl::StrCat("rank 0's process (", cfg_.tp_rendezvous, ")")});
  }
  GroupInitWatch watch(timeout, std::move(peers));
  KVFUSE_RETURN_IF_ERROR(for_each_rank(
      [&](int32_t r) -> absl::Status {
        const int32_t rank = first + r;
        if (cpu) {
          auto c = rank == 0 ? TcpCommunicator::accept(std::move(listener), tp, timeout)
                             : TcpCommunicator::connect(host, id, rank, tp, timeout);
          if (!c.ok()) return c.status();
          comms[size_t(r)] = std::move(*c);
          return absl::OkStatus();
        }
#if defined(KVFUSE_HAVE_GPU)
        nccl::ncclUniqueId nid;
        std::memcpy(nid.internal, id.data(), id.size());
        auto c = NcclCommunicator::create(*lib, nid, rank, tp, cfg_.tp_device(r), backend(r).native_stream(),
                                          watch.for_rank(rank));
        if (!c.ok()) return watch.failed(rank, c.status());
        comms[size_t(r)] = std::move(*c);
        return absl::OkStatus();
#else
        return absl::FailedPreconditionError("tensor parallelism on a GPU needs a GPU build");
#endif
      },
      false));
  take_communicators(std::move(comms));
  return absl::OkStatus();
}

void RankGroup::link_processes(KvPool& pool) {
  const auto timeout = std::chrono::milliseconds(int64_t(cfg_.tp_rendezvous_timeout_s) * 1000);
  // From here a process that goes away aborts this one's communicators at once.
  if (cfg_.tp_rank == 0) {
    follower_links_ =
        std::make_unique<FollowerLinks>(std::move(follower_fds_), timeout, [this] { abort_communicators(); });
    follower_fds_.clear();
    // Rank 0 allocates the pages of every rank and sends the SWA table changes with each step.
    pool.track_swa_changes();
  } else {
    leader_link_ = std::make_unique<LeaderLink>(std::move(leader_fd_), cfg_.tp_rendezvous,
                                                [this] { abort_communicators(); });
  }
}

absl::Status RankGroup::post_to_followers(RankCommand command, const std::vector<uint8_t>& payload) {
  if (!failed_.ok()) return failed_;
  absl::Status st = follower_links_->failure();
  if (st.ok()) st = follower_links_->post(rank_frame(command, payload));
  if (!st.ok()) return fail_group(st);
  return absl::OkStatus();
}

absl::Status RankGroup::follow(KvPool& pool, ForwardBatch& batch, ForwardResult& fwd0) {
  if (!is_follower()) {
    return absl::FailedPreconditionError(
        "follow: only a process whose tp_rank is not 0 (with tp_rendezvous) follows");
  }
  ForwardOptions opts;
  std::vector<SwaPageMapping> swa;
  for (;;) {
    auto m = leader_link_->next();
    if (!m.ok()) {
      comm0_->abort();
      return m.status();
    }
    absl::Status st;
    switch (m->command) {
      case RankCommand::forward:
        st = decode_forward(m->payload, batch, opts, swa);
        if (st.ok()) st = pool.apply_swa_changes(swa);
        if (st.ok())
          st = for_each_rank([&](int32_t r) { return run_pass(r, batch, pool, opts, fwd0); }, true);
        break;
      case RankCommand::collectives: {
        int32_t tokens = 0, reps = 0;
        std::vector<double> ms(size_t(num_local_ranks()), 0.0);  // one per rank thread: no shared write
        st = decode_collectives(m->payload, tokens, reps);
        if (st.ok())
          st = for_each_rank([&](int32_t r) { return run_collectives(r, tokens, reps, ms[size_t(r)]); }, true);
        break;
      }
      case RankCommand::end_gemm_tuning:
        for (int32_t r = 0; r < num_local_ranks(); ++r) (void)backend(r).end_gemm_tuning();
        break;
      case RankCommand::shutdown:
        return absl::OkStatus();
      default:
        st = absl::DataLossError(
            absl::StrCat("rank 0 sent an unexpected ", to_string(m->command), " command"));
    }
    if (!st.ok()) {
      absl::Status failed(st.code(), absl::StrCat(to_string(m->command), " failed: ", st.message()));
      (void)fail_group(failed);  // aborts this rank's communicator: rank 0's collectives end too
      leader_link_->report(failed);
      // A collective cut short because rank 0 went away: say so, not only what it cut (the
      // watcher may see the connection close a moment after the collective does).
      if (absl::Status gone = leader_link_->hangup(std::chrono::milliseconds(500)); !gone.ok()) {
        failed = absl::UnavailableError(absl::StrCat(gone.message(), "; ", failed.message()));
      }
      return failed;
    }
  }
}

}  // namespace kvfuse
