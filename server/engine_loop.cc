#include "server/engine_loop.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/common/enum_name.h"
#include "kernels/common/kv_types.h"
#include "server/status_codes.h"
#include "src/common/status_macros.h"

namespace kvfuse::server {

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
std::string code_name(const absl::Status& st) { return absl::StatusCodeToString(st.code()); }
}  // namespace

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

EngineLoop::EngineLoop(LoopOptions opts, ServerMetrics& metrics, std::function<void(bool)> on_serving)
    : opts_(std::move(opts)),
      metrics_(metrics),
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

EngineLoop::~EngineLoop() {
  if (thread_.joinable()) stop(absl::UnavailableError("server is shutting down"));
  watchdog_.stop();  // before the members its callback uses are gone
}

void EngineLoop::start() {
  thread_ = std::thread([this] { run(); });
  watchdog_.start();
}

absl::Status EngineLoop::wait_until_ready(double timeout_s) {
  std::unique_lock lock(mu_);
  const bool ready =
      ready_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return ready_; });
  if (!ready) return absl::DeadlineExceededError("engine still warming up");
  if (state_.load() == LoopState::failed) return start_error_;
  return absl::OkStatus();
}

absl::Status EngineLoop::check_available() const {
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

absl::Status EngineLoop::check_accepting() const {
  if (state_.load() == LoopState::draining)
    return absl::UnavailableError("server is draining: no new requests");
  return check_available();
}

// ---- Posting ---------------------------------------------------------------------------

void EngineLoop::post(std::function<void()> cmd) {
  {
    std::lock_guard lock(mu_);
    if (accepting_commands_) {
      commands_.push_back(std::move(cmd));
      cv_.notify_one();
      return;
    }
  }
  cmd();  // the loop is gone: the command sees state stopped and answers UNAVAILABLE
}

void EngineLoop::wake() {
  std::lock_guard lock(mu_);
  woken_ = true;
  cv_.notify_one();
}

void EngineLoop::prefill(const v1::PrefillRequest* req, v1::PrefillResponse* resp, Flag cancelled,
                         Done done) {
  post([this, req, resp, cancelled, done] {
    if (auto st = check_available(); !st.ok()) return done(st);
    auto call = BatchCall::prefill(*sched_, *engine_, *req, resp, state_.load() == LoopState::serving,
                                   retry_after_ms());
    metrics_.add_prompt_tokens(call->prompt_tokens());
    add_batch(std::move(call), cancelled, done);
  });
}

void EngineLoop::decode(const v1::DecodeRequest* req, v1::DecodeResponse* resp, Flag cancelled, Done done) {
  post([this, req, resp, cancelled, done] {
    if (auto st = check_available(); !st.ok()) return done(st);
    add_batch(BatchCall::decode(*sched_, *engine_, *req, resp, retry_after_ms()), cancelled, done);
  });
}

void EngineLoop::release(const v1::ReleaseRequest* req, v1::ReleaseResponse* resp, Done done) {
  post([this, req, resp, done] {
    if (auto st = check_available(); !st.ok()) return done(st);
    for (uint64_t id : req->ids()) {
      if (streams_.count(id) || sched_->is_router_sequence(id)) {
        abort_sequence(id);
        resp->add_released(id);
      }
    }
    publish_load();
    done(absl::OkStatus());
  });
}

void EngineLoop::abort(uint64_t id, Done done) {
  post([this, id, done] {
    if (auto st = check_available(); !st.ok()) return done(st);
    if (!streams_.count(id) && !sched_->is_router_sequence(id)) {
      return done(absl::NotFoundError(absl::StrCat("sequence ", id, " not found")));
    }
    abort_sequence(id);
    publish_load();
    done(absl::OkStatus());
  });
}

void EngineLoop::get_load(v1::GetLoadResponse* resp, Done done) {
  post([this, resp, done] {
    if (auto st = check_available(); !st.ok()) return done(st);
    fill_load(resp);
    done(absl::OkStatus());
  });
}

void EngineLoop::generate(const v1::GenerateRequest* req, std::shared_ptr<GenerateCall> call) {
  // A copy: a cancelled call may be gone (with its request) before this runs.
  post([this, req = *req, call] {
    if (auto st = check_accepting(); !st.ok()) return call->finish_error(st);
    if (call->cancelled()) return;
    GenerateRequest g;
    g.id = req.id() != 0 ? req.id() : next_generate_id();
    g.prompt.assign(req.prompt_ids().begin(), req.prompt_ids().end());
    g.sampling = *to_sampling(req.sampling(), limits_.vocab);  // validated on arrival
    g.max_new_tokens = generate_max_tokens(req, limits_);
    g.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
    g.ignore_eos = req.ignore_eos();
    g.min_new_tokens = int32_t(req.min_tokens());
    g.logprobs = *to_logprobs(req.logprobs());  // validated on arrival
    const SeqId id = g.id;
    const int32_t prompt_tokens = int32_t(g.prompt.size());
    if (auto st = sched_->submit(std::move(g)); !st.ok()) {
      spdlog::debug("event=request_rejected id={} status=\"{}\"", id, st.ToString());
      metrics_.count_failed(code_name(st));
      return call->finish_error(with_hint(st));
    }
    Stream& s = streams_[id];
    s.call = call;
    s.prompt_tokens = prompt_tokens;
    metrics_.add_prompt_tokens(prompt_tokens);
    // Counted in flight before its first token can reach the client: a drain that
    // starts once the client has seen a token must wait for the stream.
    publish_load();
    call->accept(id);
  });
}

// ---- The loop ----------------------------------------------------------------------------

void EngineLoop::run() {
  const absl::Status st = warm_up();
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
  {
    std::lock_guard lock(mu_);
    ready_ = true;
    ready_cv_.notify_all();
  }
  publish_load();

  for (;;) {
    std::deque<std::function<void()>> cmds;
    bool stopping = false;
    watchdog_.beat(false);
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] {
        return !commands_.empty() || woken_ || stop_requested_ || (sched_ && sched_->has_work());
      });
      cmds.swap(commands_);
      woken_ = false;
      stopping = stop_requested_;
    }
    watchdog_.beat(true);
    // A command may end or add a stream: the events held back from the last step go first.
    if (!cmds.empty() || stopping) flush_events();
    for (auto& cmd : cmds) {
      cmd();
      if (sched_) dispatch_router_results();
    }
    if (sched_) end_cancelled();
    if (stopping) break;
    if (sched_ && sched_->has_work()) step();
    if (sched_ && !sched_->has_work()) flush_events();  // no next step to overlap them with
    publish_load();
  }
  watchdog_.beat(false);

  // Commands posted until now run with state stopped (they answer UNAVAILABLE); later
  // ones run on the posting thread (see post()).
  std::deque<std::function<void()>> rest;
  absl::Status why;
  {
    std::lock_guard lock(mu_);
    // Before the state changes: a drain that sees the loop stopped reads it.
    ended_by_stop_ = sched_ ? int64_t(streams_.size() + batches_.size() + sched_->num_router_sequences()) : 0;
    state_ = LoopState::stopped;
    accepting_commands_ = false;
    rest.swap(commands_);
    why = stop_status_;
  }
  for (auto& cmd : rest) cmd();
  if (sched_) end_everything(why);
  publish_load();
}

