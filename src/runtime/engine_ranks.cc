// Tensor parallelism inside one process (docs/tensor-parallel.md#in-one-process): the engine's
// ranks other than 0 (a thread, a backend, a communicator, a model shard and a runner
// each), made and loaded at creation; every call that runs on all ranks at once
// (for_each_rank); the group's failure handling; the collectives benchmark; and rank 0
// alone (Config::tp_rank_alone), for timing a rank's work on one device. The step
// itself is src/runtime/engine.cc's; across processes, src/runtime/engine_group.cc.
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/init_watch.h"
#include "src/runtime/engine.h"
#include "src/runtime/engine_rank.h"
#include "src/runtime/rank_commands.h"
#include "src/runtime/rank_links.h"
#include "src/common/timing.h"
#if defined(KVFUSE_HAVE_GPU)
#include "src/parallel/nccl_communicator.h"
#include "src/parallel/peer_allreduce.h"
#endif

namespace kvfuse {

namespace {
#if defined(KVFUSE_HAVE_GPU)
// The engine's peer group: programmatic launches unless KVFUSE_PEER_PDL=0, inboxes for
// tp_allreduce push. kPushPath: what collectives_path() says of push.
PeerAllReduceOptions peer_options(const Config& cfg) {
  PeerAllReduceOptions options;
  options.pdl = peer_allreduce_pdl_by_env();
  options.push = cfg.tp_allreduce == TpAllReduce::push;
  return options;
}
constexpr char kPushPath[] = "; tp_allreduce push: row-parallel partial sums pushed into the norms";
#endif

// Rank 0 of a group of `size` whose other ranks do not exist (Config::tp_rank_alone): each
// collective does only what keeps this rank's own work well-formed, on the backend's stream
// (so a graph records it). An all-reduce leaves this rank's partial sum in place; a gather
// places this rank's part and zeroes the others' (the sampler then reads finite logits);
// a broadcast from this rank is already everywhere, from another root it is refused.
class LoneRankCommunicator final : public Communicator {
 public:
  LoneRankCommunicator(int32_t size, Backend& backend) : size_(size), backend_(backend) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  const char* name() const override { return "none (rank 0 alone)"; }
  absl::Status all_reduce_sum(void* buf, int64_t count, DType) override {
    KVFUSE_RETURN_IF_ERROR(check_collective_args("all_reduce_sum", buf, count, *this));
    return aborted_ ? aborted() : absl::OkStatus();
  }
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override {
    KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", send, count_per_rank, *this));
    KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", recv, count_per_rank, *this));
    if (aborted_) return aborted();
    const size_t part = size_t(count_per_rank) * dtype_size(dtype);
    if (part == 0) return absl::OkStatus();
    auto* out = static_cast<uint8_t*>(recv);
    if (send != out) KVFUSE_RETURN_IF_ERROR(backend_.copy_2d(out, part, send, part, part, 1));
    return backend_.memset(out + part, 0, part * size_t(size_ - 1));
  }
  absl::Status broadcast(void* buf, int64_t bytes, int root) override {
    KVFUSE_RETURN_IF_ERROR(check_collective_args("broadcast", buf, bytes, *this));
    KVFUSE_RETURN_IF_ERROR(check_root("broadcast", root, *this));
    if (root != 0) {
      return absl::FailedPreconditionError(absl::StrCat("broadcast from rank ", root,
                                                        ": rank 0 runs alone (tp_rank_alone), rank ", root,
                                                        " does not exist"));
    }
    return aborted_ ? aborted() : absl::OkStatus();
  }
  absl::Status barrier() override {
    if (aborted_) return aborted();
    return backend_.synchronize();
  }
  void abort() override { aborted_ = true; }

