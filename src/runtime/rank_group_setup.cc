// Forming the group (src/runtime/rank_group.h) and giving its ranks their models: the ranks
// of this process other than its first (a thread and a backend each), the communicators of
// a group in one process (docs/tensor-parallel.md#in-one-process) — CPU, NCCL with the peer
// all-reduce in front, or tp_share_gpu's — and rank 0 alone (Config::tp_rank_alone), for
// timing a rank's work on one device; then every local rank's storage, model shard,
// weights and runner. Across processes the group forms in src/runtime/rank_group_processes.cc.
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/init_watch.h"
#include "src/runtime/rank_group.h"
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

absl::Status RankGroup::form(const ModelSpec& s, const KvPoolConfig& pc) {
  return cfg_.tp_rank_alone           ? form_rank_alone(s, pc.format)
         : cfg_.tp_rendezvous.empty() ? form_in_process(s, pc.format)
                                      : form_process_group(s, pc);
}

absl::Status RankGroup::check_shard(const ModelSpec& s, KvFormat format) {
  auto shard = tensor_parallel_shard(s, cfg_.tensor_parallel);
  if (!shard.ok()) return shard.status();
  // The kernels see one rank's heads: check that shape too.
  ModelSpec per_rank = s;
  per_rank.num_q_heads = shard->num_q_heads;
  per_rank.num_kv_heads = shard->num_kv_heads;
  KVFUSE_RETURN_IF_ERROR(backend0_.check_supported(per_rank, format));
  shard_ = *shard;
  return absl::OkStatus();
}