absl::Status EngineLoop::warm_up() {
  if (opts_.before_warmup) opts_.before_warmup();
  const Config& cfg = opts_.config;
  auto backend = opts_.make_backend ? opts_.make_backend() : make_backend(cfg.device, cfg.tp_device(0));
  if (!backend.ok()) return backend.status();
  auto engine = Engine::create(cfg, std::move(*backend), log_load_progress());
  if (!engine.ok()) return engine.status();
  engine_ = std::move(*engine);
  sched_ = std::make_unique<Scheduler>(*engine_, SchedulerLimits{opts_.max_waiting});
  if (opts_.result_hook) sched_->set_result_hook(opts_.result_hook);

  // One prefill and one decode step through the real path, so that the first request
  // does not pay for first-touch allocations, and a broken device fails here.
  const SeqId warm_id = std::numeric_limits<SeqId>::max();
  const int32_t n = std::min<int32_t>(8, cfg.max_seq_len - 2);
  std::vector<int32_t> prompt(size_t(std::max(1, n)));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(i) % engine_->spec().vocab;
  KVFUSE_RETURN_IF_ERROR(engine_->add_sequence(warm_id, prompt, SamplingParams{}));
  for (int32_t tokens : {int32_t(prompt.size()), 1}) {
    auto res = engine_->step({StepItem{warm_id, tokens, true}});
    if (!res.ok()) return res.status();
    if (!(*res)[0].status.ok()) return (*res)[0].status;
  }
  KVFUSE_RETURN_IF_ERROR(engine_->release(warm_id));
  // Decode graphs (GPU, graphs: on): capture every batch bucket now, not on a request.
  auto warmed = engine_->warm_up_decode_graphs();
  if (!warmed.ok()) return warmed.status();
  if (*warmed > 0) {
    spdlog::info("event=graphs_captured buckets={}", *warmed);
    // The decode graphs' GEMM shapes are tuned now: a shape first seen while serving (a
    // mixed prefill step's token count) runs an untimed choice rather than make its
    // step wait while its candidates are timed. Without graphs every decode batch size
    // is such a shape, and tuning goes on as they come.
    auto ended = engine_->end_gemm_tuning();
    if (!ended.ok()) return ended.status();
    if (*ended) spdlog::info("event=gemm_tuning_ended shapes_timed={}", engine_->gemm_shapes_timed());
  }

  limits_ = opts_.limits;
  limits_.vocab = engine_->spec().vocab;
  limits_.max_seq_len = cfg.max_seq_len;
  const ModelSpec& spec = engine_->spec();
  info_.set_model(spec.name);
  info_.set_arch(spec.arch);
  info_.set_vocab_size(uint32_t(spec.vocab));
  info_.set_num_layers(uint32_t(spec.num_layers));
  info_.set_kv_cache_dtype(to_string(cfg.kv_cache_dtype));
  info_.set_kv_format(kv_format_name(engine_->kv_format()));
  info_.set_page_size(uint32_t(cfg.page_size));
  info_.set_num_pages(uint64_t(engine_->pool().usage(PoolKind::full).total_pages));
  if (engine_->pool().has_swa()) {
    info_.set_swa_num_pages(uint64_t(engine_->pool().usage(PoolKind::swa).total_pages));
    info_.set_sliding_window(uint32_t(engine_->pool().config().window));
  }
  info_.set_attention(to_string(cfg.attention));
  info_.set_kv_write(to_string(cfg.kv_write));
  info_.set_device(engine_->backend().description());
  info_.set_version(KVFUSE_VERSION);
  info_.set_max_seq_len(uint32_t(cfg.max_seq_len));
  for (int32_t id : spec.eos_token_ids) info_.add_eos_token_ids(id);
  if (spec.bos_token_id >= 0) info_.set_bos_token_id(spec.bos_token_id);
  if (spec.pad_token_id >= 0) info_.set_pad_token_id(spec.pad_token_id);
  info_.set_max_position(uint32_t(spec.max_position));
  info_.set_tensor_parallel(uint32_t(engine_->num_ranks()));
  info_.set_max_batch_tokens(uint32_t(cfg.max_batch_tokens));
  info_.set_max_running_seqs(uint32_t(cfg.max_running_seqs));
  info_.set_max_decode_steps(uint32_t(limits_.max_decode_steps));
  info_.set_max_batch_sequences(uint32_t(limits_.max_batch_sequences));
  for (float k : engine_->pool().config().k_scale) info_.add_k_scale(k);
  for (float v : engine_->pool().config().v_scale) info_.add_v_scale(v);
  metrics_.set_info({{"model", info_.model()},
                     {"device", info_.device()},
                     {"kv_cache_dtype", info_.kv_cache_dtype()},
                     {"kv_format", info_.kv_format()},
                     {"kv_write", info_.kv_write()},
                     {"attention", info_.attention()},
                     {"version", info_.version()}});
  spdlog::info(
      "event=engine_ready model={} device=\"{}\" kv_cache_dtype={} kv_format={} kv_write={} attention={} "
      "pages={} page_size={} tensor_parallel={}",
      info_.model(), info_.device(), info_.kv_cache_dtype(), info_.kv_format(), info_.kv_write(),
      info_.attention(), info_.num_pages(), info_.page_size(), info_.tensor_parallel());
  if (!cfg.devices.empty() && engine_->backend().device() == Device::cpu) {
    // A config written for GPUs that runs on the CPU backend (device auto on a host without
    // one, or device cpu): its GPU list means nothing here, which is worth a line.
    spdlog::warn(
        "event=config_unused key=devices note=\"the CPU backend runs every rank as a thread of this "
        "process; devices lists GPUs\"");
  }
  if (engine_->num_ranks() > 1) {
    // How the ranks reduce, and through which NCCL (RCCL) build: what an operator checks
    // first when a sharded server is slow or fails to start its group.
    spdlog::info("event=collectives path=\"{}\" library=\"{}\"", engine_->collectives_path(),
                 engine_->collectives_library().empty() ? "none" : engine_->collectives_library());
  }
  return absl::OkStatus();
}