 private:
  static absl::Status aborted() { return absl::CancelledError("the communicator was aborted"); }
  const int32_t size_;
  Backend& backend_;
  std::atomic<bool> aborted_{false};
};
}  // namespace

Backend& Engine::rank_backend(int32_t local_rank) {
  return local_rank == 0 ? *backend_ : *ranks_[size_t(local_rank - 1)]->backend;
}

absl::Status Engine::for_each_rank(const std::function<absl::Status(int32_t)>& f, bool abort_on_error) {
  if (!group_failed_.ok()) return group_failed_;
  if (follower_links_) {
    // A follower that failed between steps (its report, or its closed connection).
    if (absl::Status st = follower_links_->failure(); !st.ok()) return fail_group(st);
  }
  auto run = [&](int32_t rank) -> absl::Status {
    absl::Status st = f(rank);
    if (!st.ok() && abort_on_error) abort_communicators();  // at once: the others may wait on this rank
    return st;
  };
  std::vector<std::future<absl::Status>> done;
  done.reserve(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) {
    done.push_back(ranks_[i]->thread->post([&run, i] { return run(int32_t(i) + 1); }));
  }
  absl::Status first = backend_->bind_thread();
  if (first.ok()) first = run(0);
  for (size_t i = 0; i < done.size(); ++i) {
    const absl::Status st = done[i].get();
    if (first.ok() && !st.ok()) first = absl::Status(st.code(), absl::StrCat("rank ", i + 1, ": ", st.message()));
  }
  if (!first.ok() && abort_on_error) {
    if (follower_links_) {
      // This rank's error may only be the echo of another process's (a collective whose
      // peer closed): that process's own report says why, and follows within moments.
      if (absl::Status why = follower_links_->wait_failure(std::chrono::seconds(2)); !why.ok()) {
        first = absl::Status(first.code(), absl::StrCat(first.message(), "; ", why.message()));
      }
    }
    (void)fail_group(first);
  }
  return first;
}

void Engine::abort_communicators() {
  if (comm_) comm_->abort();
  for (auto& r : ranks_) {
    if (r->comm) r->comm->abort();
  }
}

absl::Status Engine::fail_group(absl::Status cause) {
  abort_communicators();
  if (group_failed_.ok()) {
    group_failed_ = absl::FailedPreconditionError(
        absl::StrCat("the tensor-parallel group was aborted after a rank failed mid-step (", cause.message(),
                     "); restart the engine"));
  }
  return cause;
}

absl::StatusOr<TensorParallelShard> Engine::rank_shard(const ModelSpec& s, KvFormat format) const {
  auto shard = tensor_parallel_shard(s, cfg_.tensor_parallel);
  if (!shard.ok()) return shard.status();
  // The kernels see one rank's heads: check that shape too.
  ModelSpec per_rank = s;
  per_rank.num_q_heads = shard->num_q_heads;
  per_rank.num_kv_heads = shard->num_kv_heads;
  KVFUSE_RETURN_IF_ERROR(backend_->check_supported(per_rank, format));
  return shard;
}

absl::Status Engine::start_local_ranks() {
  const int32_t local = cfg_.tp_local_ranks();
  for (int32_t r = 1; r < local; ++r) ranks_.push_back(std::make_unique<Rank>());
  // Every rank's backend on its own thread, so that a GPU rank's device is current there.
  for (int32_t r = 1; r < local; ++r) {
    Rank& rank = *ranks_[size_t(r - 1)];
    rank.thread = std::make_unique<RankThread>();
    const Device device = backend_->device();
    const int32_t ordinal = cfg_.tp_device(r);
    KVFUSE_RETURN_IF_ERROR(rank.thread
                               ->post([&rank, device, ordinal]() -> absl::Status {
                                 auto b = make_backend(device, ordinal);
                                 if (!b.ok()) return b.status();
                                 rank.backend = std::move(*b);
                                 return rank.backend->bind_thread();
                               })
                               .get());
  }
  return absl::OkStatus();
}

absl::Status Engine::init_rank_models(const ModelSpec& s, KvPoolConfig& pc, const TensorParallelShard& shard,
                                      std::vector<std::unique_ptr<Communicator>> comms) {
  const int32_t local = num_local_ranks();
  if (collectives_path_.empty()) collectives_path_ = comms[0]->name();
  comm_ = std::move(comms[0]);
  for (int32_t r = 1; r < local; ++r) ranks_[size_t(r - 1)]->comm = std::move(comms[size_t(r)]);

  // One pool of pages; each local rank's storage holds its KV heads.
  pc.num_kv_heads = shard.num_kv_heads;
  auto pool = KvPool::create_shared(pc, local);
  if (!pool.ok()) return pool.status();
  pool_ = std::move(*pool);
  std::vector<std::unique_ptr<Model>> models(static_cast<size_t>(local));
  KVFUSE_RETURN_IF_ERROR(for_each_rank(
      [&](int32_t r) -> absl::Status {
        Backend& be = rank_backend(r);
        KVFUSE_RETURN_IF_ERROR(pool_->add_storage(r, be));
        ModelShard ms;
        ms.shard = shard;
        ms.rank = cfg_.tp_rank + r;
        ms.local_rank = r;
        ms.comm = &rank_comm(r);
        auto m = Model::create_shard(be, s, ms);
        if (!m.ok()) return m.status();
        models[size_t(r)] = std::move(*m);
        return absl::OkStatus();
      },
      false));
  model_ = std::move(models[0]);
  for (int32_t r = 1; r < local; ++r) ranks_[size_t(r - 1)]->model = std::move(models[size_t(r)]);
  return absl::OkStatus();
}

absl::Status Engine::init_ranks(const ModelSpec& s, KvPoolConfig& pc) {
  const int32_t tp = cfg_.tensor_parallel;
  auto shard = rank_shard(s, pc.format);
  if (!shard.ok()) return shard.status();
  KVFUSE_RETURN_IF_ERROR(start_local_ranks());
  // The communicators: every rank's made at once (NCCL's init waits for the whole group).
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(tp));
  if (backend_->device() == Device::cpu) {
    KVFUSE_RETURN_IF_ERROR(cpu_communicators(comms));
  } else {
#if defined(KVFUSE_HAVE_GPU)
    if (cfg_.tp_share_gpu) {
      KVFUSE_RETURN_IF_ERROR(share_gpu_communicators(comms));
      return init_rank_models(s, pc, *shard, std::move(comms));
    }
    auto lib = nccl::NcclLibrary::load();
    if (!lib.ok()) return lib.status();
    collectives_library_ = (*lib)->description();
    auto id = NcclCommunicator::unique_id(**lib);
    if (!id.ok()) return id.status();
    // A rank whose set-up fails stops the others' wait for it (and the timeout bounds it).
    GroupInitWatch watch(std::chrono::seconds(cfg_.tp_rendezvous_timeout_s), {});
    KVFUSE_RETURN_IF_ERROR(for_each_rank(
        [&](int32_t r) -> absl::Status {
          auto c = NcclCommunicator::create(**lib, *id, r, tp, cfg_.tp_device(r), rank_backend(r).native_stream(),
                                            watch.for_rank(r));
          if (!c.ok()) return watch.failed(r, c.status());
          comms[size_t(r)] = std::move(*c);
          return absl::OkStatus();
        },
        false));
    KVFUSE_RETURN_IF_ERROR(use_peer_allreduce(comms));
#else
    return absl::FailedPreconditionError("tensor parallelism on a GPU needs a GPU build");
#endif
  }
  return init_rank_models(s, pc, *shard, std::move(comms));
}

