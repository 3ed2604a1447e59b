#include "server/loop_lifecycle.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <vector>

#include "kernels/common/enum_name.h"
#include "src/common/status_macros.h"

namespace kvfuse::server {

LoadProgressFn log_load_progress(double every_s) {
  return load_progress_every(every_s, [](const LoadProgress& p) {
    if (p.layers_done < p.layers) {
      spdlog::info("event=loading_weights layers_done={} layers={} elapsed_s={:.1f}", p.layers_done, p.layers,
                   p.elapsed_s);
    } else {
      spdlog::info("event=weights_loaded layers={} elapsed_s={:.1f}", p.layers, p.elapsed_s);
    }
  });
}

const char* to_string(LoopState s) {
  return enum_name(s, {"warming", "serving", "draining", "stopped", "failed"});
}

LoopLifecycle::LoopLifecycle(const LoopOptions& opts, std::function<void(bool)> on_serving)
    : opts_(opts),
      on_serving_(std::move(on_serving)),
      watchdog_(opts_.watchdog_s, [this](bool stalled, double idle_s) {
        if (stalled) {
          spdlog::error("event=watchdog_stall no_progress_s={:.1f} limit_s={} health=NOT_SERVING", idle_s,
                        opts_.watchdog_s);
        } else {
          spdlog::warn("event=watchdog_recovered");
        }
        update_health();
      }) {}

LoopLifecycle::~LoopLifecycle() {
  watchdog_.stop();  // before the members its callback uses are gone
}

// ---- Warm-up -----------------------------------------------------------------------------

void LoopLifecycle::warm_up(LoopWork& work, ServerInfo& info) {
  const absl::Status st = start_engine(work, info);
  if (!st.ok()) spdlog::error("event=engine_start_failed error=\"{}\"", st.ToString());
  LoopState next = LoopState::failed;
  {
    // A drain that began during the warmup (a signal while loading) wins.
    std::lock_guard lock(mu_);
    if (st.ok()) next = stop_requested_ || drain_requested_ ? LoopState::draining : LoopState::serving;
    start_error_ = st;
    state_ = next;
  }
  // Health first, then readiness: whoever waited for the engine sees SERVING.
  update_health();
  std::lock_guard lock(mu_);
  ready_ = true;
  ready_cv_.notify_all();
}

absl::Status LoopLifecycle::start_engine(LoopWork& work, ServerInfo& info) {
  if (opts_.before_warmup) opts_.before_warmup();
  const Config& cfg = opts_.config;
  auto backend = opts_.make_backend ? opts_.make_backend() : make_backend(cfg.device, cfg.tp_device(0));
  if (!backend.ok()) return backend.status();
  auto created = Engine::create(cfg, std::move(*backend), log_load_progress());
  if (!created.ok()) return created.status();
  work.engine = std::move(*created);
  Engine& engine = *work.engine;
  work.sched = std::make_unique<Scheduler>(engine, SchedulerLimits{opts_.max_waiting});
  if (opts_.result_hook) work.sched->set_result_hook(opts_.result_hook);

  // One prefill and one decode step through the real path, so that the first request
  // does not pay for first-touch allocations, and a broken device fails here.
  const SeqId warm_id = std::numeric_limits<SeqId>::max();
  const int32_t n = std::min<int32_t>(8, cfg.max_seq_len - 2);
  std::vector<int32_t> prompt(size_t(std::max(1, n)));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(i) % engine.spec().vocab;
  KVFUSE_RETURN_IF_ERROR(engine.add_sequence(warm_id, prompt, SamplingParams{}));
  for (int32_t tokens : {int32_t(prompt.size()), 1}) {
    auto res = engine.step({StepItem{warm_id, tokens, true}});
    if (!res.ok()) return res.status();
    if (!(*res)[0].status.ok()) return (*res)[0].status;
  }
  KVFUSE_RETURN_IF_ERROR(engine.release(warm_id));
  // Decode graphs (GPU, graphs: on): capture every batch bucket now, not on a request.
  auto warmed = engine.warm_up_decode_graphs();
  if (!warmed.ok()) return warmed.status();
  if (*warmed > 0) {
    spdlog::info("event=graphs_captured buckets={}", *warmed);
    // The decode graphs' GEMM shapes are tuned now: a shape first seen while serving (a
    // mixed prefill step's token count) runs an untimed choice rather than make its
    // step wait while its candidates are timed. Without graphs every decode batch size
    // is such a shape, and tuning goes on as they come.
    auto ended = engine.end_gemm_tuning();
    if (!ended.ok()) return ended.status();
    if (*ended) spdlog::info("event=gemm_tuning_ended shapes_timed={}", engine.gemm_shapes_timed());
  }

  info.build(engine, cfg, opts_.limits);
  const v1::GetInfoResponse& i = info.info();
  spdlog::info(
      "event=engine_ready model={} device=\"{}\" kv_cache_dtype={} kv_format={} kv_write={} attention={} "
      "pages={} page_size={} tensor_parallel={} weights=\"{}\" weight_gib={:.2f}",
      i.model(), i.device(), i.kv_cache_dtype(), i.kv_format(), i.kv_write(), i.attention(), i.num_pages(),
      i.page_size(), i.tensor_parallel(), i.weight_format(), double(i.weight_bytes()) / double(1 << 30));
  if (engine.num_ranks() == 1) {
    const MemorySplit& m = engine.memory();
    const auto gib = [](int64_t b) { return double(b) / double(int64_t(1) << 30); };
    spdlog::info(
        "event=device_memory weights_gib={:.2f} kv_pool_gib={:.2f} pool={} workspace_gib={:.2f} graph_gib={:.2f} "
        "device_total_gib={:.2f} device_free_gib={:.2f} headroom_gib={:.2f}",
        gib(m.weight_bytes), gib(m.kv_pool_bytes), m.pool_auto ? "sized_to_fit" : "configured",
        gib(m.workspace_bytes), gib(m.graph_bytes), gib(m.device_total_bytes), gib(m.device_free_bytes),
        gib(m.headroom_bytes));
  }
  if (!cfg.devices.empty() && engine.backend().device() == Device::cpu) {
    // A config written for GPUs that runs on the CPU backend (device auto on a host without
    // one, or device cpu): its GPU list means nothing here, which is worth a line.
    spdlog::warn(
        "event=config_unused key=devices note=\"the CPU backend runs every rank as a thread of this "
        "process; devices lists GPUs\"");
  }
  if (engine.num_ranks() > 1) {
    // How the ranks reduce, and through which NCCL (RCCL) build: what an operator checks
    // first when a sharded server is slow or fails to start its group.
    spdlog::info("event=collectives path=\"{}\" library=\"{}\"", engine.collectives_path(),
                 engine.collectives_library().empty() ? "none" : engine.collectives_library());
  }
  return absl::OkStatus();
}

absl::Status LoopLifecycle::wait_until_ready(double timeout_s) {
  std::unique_lock lock(mu_);
  const bool ready =
      ready_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return ready_; });
  if (!ready) return absl::DeadlineExceededError("engine still warming up");
  if (state_.load() == LoopState::failed) return start_error_;
  return absl::OkStatus();
}