void EngineLoop::set_healthy(bool healthy) {
  if (healthy_.exchange(healthy) == healthy) return;
  if (!healthy) spdlog::error("event=unhealthy reason=internal_error health=NOT_SERVING");
  update_health();
}

void EngineLoop::update_health() {
  // Serialized, and reading the state now rather than taking it as an argument: with
  // two changes racing, the last call still reports the latest state.
  std::lock_guard lock(health_mu_);
  on_serving_(state_.load() == LoopState::serving && healthy_.load() && !watchdog_.stalled());
}

void EngineLoop::begin_drain() {
  {
    std::lock_guard lock(mu_);
    drain_requested_ = true;
  }
  LoopState expected = LoopState::serving;
  if (state_.compare_exchange_strong(expected, LoopState::draining)) spdlog::info("event=draining");
  update_health();
  wake();
}

void EngineLoop::stop(const absl::Status& why) {
  {
    std::lock_guard lock(mu_);
    if (!stop_requested_) {
      stop_requested_ = true;
      stop_status_ = why;
    }
    cv_.notify_one();
  }
  // stop() may race with itself (a second signal during a drain); join once.
  std::lock_guard join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
  watchdog_.stop();
}

void EngineLoop::end_cancelled() {
  // A cancelled or timed-out call frees its pages here, at the step boundary.
  bool any = false;
  for (const auto& [id, s] : streams_) any = any || s.call->cancelled();
  for (const auto& [id, b] : batches_) any = any || (b.cancelled && b.cancelled->load());
  if (!any) return;
  flush_events();
  for (auto it = streams_.begin(); it != streams_.end();) {
    if (!it->second.call->cancelled()) {
      ++it;
      continue;
    }
    (void)sched_->abort(it->first);
    metrics_.count_failed("CANCELLED");
    it = streams_.erase(it);
  }
  std::vector<uint64_t> cancelled;
  for (const auto& [id, b] : batches_) {
    if (b.cancelled && b.cancelled->load()) cancelled.push_back(id);
  }
  for (uint64_t id : cancelled) {
    const absl::Status why = absl::CancelledError("call cancelled");
    batches_.at(id).call->cancel(*sched_, why);
    dispatch_router_results();
    if (batches_.count(id)) complete_batch(id, why);
  }
}

