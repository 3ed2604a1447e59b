#include "server/engine_loop.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

EngineLoop::EngineLoop(LoopOptions opts, ServerMetrics& metrics, std::function<void(bool)> on_serving)
    : opts_(std::move(opts)),
      metrics_(metrics),
      info_(metrics),
      life_(opts_, std::move(on_serving)),
      intake_(work_, life_, info_, metrics, [this](SeqId id) { abort_sequence(id); }),
      kv_events_(size_t(opts_.config.kv_events_history)) {}

EngineLoop::~EngineLoop() {
  if (thread_.joinable()) stop(absl::UnavailableError("server is shutting down"));
  life_.stop_watchdog();  // before the members its callback uses are gone
}

void EngineLoop::start() {
  thread_ = std::thread([this] { run(); });
  life_.start_watchdog();
}

void EngineLoop::begin_drain() {
  life_.begin_drain();
  intake_.wake();
}

void EngineLoop::stop(const absl::Status& why) {
  life_.request_stop(why);
  intake_.wake();
  // stop() may race with itself (a second signal during a drain); join once.
  std::lock_guard join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
  life_.stop_watchdog();
}

// ---- The loop ----------------------------------------------------------------------------

void EngineLoop::run() {
  life_.warm_up(work_, info_);
  info_.publish_load(work_);

  auto stopping = [this] { return life_.stop_requested(); };
  auto has_work = [this] { return work_.started() && work_.sched->has_work(); };
  for (;;) {
    life_.beat(false);
    LoopIntake::Turn turn = intake_.wait(stopping, has_work);
    life_.beat(true);
    // A command may end or add a stream: the events held back from the last step go first.
    if (!turn.commands.empty() || turn.stopping) flush_events();
    for (auto& cmd : turn.commands) {
      cmd();
      if (work_.started()) dispatch_router_results();
    }
    if (work_.started()) end_cancelled();
    if (turn.stopping) break;
    if (has_work()) step();
    if (work_.started() && !work_.sched->has_work()) flush_events();  // no next step to overlap them with
    publish_kv_events();
    info_.publish_load(work_);
  }
  life_.beat(false);

  // Commands posted until now run with state stopped (they answer UNAVAILABLE); later
  // ones run on the posting thread (see LoopIntake::post()).
  const absl::Status why = life_.enter_stopped(work_.started() ? work_.in_flight() : 0);
  for (auto& cmd : intake_.close()) cmd();
  if (work_.started()) end_everything(why);
  publish_kv_events();
  kv_events_.close(why);
  info_.publish_load(work_);
}

void EngineLoop::publish_kv_events() {
  if (work_.started()) kv_events_.publish(work_.engine->pool().take_kv_events());
}

void EngineLoop::step() {
  Scheduler& sched = *work_.sched;
  const uint64_t steps_before = sched.num_steps();
  auto fail = [this, &sched](const absl::Status& st) {
    // The device state is unknown: end everything in flight, report unhealthy.
    spdlog::error("event=step_failed error=\"{}\"", st.ToString());
    life_.set_healthy(false);
    // A tensor-parallel group that was aborted stays so until restarted: FAILED_PRECONDITION
    // (as the engine says), not a fault a retry here could get past.
    const absl::Status why(work_.engine->group_failure().ok() ? absl::StatusCode::kInternal
                                                              : absl::StatusCode::kFailedPrecondition,
                           absl::StrCat("engine step failed: ", st.message()));
    flush_events();
    for (const TokenEvent& ev : sched.fail_all(why)) on_event(ev);
    dispatch_router_results();
  };
  auto planned = sched.begin_step();
  if (!planned.ok()) return fail(planned.status());
  // The device runs the step from here until end_step(): the previous step's tokens go
  // to their streams meanwhile, then this step's planning events (in that order, so that
  // a request's last token comes before its failure to fit).
  flush_events();
  for (const TokenEvent& ev : *planned) on_event(ev);
  if (!sched.step_in_flight()) return dispatch_router_results();
  auto events = sched.end_step();
  if (!events.ok()) return fail(events.status());
  if (sched.num_steps() != steps_before) {
    const StepTimings& t = work_.engine->last_timings();
    metrics_.step.observe(t.total_ms / 1000.0);
    metrics_.step_tokens.observe(double(t.num_tokens));
    work_.retry.observe_step(t.total_ms);
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
  auto it = work_.streams.find(ev.id);
  if (it == work_.streams.end()) return;
  LoopWork::Stream& s = it->second;
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
      s.call->push_token(*ev.token, s.cached_tokens, &lp);
    } else {
      s.call->push_token(*ev.token, s.cached_tokens, nullptr);
    }
  }
  if (ev.finish == FinishReason::none) return;
  spdlog::debug(
      "event=request_done id={} finish={} prompt_tokens={} completion_tokens={} e2e_s={:.4f} status=\"{}\"",
      ev.id, to_string(ev.finish), s.prompt_tokens, s.completion_tokens, seconds(now - s.call->arrival()),
      ev.status.ToString());
  if (ev.finish == FinishReason::error) {
    if (ev.status.code() == absl::StatusCode::kInternal) life_.set_healthy(false);
    metrics_.count_failed(absl::StatusCodeToString(ev.status.code()));
    s.call->finish_error(work_.retry.attach(ev.status));
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
  work_.streams.erase(it);
}

void EngineLoop::abort_sequence(SeqId id) {
  if (work_.streams.count(id)) {
    (void)work_.sched->abort(id);
    TokenEvent ev;
    ev.id = id;
    ev.finish = FinishReason::abort;
    on_event(ev);
  } else {
    (void)work_.sched->router_release(id);
  }
  dispatch_router_results();
}

void EngineLoop::dispatch_router_results() {
  for (const RouterResult& r : work_.sched->take_router_results()) intake_.on_router_result(r);
}

// ---- Ending work -------------------------------------------------------------------------

void EngineLoop::end_cancelled() {
  // A cancelled or timed-out call frees its pages here, at the step boundary.
  bool any = false;
  for (const auto& [id, s] : work_.streams) any = any || s.call->cancelled();
  for (const auto& [id, b] : work_.batches) any = any || b.is_cancelled();
  if (!any) return;
  flush_events();
  for (auto it = work_.streams.begin(); it != work_.streams.end();) {
    if (!it->second.call->cancelled()) {
      ++it;
      continue;
    }
    (void)work_.sched->abort(it->first);
    metrics_.count_failed("CANCELLED");
    it = work_.streams.erase(it);
  }
  std::vector<uint64_t> cancelled;
  for (const auto& [id, b] : work_.batches) {
    if (b.is_cancelled()) cancelled.push_back(id);
  }
  for (uint64_t id : cancelled) end_batch(id, absl::CancelledError("call cancelled"));
}

void EngineLoop::end_batch(uint64_t batch_id, const absl::Status& why) {
  work_.batches.at(batch_id).call->cancel(*work_.sched, why);
  dispatch_router_results();
  if (work_.batches.count(batch_id)) intake_.complete_batch(batch_id, why);
}

void EngineLoop::end_everything(const absl::Status& why) {
  flush_events();
  for (const TokenEvent& ev : work_.sched->fail_all(why)) on_event(ev);
  for (auto& [id, s] : work_.streams) s.call->finish_error(why);
  work_.streams.clear();
  dispatch_router_results();
  std::vector<uint64_t> left;
  for (const auto& [id, _] : work_.batches) left.push_back(id);
  for (uint64_t id : left) end_batch(id, why);
  for (SeqId id : work_.sched->router_sequence_ids()) (void)work_.sched->router_release(id);
  dispatch_router_results();
}

}  // namespace kvfuse::server