// ---- State and health ----------------------------------------------------------------------

absl::Status LoopLifecycle::check_available() const {
  switch (state_.load()) {
    case LoopState::warming:
      return absl::UnavailableError("engine is warming up");
    case LoopState::failed:
      return absl::UnavailableError("engine failed to start");
    case LoopState::stopped:
      return absl::UnavailableError("server is shutting down");
    default:
      return absl::OkStatus();
  }
}

absl::Status LoopLifecycle::check_accepting() const {
  if (state_.load() == LoopState::draining)
    return absl::UnavailableError("server is draining: no new requests");
  return check_available();
}

bool LoopLifecycle::serving() const {
  return state_.load() == LoopState::serving && healthy_.load() && !watchdog_.stalled();
}

void LoopLifecycle::set_healthy(bool healthy) {
  if (healthy_.exchange(healthy) == healthy) return;
  if (!healthy) spdlog::error("event=unhealthy reason=internal_error health=NOT_SERVING");
  update_health();
}

void LoopLifecycle::update_health() {
  // Serialized, and reading the state now rather than taking it as an argument: with
  // two changes racing, the last call still reports the latest state.
  std::lock_guard lock(health_mu_);
  on_serving_(serving());
}

// ---- Drain and stop ------------------------------------------------------------------------

void LoopLifecycle::begin_drain() {
  {
    std::lock_guard lock(mu_);
    drain_requested_ = true;
  }
  LoopState expected = LoopState::serving;
  if (state_.compare_exchange_strong(expected, LoopState::draining)) spdlog::info("event=draining");
  update_health();
}

void LoopLifecycle::request_stop(const absl::Status& why) {
  std::lock_guard lock(mu_);
  if (stop_requested_) return;
  stop_status_ = why;
  stop_requested_ = true;
}

absl::Status LoopLifecycle::enter_stopped(int64_t ended) {
  std::lock_guard lock(mu_);
  // Before the state changes: a drain that sees the loop stopped reads it.
  ended_by_stop_ = ended;
  state_ = LoopState::stopped;
  return stop_status_;
}

}  // namespace kvfuse::server