void EngineLoop::step() {
  const uint64_t steps_before = sched_->num_steps();
  auto fail = [this](const absl::Status& st) {
    // The device state is unknown: end everything in flight, report unhealthy.
    spdlog::error("event=step_failed error=\"{}\"", st.ToString());
    set_healthy(false);
    // A tensor-parallel group that was aborted stays so until restarted: FAILED_PRECONDITION
    // (as the engine says), not a fault a retry here could get past.
    const absl::Status why(
        engine_->group_failure().ok() ? absl::StatusCode::kInternal : absl::StatusCode::kFailedPrecondition,
        absl::StrCat("engine step failed: ", st.message()));
    flush_events();
    for (const TokenEvent& ev : sched_->fail_all(why)) on_event(ev);
    dispatch_router_results();
  };
  auto planned = sched_->begin_step();
  if (!planned.ok()) return fail(planned.status());
  // The device runs the step from here until end_step(): the previous step's tokens go
  // to their streams meanwhile, then this step's planning events (in that order, so that
  // a request's last token comes before its failure to fit).
  flush_events();
  for (const TokenEvent& ev : *planned) on_event(ev);
  if (!sched_->step_in_flight()) return dispatch_router_results();
  auto events = sched_->end_step();
  if (!events.ok()) return fail(events.status());
  if (sched_->num_steps() != steps_before) {
    const StepTimings& t = engine_->last_timings();
    metrics_.step.observe(t.total_ms / 1000.0);
    metrics_.step_tokens.observe(double(t.num_tokens));
    step_ms_ewma_ = step_ms_ewma_ == 0 ? t.total_ms : 0.9 * step_ms_ewma_ + 0.1 * t.total_ms;
  }
  if (opts_.config.overlap_fanout) {
    pending_events_ = std::move(*events);
  } else {
    for (const TokenEvent& ev : *events) on_event(ev);
  }
  dispatch_router_results();
}

