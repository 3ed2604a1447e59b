#include "server/loop_intake.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/request_validation.h"

namespace kvfuse::server {

LoopIntake::LoopIntake(LoopWork& work, LoopLifecycle& life, ServerInfo& info, ServerMetrics& metrics,
                       std::function<void(SeqId)> end_sequence)
    : work_(work), life_(life), info_(info), metrics_(metrics), end_sequence_(std::move(end_sequence)) {}

// ---- Posting ---------------------------------------------------------------------------

void LoopIntake::post(Command cmd) {
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

void LoopIntake::post_served(CallDone done, std::function<void(const CallDone&)> body) {
  post([this, done = std::move(done), body = std::move(body)] {
    if (auto st = life_.check_available(); !st.ok()) return done(st);
    body(done);
  });
}

void LoopIntake::wake() {
  std::lock_guard lock(mu_);
  woken_ = true;
  cv_.notify_one();
}

LoopIntake::Turn LoopIntake::wait(const std::function<bool()>& stopping,
                                  const std::function<bool()>& has_work) {
  Turn turn;
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !commands_.empty() || woken_ || stopping() || has_work(); });
  turn.commands.swap(commands_);
  woken_ = false;
  turn.stopping = stopping();
  return turn;
}

std::deque<LoopIntake::Command> LoopIntake::close() {
  std::deque<Command> rest;
  std::lock_guard lock(mu_);
  accepting_commands_ = false;
  rest.swap(commands_);
  return rest;
}

// ---- Calls -------------------------------------------------------------------------------

void LoopIntake::prefill(const v1::PrefillRequest* req, v1::PrefillResponse* resp, CancelFlag cancelled,
                         CallDone done) {
  post_served(std::move(done), [this, req, resp, cancelled](const CallDone& done) {
    auto call = BatchCall::prefill(*work_.sched, *work_.engine, *req, resp,
                                   life_.state() == LoopState::serving, work_.retry.after_ms());
    metrics_.add_prompt_tokens(call->prompt_tokens());
    add_batch(std::move(call), cancelled, done);
  });
}

void LoopIntake::decode(const v1::DecodeRequest* req, v1::DecodeResponse* resp, CancelFlag cancelled,
                        CallDone done) {
  post_served(std::move(done), [this, req, resp, cancelled](const CallDone& done) {
    add_batch(BatchCall::decode(*work_.sched, *work_.engine, *req, resp, work_.retry.after_ms()), cancelled,
              done);
  });
}

void LoopIntake::release(const v1::ReleaseRequest* req, v1::ReleaseResponse* resp, CallDone done) {
  post_served(std::move(done), [this, req, resp](const CallDone& done) {
    for (uint64_t id : req->ids()) {
      if (work_.live(id)) {
        end_sequence_(id);
        resp->add_released(id);
      }
    }
    info_.publish_load(work_);
    done(absl::OkStatus());
  });
}

void LoopIntake::abort(uint64_t id, CallDone done) {
  post_served(std::move(done), [this, id](const CallDone& done) {
    if (!work_.live(id)) return done(absl::NotFoundError(absl::StrCat("sequence ", id, " not found")));
    end_sequence_(id);
    info_.publish_load(work_);
    done(absl::OkStatus());
  });
}

void LoopIntake::get_load(v1::GetLoadResponse* resp, CallDone done) {
  post_served(std::move(done), [this, resp](const CallDone& done) {
    info_.fill_load(work_, life_.serving(), resp);
    done(absl::OkStatus());
  });
}

void LoopIntake::flush_cache(v1::FlushCacheResponse* resp, CallDone done) {
  post_served(std::move(done), [this, resp](const CallDone& done) {
    KvPool& pool = work_.engine->pool();
    resp->set_pages_flushed(uint64_t(pool.flush_cache()));
    resp->set_pages_cached(uint64_t(pool.cache_stats().cached_pages));
    spdlog::info("event=cache_flushed pages={} still_cached={}", resp->pages_flushed(), resp->pages_cached());
    info_.publish_load(work_);
    done(absl::OkStatus());
  });
}