absl::Status Engine::init_rank_alone(const ModelSpec& s, KvPoolConfig& pc) {
  if (!cfg_.tp_rendezvous.empty()) {
    return absl::InvalidArgumentError(
        "tp_rank_alone: rank 0 runs alone in one process; tp_rendezvous must be empty");
  }
  auto shard = rank_shard(s, pc.format);
  if (!shard.ok()) return shard.status();
  KVFUSE_RETURN_IF_ERROR(backend_->bind_thread());
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::make_unique<LoneRankCommunicator>(cfg_.tensor_parallel, *backend_));
  collectives_path_ = absl::StrCat("none: rank 0 of ", cfg_.tensor_parallel,
                                   " alone (tp_rank_alone), its peers and every collective left out");
  return init_rank_models(s, pc, *shard, std::move(comms));
}

absl::Status Engine::cpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms) {
  auto group = CpuCommGroup::create(int(comms.size()), std::chrono::seconds(cfg_.tp_rendezvous_timeout_s));
  if (!group.ok()) return group.status();
  comm_group_ = *group;
  for (size_t r = 0; r < comms.size(); ++r) {
    auto c = CpuCommunicator::create(*group, int(r));
    if (!c.ok()) return c.status();
    comms[r] = std::move(*c);
  }
  return absl::OkStatus();
}