void EngineLoop::flush_events() {
  if (pending_events_.empty()) return;
  std::vector<TokenEvent> events;
  events.swap(pending_events_);
  for (const TokenEvent& ev : events) on_event(ev);
}

void EngineLoop::on_event(const TokenEvent& ev) {
  auto it = streams_.find(ev.id);
  if (it == streams_.end()) return;
  Stream& s = it->second;
  const auto now = Clock::now();
  if (ev.token) {
    if (s.completion_tokens == 0) {
      s.first_token = now;
      s.cached_tokens = ev.cached_tokens;
      metrics_.ttft.observe(seconds(now - s.call->arrival()));
    } else {
      metrics_.itl.observe(seconds(now - s.last_token));
    }
    s.last_token = now;
    ++s.completion_tokens;
    metrics_.add_generation_tokens(1);
    if (ev.logprob || !ev.prompt_logprobs.empty()) {
      v1::GenerateResponse lp;
      if (ev.logprob) to_proto(*ev.logprob, lp.add_logprobs());
      for (const TokenLogprob& t : ev.prompt_logprobs) to_proto(t, lp.add_prompt_logprobs());
      s.call->push_token(*ev.token, &lp);
    } else {
      s.call->push_token(*ev.token);
    }
  }
  if (ev.finish == FinishReason::none) return;
  spdlog::debug(
      "event=request_done id={} finish={} prompt_tokens={} completion_tokens={} e2e_s={:.4f} status=\"{}\"",
      ev.id, to_string(ev.finish), s.prompt_tokens, s.completion_tokens, seconds(now - s.call->arrival()),
      ev.status.ToString());
  if (ev.finish == FinishReason::error) {
    if (ev.status.code() == absl::StatusCode::kInternal) set_healthy(false);
    metrics_.count_failed(code_name(ev.status));
    s.call->finish_error(with_hint(ev.status));
  } else {
    v1::GenerateResponse fin;
    fin.set_finish_reason(to_proto(ev.finish));
    v1::Usage* u = fin.mutable_usage();
    u->set_prompt_tokens(uint32_t(s.prompt_tokens));
    u->set_completion_tokens(uint32_t(s.completion_tokens));
    u->set_cached_tokens(uint32_t(s.cached_tokens));
    if (s.completion_tokens > 0) u->set_time_to_first_token_s(seconds(s.first_token - s.call->arrival()));
    u->set_e2e_latency_s(seconds(now - s.call->arrival()));
    metrics_.e2e.observe(u->e2e_latency_s());
    metrics_.count_finished(to_string(ev.finish));
    s.call->finish_ok(std::move(fin));
  }
  streams_.erase(it);
}

void EngineLoop::abort_sequence(SeqId id) {
  if (auto it = streams_.find(id); it != streams_.end()) {
    (void)sched_->abort(id);
    TokenEvent ev;
    ev.id = id;
    ev.finish = FinishReason::abort;
    on_event(ev);
  } else {
    (void)sched_->router_release(id);
  }
  dispatch_router_results();
}

void EngineLoop::dispatch_router_results() {
  for (const RouterResult& r : sched_->take_router_results()) {
    auto owner = task_owner_.find(r.id);
    if (owner == task_owner_.end()) continue;
    const uint64_t batch_id = owner->second;
    task_owner_.erase(owner);
    auto b = batches_.find(batch_id);
    if (b == batches_.end()) continue;
    b->second.call->on_result(r);
    if (b->second.call->saw_internal_error()) set_healthy(false);
    if (b->second.call->done()) complete_batch(batch_id, absl::OkStatus());
  }
}

void EngineLoop::add_batch(std::unique_ptr<BatchCall> call, Flag cancelled, Done done) {
  if (call->saw_internal_error()) set_healthy(false);
  if (call->done()) {
    metrics_.add_generation_tokens(call->generated_tokens());
    return done(absl::OkStatus());
  }
  const uint64_t id = next_batch_id_++;
  for (SeqId seq : call->running()) task_owner_[seq] = id;
  batches_[id] = Batch{std::move(call), std::move(cancelled), std::move(done)};
  publish_load();  // in flight from now on (see generate())
}

