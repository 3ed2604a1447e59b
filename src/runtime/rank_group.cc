// The group at work (src/runtime/rank_group.h): a pass or a benchmark on every local rank
// at once (for_each_rank), sent first to the other processes when the group spans them;
// the group's failure handling; and its teardown. Forming the group is
// src/runtime/rank_group_setup.cc's; across processes, src/runtime/rank_group_processes.cc.
#include "src/runtime/rank_group.h"

#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/common/timing.h"
#include "src/runtime/rank_commands.h"
#include "src/runtime/rank_links.h"

namespace kvfuse {

RankGroup::RankGroup(const Config& cfg, Backend& backend0) : cfg_(cfg), backend0_(backend0) {}

RankGroup::~RankGroup() { stop(); }

void RankGroup::drop_links() {
  follower_links_.reset();
  follower_fds_.clear();
  leader_fd_.reset();
}

void RankGroup::stop() {
  // Across processes: the followers exit cleanly (and no watcher uses the communicators
  // any more once the links are gone).
  if (follower_links_) follower_links_->shutdown();
  follower_links_.reset();
  leader_link_.reset();
  // Each rank's objects are released on its own thread (its device current), runners and
  // models before the communicators and backends they use; then the threads stop.
  for (auto& rp : ranks_) {
    Rank& r = *rp;
    if (!r.thread) continue;
    r.thread
        ->post([&r] {
          // A rank whose backend could not be made (a GPU that is not there) has none.
          if (r.backend) (void)r.backend->bind_thread();
          r.runner.reset();
          r.model.reset();
          r.comm.reset();
          r.backend.reset();
          return absl::OkStatus();
        })
        .wait();
    r.thread.reset();
  }
}

Backend& RankGroup::backend(int32_t local_rank) {
  return local_rank == 0 ? backend0_ : *ranks_[size_t(local_rank - 1)]->backend;
}

Communicator& RankGroup::comm(int32_t local_rank) {
  return local_rank == 0 ? *comm0_ : *ranks_[size_t(local_rank - 1)]->comm;
}

Model& RankGroup::model(int32_t local_rank) {
  return local_rank == 0 ? *model0_ : *ranks_[size_t(local_rank - 1)]->model;
}

absl::Status RankGroup::for_each_rank(const std::function<absl::Status(int32_t)>& f, bool abort_on_error) {
  if (!failed_.ok()) return failed_;
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
  absl::Status first = backend0_.bind_thread();
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

void RankGroup::abort_communicators() {
  if (comm0_) comm0_->abort();
  for (auto& r : ranks_) {
    if (r->comm) r->comm->abort();
  }
}

absl::Status RankGroup::fail_group(absl::Status cause) {
  abort_communicators();
  if (failed_.ok()) {
    failed_ = absl::FailedPreconditionError(
        absl::StrCat("the tensor-parallel group was aborted after a rank failed mid-step (", cause.message(),
                     "); restart the engine"));
  }
  return cause;
}

absl::Status RankGroup::forward(const ForwardBatch& batch, KvPool& pool, const ForwardOptions& opts,
                                ForwardResult& fwd0) {
  if (follower_links_) {
    // Sent before this rank starts: every process runs the step at once.
    KVFUSE_RETURN_IF_ERROR(
        post_to_followers(RankCommand::forward, encode_forward(batch, opts, pool.take_swa_changes())));
  }
  // Every rank runs the same batch; rank 0's result has the tokens. A collective that
  // failed on the device after its launch (a peer all-reduce that timed out) fails the step.
  return for_each_rank([&](int32_t r) { return run_pass(r, batch, pool, opts, fwd0); }, true);
}

absl::Status RankGroup::run_pass(int32_t r, const ForwardBatch& batch, KvPool& pool,
                                 const ForwardOptions& opts, ForwardResult& fwd0) {
  if (r == 0) {
    KVFUSE_RETURN_IF_ERROR(runner0_->run(batch, pool, opts, fwd0));
  } else {
    Rank& rank = *ranks_[size_t(r - 1)];
    KVFUSE_RETURN_IF_ERROR(rank.runner->run(batch, pool, opts, rank.fwd));
  }
  return comm(r).async_error();
}

absl::StatusOr<bool> RankGroup::end_gemm_tuning() {
  if (is_follower()) return absl::FailedPreconditionError("end_gemm_tuning: rank 0's process runs it");
  if (follower_links_) KVFUSE_RETURN_IF_ERROR(post_to_followers(RankCommand::end_gemm_tuning, {}));
  bool ended = false;
  for (int32_t r = 0; r < num_local_ranks(); ++r) {
    const bool e = backend(r).end_gemm_tuning();
    if (r == 0) ended = e;
  }
  return ended;
}

absl::StatusOr<double> RankGroup::collectives_ms(int32_t tokens, int reps) {
  if (cfg_.tensor_parallel == 1) return absl::FailedPreconditionError("collectives_ms: tensor_parallel is 1");
  if (cfg_.tp_rank_alone)
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

absl::Status RankGroup::run_collectives(int32_t r, int32_t tokens, int reps, double& ms) {
  const ModelSpec& s = model0_->spec();
  const int64_t vocab_shard = model0_->dims().vocab;
  Backend& be = backend(r);
  Communicator& c = comm(r);
  auto act = be.alloc(size_t(tokens) * size_t(s.hidden) * 2);
  auto shard = be.alloc(size_t(tokens) * size_t(vocab_shard) * 4);
  auto gathered = be.alloc(size_t(tokens) * size_t(vocab_shard) * 4 * size_t(c.size()));
  for (auto* b : {&act, &shard, &gathered}) {
    if (!b->ok()) return b->status();
  }
  KVFUSE_RETURN_IF_ERROR(be.memset(act->get(), 0, act->bytes()));
  KVFUSE_RETURN_IF_ERROR(be.memset(shard->get(), 0, shard->bytes()));
  auto step = [&]() -> absl::Status {
    for (int32_t l = 0; l < 2 * s.num_layers; ++l) {
      KVFUSE_RETURN_IF_ERROR(c.all_reduce_sum(act->get(), int64_t(tokens) * s.hidden, DType::bf16));
    }
    return c.all_gather(shard->get(), gathered->get(), int64_t(tokens) * vocab_shard, DType::f32);
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
  KVFUSE_RETURN_IF_ERROR(c.barrier());
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) KVFUSE_RETURN_IF_ERROR(graph ? graph->replay() : step());
  KVFUSE_RETURN_IF_ERROR(be.synchronize());
  ms = ms_since(t0) / reps;
  return absl::OkStatus();
}

}  // namespace kvfuse