absl::Status Engine::use_peer_allreduce(std::vector<std::unique_ptr<Communicator>>& comms) {
  collectives_path_ = comms[0]->name();
#if defined(KVFUSE_HAVE_GPU)
  const int32_t tp = cfg_.tensor_parallel;
  if (cfg_.tp_allreduce == TpAllReduce::nccl) {
    collectives_path_ += " (tp_allreduce nccl)";
    return absl::OkStatus();
  }
  if (peer_allreduce_disabled_by_env()) {
    collectives_path_ += " (KVFUSE_PEER_ALLREDUCE=0)";
    return absl::OkStatus();
  }
  std::vector<int> devices;
  for (int32_t r = 0; r < tp; ++r) devices.push_back(cfg_.tp_device(r));
  // Where it does not apply (no peer access between a pair, more than 8 ranks), NCCL
  // carries every collective, as before; the reason is in collectives_path().
  const PeerAllReduceOptions options = peer_options(cfg_);
  auto group = PeerAllReduceGroup::create(devices, options);
  if (!group.ok()) {
    collectives_path_ += absl::StrCat(" (", group.status().message(), ")");
    return absl::OkStatus();
  }
  for (int32_t r = 0; r < tp; ++r) {
    auto c = PeerAllReduceCommunicator::create(*group, r, rank_backend(r).native_stream(),
                                               std::move(comms[size_t(r)]));
    if (!c.ok()) return c.status();
    comms[size_t(r)] = std::move(*c);
  }
  collectives_path_ = absl::StrCat(comms[0]->name(), " (all-reduces up to ", (*group)->staging_bytes() >> 10,
                                   " KiB over peer memory, larger ones and the gathers over NCCL",
                                   options.push ? kPushPath : "", ")");
#endif
  return absl::OkStatus();
}

absl::Status Engine::share_gpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms) {
#if defined(KVFUSE_HAVE_GPU)
  const int32_t tp = cfg_.tensor_parallel;
  PeerAllReduceOptions options = peer_options(cfg_);
  options.share_devices = true;
  auto group = PeerAllReduceGroup::create(std::vector<int>(size_t(tp), cfg_.tp_device(0)), options);
  if (!group.ok()) return group.status();
  // Each rank's host meeting before its collectives: the ranks' CPU communicators.
  std::vector<std::unique_ptr<Communicator>> hosts(static_cast<size_t>(tp));
  KVFUSE_RETURN_IF_ERROR(cpu_communicators(hosts));
  for (int32_t r = 0; r < tp; ++r) {
    auto c = SharedGpuCommunicator::create(*group, r, rank_backend(r).native_stream(),
                                           std::move(hosts[size_t(r)]));
    if (!c.ok()) return c.status();
    comms[size_t(r)] = std::move(*c);
  }
  collectives_path_ =
      absl::StrCat(comms[0]->name(), " (tp_share_gpu: ", tp, " ranks sharing GPU ", cfg_.tp_device(0),
                   ", a test mode; every collective over the peer group", options.push ? kPushPath : "", ")");
  return absl::OkStatus();
#else
  (void)comms;
  return absl::FailedPreconditionError("tp_share_gpu needs a GPU build");
#endif
}