void EngineLoop::complete_batch(uint64_t batch_id, const absl::Status& st) {
  auto node = batches_.extract(batch_id);
  Batch& b = node.mapped();
  for (SeqId seq : b.call->running()) task_owner_.erase(seq);
  metrics_.add_generation_tokens(b.call->generated_tokens());
  publish_load();  // a caller that sees the response also sees the pages it freed
  b.done(st);
}

void EngineLoop::end_everything(const absl::Status& why) {
  flush_events();
  for (const TokenEvent& ev : sched_->fail_all(why)) on_event(ev);
  for (auto& [id, s] : streams_) s.call->finish_error(why);
  streams_.clear();
  dispatch_router_results();
  std::vector<uint64_t> left;
  for (const auto& [id, _] : batches_) left.push_back(id);
  for (uint64_t id : left) {
    batches_.at(id).call->cancel(*sched_, why);
    dispatch_router_results();
    if (batches_.count(id)) complete_batch(id, why);
  }
  for (SeqId id : sched_->router_sequence_ids()) (void)sched_->router_release(id);
  dispatch_router_results();
}

// ---- Load ------------------------------------------------------------------------------

void EngineLoop::fill_load(v1::GetLoadResponse* resp) const {
  const KvPool& pool = engine_->pool();
  resp->set_num_running(uint32_t(sched_->num_running() + sched_->num_router_sequences()));
  resp->set_num_waiting(uint32_t(sched_->num_waiting()));
  for (PoolKind kind : {PoolKind::full, PoolKind::swa}) {
    if (kind == PoolKind::swa && !pool.has_swa()) continue;
    const PoolUsage u = pool.usage(kind);
    v1::PoolLoad* p = resp->add_pools();
    p->set_pool(kind == PoolKind::full ? "full" : "swa");
    p->set_total_pages(uint64_t(u.total_pages));
    p->set_used_pages(uint64_t(u.used_pages));
    p->set_free_pages(uint64_t(u.free_pages));
    p->set_shared_pages(uint64_t(u.shared_pages));
  }
  const PoolUsage full = pool.usage(PoolKind::full);
  resp->set_kv_usage(full.total_pages > 0 ? double(full.used_pages) / double(full.total_pages) : 0.0);
  resp->set_num_router_sequences(uint32_t(sched_->num_router_sequences()));
  resp->set_num_streams(uint32_t(streams_.size()));
  resp->set_serving(state_.load() == LoopState::serving && healthy_.load() && !watchdog_.stalled());
}

void EngineLoop::publish_load() {
  if (!sched_) {
    in_flight_ = 0;
    return;
  }
  LoadGauges g;
  g.running = int64_t(sched_->num_running() + sched_->num_router_sequences());
  g.waiting = int64_t(sched_->num_waiting());
  g.router_sequences = int64_t(sched_->num_router_sequences());
  g.streams = int64_t(streams_.size());
  const KvPool& pool = engine_->pool();
  g.full_used = pool.usage(PoolKind::full).used_pages;
  g.full_total = pool.usage(PoolKind::full).total_pages;
  if (pool.has_swa()) {
    g.swa_used = pool.usage(PoolKind::swa).used_pages;
    g.swa_total = pool.usage(PoolKind::swa).total_pages;
  }
  g.preemptions = sched_->num_preemptions();
  metrics_.set_load(g);
  in_flight_ = int64_t(streams_.size() + batches_.size() + sched_->num_router_sequences());
}

int64_t EngineLoop::retry_after_ms() const {
  // Pages come back as requests finish, which takes some steps: a few dozen steps is
  // a fair first guess for when a retry can find room.
  const double ms = 20.0 * std::max(1.0, step_ms_ewma_);
  return int64_t(std::clamp(ms, 50.0, 5000.0));
}

absl::Status EngineLoop::with_hint(absl::Status st) const {
  if (st.code() == absl::StatusCode::kResourceExhausted)
    return with_retry_after(std::move(st), retry_after_ms());
  return st;
}

uint64_t EngineLoop::next_generate_id() {
  // Server-picked ids live in the upper half of the id space; a client that picks its
  // own ids is still checked against them.
  while (sched_->contains(next_auto_id_) || streams_.count(next_auto_id_) || next_auto_id_ == 0)
    ++next_auto_id_;
  return next_auto_id_++;
}

}  // namespace kvfuse::server