void LoopIntake::generate(const v1::GenerateRequest* req, std::shared_ptr<GenerateSink> call) {
  // A copy: a cancelled call may be gone (with its request) before this runs.
  post([this, req = *req, call] {
    if (auto st = life_.check_accepting(); !st.ok()) return call->finish_error(st);
    if (call->cancelled()) return;
    const ServiceLimits& limits = info_.limits();
    GenerateRequest g;
    g.id = req.id() != 0 ? req.id() : next_generate_id();
    g.prompt.assign(req.prompt_ids().begin(), req.prompt_ids().end());
    g.sampling = *to_sampling(req.sampling(), limits.vocab);  // validated on arrival
    g.max_new_tokens = generate_max_tokens(req, limits);
    g.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
    g.ignore_eos = req.ignore_eos();
    g.min_new_tokens = int32_t(req.min_tokens());
    g.logprobs = *to_logprobs(req.logprobs());  // validated on arrival
    const SeqId id = g.id;
    const int32_t prompt_tokens = int32_t(g.prompt.size());
    if (auto st = work_.sched->submit(std::move(g)); !st.ok()) {
      spdlog::debug("event=request_rejected id={} status=\"{}\"", id, st.ToString());
      metrics_.count_failed(absl::StatusCodeToString(st.code()));
      return call->finish_error(work_.retry.attach(st));
    }
    LoopWork::Stream& s = work_.streams[id];
    s.call = call;
    s.prompt_tokens = prompt_tokens;
    metrics_.add_prompt_tokens(prompt_tokens);
    // Counted in flight before its first token can reach the client: a drain that
    // starts once the client has seen a token must wait for the stream.
    info_.publish_load(work_);
    call->accept(id);
  });
}

uint64_t LoopIntake::next_generate_id() {
  // Server-picked ids live in the upper half of the id space; a client that picks its
  // own ids is still checked against them.
  while (work_.sched->contains(next_auto_id_) || work_.streams.count(next_auto_id_) || next_auto_id_ == 0)
    ++next_auto_id_;
  return next_auto_id_++;
}

// ---- Batch calls -------------------------------------------------------------------------

void LoopIntake::add_batch(std::unique_ptr<BatchCall> call, CancelFlag cancelled, CallDone done) {
  if (call->saw_internal_error()) life_.set_healthy(false);
  if (call->done()) {
    metrics_.add_generation_tokens(call->generated_tokens());
    return done(absl::OkStatus());
  }
  const uint64_t id = next_batch_id_++;
  for (SeqId seq : call->running()) task_owner_[seq] = id;
  work_.batches[id] = LoopWork::Batch{std::move(call), std::move(cancelled), std::move(done)};
  info_.publish_load(work_);  // in flight from now on (see generate())
}

void LoopIntake::on_router_result(const RouterResult& r) {
  auto owner = task_owner_.find(r.id);
  if (owner == task_owner_.end()) return;
  const uint64_t batch_id = owner->second;
  task_owner_.erase(owner);
  auto b = work_.batches.find(batch_id);
  if (b == work_.batches.end()) return;
  b->second.call->on_result(r);
  if (b->second.call->saw_internal_error()) life_.set_healthy(false);
  if (b->second.call->done()) complete_batch(batch_id, absl::OkStatus());
}

void LoopIntake::complete_batch(uint64_t batch_id, const absl::Status& st) {
  auto node = work_.batches.extract(batch_id);
  LoopWork::Batch& b = node.mapped();
  for (SeqId seq : b.call->running()) task_owner_.erase(seq);
  metrics_.add_generation_tokens(b.call->generated_tokens());
  info_.publish_load(work_);  // a caller that sees the response also sees the pages it freed
  b.done(st);
}

}  // namespace kvfuse::server