absl::Status RankGroup::start_local_ranks() {
  const int32_t local = cfg_.tp_local_ranks();
  for (int32_t r = 1; r < local; ++r) ranks_.push_back(std::make_unique<Rank>());
  // Every rank's backend on its own thread, so that a GPU rank's device is current there.
  for (int32_t r = 1; r < local; ++r) {
    Rank& rank = *ranks_[size_t(r - 1)];
    rank.thread = std::make_unique<RankThread>();
    const Device device = backend0_.device();
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

void RankGroup::take_communicators(std::vector<std::unique_ptr<Communicator>> comms) {
  if (collectives_path_.empty()) collectives_path_ = comms[0]->name();
  comm0_ = std::move(comms[0]);
  for (int32_t r = 1; r < num_local_ranks(); ++r) ranks_[size_t(r - 1)]->comm = std::move(comms[size_t(r)]);
}

absl::Status RankGroup::form_in_process(const ModelSpec& s, KvFormat format) {
  const int32_t tp = cfg_.tensor_parallel;
  KVFUSE_RETURN_IF_ERROR(check_shard(s, format));
  KVFUSE_RETURN_IF_ERROR(start_local_ranks());
  // The communicators: every rank's made at once (NCCL's init waits for the whole group).
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(tp));
  if (backend0_.device() == Device::cpu) {
    KVFUSE_RETURN_IF_ERROR(cpu_communicators(comms));
  } else {
#if defined(KVFUSE_HAVE_GPU)
    if (cfg_.tp_share_gpu) {
      KVFUSE_RETURN_IF_ERROR(share_gpu_communicators(comms));
      take_communicators(std::move(comms));
      return absl::OkStatus();
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
          auto c = NcclCommunicator::create(**lib, *id, r, tp, cfg_.tp_device(r), backend(r).native_stream(),
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
  take_communicators(std::move(comms));
  return absl::OkStatus();
}

absl::Status RankGroup::form_rank_alone(const ModelSpec& s, KvFormat format) {
  if (!cfg_.tp_rendezvous.empty()) {
    return absl::InvalidArgumentError(
        "tp_rank_alone: rank 0 runs alone in one process; tp_rendezvous must be empty");
  }
  KVFUSE_RETURN_IF_ERROR(check_shard(s, format));
  KVFUSE_RETURN_IF_ERROR(backend0_.bind_thread());
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::make_unique<LoneRankCommunicator>(cfg_.tensor_parallel, backend0_));
  collectives_path_ = absl::StrCat("none: rank 0 of ", cfg_.tensor_parallel,
                                   " alone (tp_rank_alone), its peers and every collective left out");
  take_communicators(std::move(comms));
  return absl::OkStatus();
}

absl::Status RankGroup::cpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms) {
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

absl::Status RankGroup::use_peer_allreduce(std::vector<std::unique_ptr<Communicator>>& comms) {
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
    auto c =
        PeerAllReduceCommunicator::create(*group, r, backend(r).native_stream(), std::move(comms[size_t(r)]));
    if (!c.ok()) return c.status();
    comms[size_t(r)] = std::move(*c);
  }
  collectives_path_ = absl::StrCat(comms[0]->name(), " (all-reduces up to ", (*group)->staging_bytes() >> 10,
                                   " KiB over peer memory, larger ones and the gathers over NCCL",
                                   options.push ? kPushPath : "", ")");
#endif
  return absl::OkStatus();
}

absl::Status RankGroup::share_gpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms) {
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
    auto c =
        SharedGpuCommunicator::create(*group, r, backend(r).native_stream(), std::move(hosts[size_t(r)]));
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

absl::StatusOr<std::unique_ptr<Model>> RankGroup::add_models(const ModelSpec& s, KvPool& pool) {
  const int32_t local = num_local_ranks();
  std::vector<std::unique_ptr<Model>> models(static_cast<size_t>(local));
  KVFUSE_RETURN_IF_ERROR(for_each_rank(
      [&](int32_t r) -> absl::Status {
        Backend& be = backend(r);
        KVFUSE_RETURN_IF_ERROR(pool.add_storage(r, be));
        ModelShard ms;
        ms.shard = shard_;
        ms.rank = cfg_.tp_rank + r;
        ms.local_rank = r;
        ms.comm = &comm(r);
        auto m = Model::create_shard(be, s, ms);
        if (!m.ok()) return m.status();
        models[size_t(r)] = std::move(*m);
        return absl::OkStatus();
      },
      false));
  model0_ = models[0].get();
  for (int32_t r = 1; r < local; ++r) ranks_[size_t(r - 1)]->model = std::move(models[size_t(r)]);
  if (!cfg_.tp_rendezvous.empty()) link_processes(pool);
  return std::move(models[0]);
}

absl::StatusOr<std::unique_ptr<ModelRunner>> RankGroup::load_weights(
    HostWeightSource& weights, const std::function<void(int32_t)>& after_layer) {
  // The host weights are read once, piece by piece; every rank uploads its slices at once.
  {
    HostGlobalWeights g;
    KVFUSE_RETURN_IF_ERROR(weights.globals(g));
    KVFUSE_RETURN_IF_ERROR(for_each_rank([&](int32_t r) { return model(r).load_globals(g); }, false));
  }
  HostLayerWeights h;  // one for every layer: a source may reuse its buffers
  for (int32_t l = 0; l < model0_->spec().num_layers; ++l) {
    KVFUSE_RETURN_IF_ERROR(weights.layer(l, h));
    KVFUSE_RETURN_IF_ERROR(for_each_rank([&](int32_t r) { return model(r).load_layer(l, h); }, false));
    after_layer(l + 1);
  }
  std::vector<std::unique_ptr<ModelRunner>> runners(static_cast<size_t>(num_local_ranks()));
  KVFUSE_RETURN_IF_ERROR(for_each_rank(
      [&](int32_t r) -> absl::Status {
        auto runner = ModelRunner::create(backend(r), model(r), model_limits(cfg_));
        if (!runner.ok()) return runner.status();
        runners[size_t(r)] = std::move(*runner);
        return absl::OkStatus();
      },
      false));
  runner0_ = runners[0].get();
  for (size_t r = 1; r < runners.size(); ++r) ranks_[r - 1]->runner = std::move(runners[r]);
  return std::move(runners[0]);
}

}  // namespace kvfuse