absl::Status Engine::load_weights(HostWeightSource& weights,
                                  const std::function<void(int32_t)>& after_layer) {
  // The host weights are read once, piece by piece; every rank uploads its slices at once.
  auto model_of = [this](int32_t r) -> Model& { return r == 0 ? *model_ : *ranks_[size_t(r - 1)]->model; };
  {
    HostGlobalWeights g;
    KVFUSE_RETURN_IF_ERROR(weights.globals(g));
    KVFUSE_RETURN_IF_ERROR(for_each_rank([&](int32_t r) { return model_of(r).load_globals(g); }, false));
  }
  for (int32_t l = 0; l < model_->spec().num_layers; ++l) {
    HostLayerWeights h;
    KVFUSE_RETURN_IF_ERROR(weights.layer(l, h));
    KVFUSE_RETURN_IF_ERROR(for_each_rank([&](int32_t r) { return model_of(r).load_layer(l, h); }, false));
    after_layer(l + 1);
  }
  std::vector<std::unique_ptr<ModelRunner>> runners(static_cast<size_t>(num_local_ranks()));
  KVFUSE_RETURN_IF_ERROR(for_each_rank(
      [&](int32_t r) -> absl::Status {
        auto runner = ModelRunner::create(rank_backend(r), model_of(r), model_limits(cfg_));
        if (!runner.ok()) return runner.status();
        runners[size_t(r)] = std::move(*runner);
        return absl::OkStatus();
      },
      false));
  runner_ = std::move(runners[0]);
  for (size_t r = 1; r < runners.size(); ++r) ranks_[r - 1]->runner = std::move(runners[r]);
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::end_gemm_tuning() {
  if (is_follower()) return absl::FailedPreconditionError("end_gemm_tuning: rank 0's process runs it");
  if (follower_links_) KVFUSE_RETURN_IF_ERROR(post_to_followers(RankCommand::end_gemm_tuning, {}));
  bool ended = false;
  for (int32_t r = 0; r < num_local_ranks(); ++r) {
    const bool e = rank_backend(r).end_gemm_tuning();
    if (r == 0) ended = e;
  }
  return ended;
}

int64_t Engine::gemm_shapes_timed() const { return backend_->gemm_shapes_timed(); }

absl::StatusOr<double> Engine::collectives_ms(int32_t tokens, int reps) {
  if (num_ranks() == 1) return absl::FailedPreconditionError("collectives_ms: tensor_parallel is 1");
  if (rank_alone())
    return absl::FailedPreconditionError("collectives_ms: rank 0 runs alone, with no collectives");
  if (is_follower()) return absl::FailedPreconditionError("collectives_ms: rank 0's process runs it");
  if (tokens < 1 || reps < 1) return absl::InvalidArgumentError("collectives_ms: tokens and reps must be >= 1");
  if (follower_links_) {
    KVFUSE_RETURN_IF_ERROR(post_to_followers(RankCommand::collectives, encode_collectives(tokens, reps)));
  }
  std::vector<double> ms(static_cast<size_t>(num_local_ranks()), 0.0);
  KVFUSE_RETURN_IF_ERROR(
      for_each_rank([&](int32_t r) { return run_collectives(r, tokens, reps, ms[size_t(r)]); }, true));
  return ms[0];
}

absl::Status Engine::run_collectives(int32_t r, int32_t tokens, int reps, double& ms) {
  const ModelSpec& s = model_->spec();
  const int64_t vocab_shard = model_->dims().vocab;
  Backend& be = rank_backend(r);
  Communicator& comm = rank_comm(r);
  auto act = be.alloc(size_t(tokens) * size_t(s.hidden) * 2);
  auto shard = be.alloc(size_t(tokens) * size_t(vocab_shard) * 4);
  auto gathered = be.alloc(size_t(tokens) * size_t(vocab_shard) * 4 * size_t(comm.size()));
  for (auto* b : {&act, &shard, &gathered}) {
    if (!b->ok()) return b->status();
  }
  KVFUSE_RETURN_IF_ERROR(be.memset(act->get(), 0, act->bytes()));
  KVFUSE_RETURN_IF_ERROR(be.memset(shard->get(), 0, shard->bytes()));
  auto step = [&]() -> absl::Status {
    for (int32_t l = 0; l < 2 * s.num_layers; ++l) {
      KVFUSE_RETURN_IF_ERROR(comm.all_reduce_sum(act->get(), int64_t(tokens) * s.hidden, DType::bf16));
    }
    return comm.all_gather(shard->get(), gathered->get(), int64_t(tokens) * vocab_shard, DType::f32);
  };
  KVFUSE_RETURN_IF_ERROR(step());  // warm-up (and NCCL's lazy setup) outside the capture
  std::unique_ptr<BackendGraph> graph;
  if (be.supports_graphs()) {
    KVFUSE_RETURN_IF_ERROR(be.synchronize());
    KVFUSE_RETURN_IF_ERROR(be.begin_capture());
    const absl::Status recorded = step();
    auto g = be.end_capture();
    if (!recorded.ok()) return recorded;
    if (!g.ok()) return g.status();
    graph = std::move(*g);
    KVFUSE_RETURN_IF_ERROR(graph->replay());
  }
  KVFUSE_RETURN_IF_ERROR(be.synchronize());
  KVFUSE_RETURN_IF_ERROR(comm.barrier());
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) KVFUSE_RETURN_IF_ERROR(graph ? graph->replay() : step());
  KVFUSE_RETURN_IF_ERROR(be.synchronize());
  ms = ms_since(t0) / reps;
  return absl::OkStatus();
}

Communicator& Engine::rank_comm(int32_t local_rank) {
  return local_rank == 0 ? *comm_ : *ranks_[size_t(local_rank - 1)]->comm;
}

absl::Status Engine::run_rank_pass(int32_t r, const ForwardOptions& opts) {
  KVFUSE_RETURN_IF_ERROR(r == 0 ? runner_->run(batch_, *pool_, opts, fwd_)
                                : ranks_[size_t(r - 1)]->runner->run(batch_, *pool_, opts, ranks_[size_t(r - 1)]->fwd));
  return rank_comm(r).async_error();
}

}  // namespace kvfuse
