#include "src/runtime/scheduler.h"

#include <algorithm>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "kernels/common/enum_name.h"
#include "src/common/status_macros.h"

namespace kvfuse {

const char* to_string(FinishReason r) { return enum_name(r, {"none", "length", "stop", "abort", "error"}); }

Scheduler::Scheduler(Engine& engine, SchedulerLimits limits)
    : runner_(engine),
      seqs_(engine.sequences()),
      pool_(engine.pool()),
      cfg_(engine.config()),
      spec_(engine.spec()),
      options_(engine.forward_options()),
      limits_(limits) {}

bool Scheduler::contains(SeqId id) const {
  auto match = [id](const Entry& e) { return e.req.id == id; };
  return router_.count(id) != 0 || std::any_of(running_.begin(), running_.end(), match) ||
         std::any_of(waiting_.begin(), waiting_.end(), match);
}

PagesNeeded Scheduler::pages_to_finish_prefill(const Entry& e) const {
  // The whole prompt (and what it generated before a preemption) plus the first sampled token.
  return pool_.pages_to_hold(e.req.id, int64_t(seqs_.get(e.req.id)->tokens.size()) + 1);
}

bool Scheduler::can_admit(const Entry& e) const {
  // Admit only if every running sequence can still finish its prefill afterwards, and
  // every router task its work, so that prefill chunks never starve each other and a
  // new request does not take the pages a router task is about to use (decode growth
  // of generate requests is handled by preemption).
  PagesNeeded promised = router_pages_promised();
  for (const Entry& r : running_) {
    const PagesNeeded n = pages_to_finish_prefill(r);
    promised.full += n.full;
    promised.swa += n.swa;
  }
  const PagesNeeded need = pages_to_finish_prefill(e);
  const KvPool& pool = pool_;
  if (pool.usage(PoolKind::full).free_pages - promised.full < need.full) return false;
  if (pool.has_swa() && pool.usage(PoolKind::swa).free_pages - promised.swa < need.swa) return false;
  return true;
}

absl::Status validate_logprobs(const LogprobsOptions& o) {
  if (o.top_n < 0 || o.top_n > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs ", o.top_n, " must be in [0, ", kMaxTopLogprobs, "]"));
  }
  return absl::OkStatus();
}

FinishReason stop_reason(const StopRules& rules, const std::vector<int32_t>& eos_token_ids, int32_t token,
                         int32_t generated) {
  auto has = [token](const std::vector<int32_t>& v) { return std::find(v.begin(), v.end(), token) != v.end(); };
  if (generated >= rules.min_new_tokens && (has(rules.stop_token_ids) || (!rules.ignore_eos && has(eos_token_ids)))) {
    return FinishReason::stop;
  }
  if (rules.max_new_tokens > 0 && generated >= rules.max_new_tokens) return FinishReason::length;
  return FinishReason::none;
}

absl::Status Scheduler::submit(GenerateRequest req) {
  const Config& cfg = cfg_;
  if (contains(req.id) || seqs_.get(req.id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", req.id, " already exists"));
  }
  if (req.prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (req.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", req.max_new_tokens, " must be >= 1"));
  }
  // The server's rule for max_tokens (server/request_validation.cc); a request within
  // it still ends at max_seq_len (finish reason length).
  if (req.max_new_tokens > cfg.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens ", req.max_new_tokens, " exceeds max_seq_len ", cfg.max_seq_len));
  }
  if (int64_t(req.prompt.size()) + 1 > cfg.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", req.prompt.size(),
                                                   " tokens exceeds max_seq_len ", cfg.max_seq_len, " - 1"));
  }
  const int32_t vocab = spec_.vocab;
  for (size_t i = 0; i < req.prompt.size(); ++i) {
    if (req.prompt[i] < 0 || req.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", req.prompt[i], " at index ", i,
                                                     " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  KVFUSE_RETURN_IF_ERROR(validate_sampling(req.sampling, vocab));
  KVFUSE_RETURN_IF_ERROR(validate_logprobs(req.logprobs));
  if (waiting_.size() >= limits_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("waiting queue is full (", limits_.max_waiting, " requests)"));
  }
  // The whole prompt plus the first sampled token must fit in an empty pool.
  const PagesNeeded need = pool_.pages_to_hold(req.id, int64_t(req.prompt.size()) + 1);
  if (need.full > pool_.usage(PoolKind::full).total_pages ||
      (pool_.has_swa() && need.swa > pool_.usage(PoolKind::swa).total_pages)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prompt of ", req.prompt.size(), " tokens needs more KV pages than the pool holds"));
  }
  Entry e;
  e.prompt_len = int32_t(req.prompt.size());
  e.stop = StopRules{std::move(req.stop_token_ids), req.ignore_eos, req.max_new_tokens, req.min_new_tokens};
  KVFUSE_RETURN_IF_ERROR(seqs_.add(req.id, std::move(req.prompt), req.sampling, SequenceOwner::generate));
  req.prompt.clear();
  e.req = std::move(req);
  waiting_.push_back(std::move(e));
  return absl::OkStatus();
}

absl::Status Scheduler::admit(Entry& e) {
  // No prefix reuse while the prompt's logprobs are still to be computed.
  const bool reuse = !(e.req.logprobs.prompt && e.generated == 0);
  return seqs_.admit(e.req.id, reuse);
}

TokenEvent Scheduler::finish(Entry& e, FinishReason reason, absl::Status status) {
  (void)seqs_.release(e.req.id);
  TokenEvent ev;
  ev.id = e.req.id;
  ev.finish = reason;
  ev.status = std::move(status);
  ev.prompt_tokens = e.prompt_len;
  ev.completion_tokens = e.generated;
  return ev;
}

absl::Status Scheduler::abort(SeqId id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->req.id == id) {
      (void)seqs_.release(id);
      waiting_.erase(it);
      return absl::OkStatus();
    }
  }
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if (it->req.id == id) {
      finish(*it, FinishReason::abort);
      running_.erase(it);
      return absl::OkStatus();
    }
  }
  if (router_.count(id)) return router_release(id);
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
}

void Scheduler::preempt(size_t i) {
  // Recompute later: the sequence keeps its tokens and sampler state, its pages go now.
  Entry e = std::move(running_[i]);
  running_.erase(running_.begin() + int64_t(i));
  // A prefill cut short is recomputed from the start, its prompt logprobs with it.
  if (e.generated == 0) e.prompt_logprobs.clear();
  seqs_.evict(e.req.id);
  waiting_.push_front(std::move(e));
  ++preemptions_;
}

std::vector<TokenEvent> Scheduler::fail_all(const absl::Status& why) {
  std::vector<TokenEvent> events;
  for (Entry& e : running_) events.push_back(finish(e, FinishReason::error, why));
  for (Entry& e : waiting_) events.push_back(finish(e, FinishReason::error, why));
  running_.clear();
  waiting_.clear();
  for (SeqId id : std::vector<SeqId>(router_active_)) finish_router_task(id, why);
  return events;
}

void Scheduler::admit_waiting(std::vector<TokenEvent>& events) {
  // Router tasks take step slots too: admit only what the next steps can run.
  const auto& cfg = cfg_;
  while (!waiting_.empty() && int64_t(running_.size() + router_active_.size()) < cfg.max_running_seqs &&
         can_admit(waiting_.front())) {
    Entry e = std::move(waiting_.front());
    waiting_.pop_front();
    if (auto st = admit(e); !st.ok()) {
      events.push_back(finish(e, FinishReason::error, st));
      continue;
    }
    running_.push_back(std::move(e));
  }
}

std::optional<StepItem> Scheduler::plan_item(const Owner& owner, const Entry* entry, bool decode_pass,
                                             int64_t budget) {
  const Sequence& s = *seqs_.get(owner.id);
  const int32_t pending = s.num_pending();
  // A router task samples while it has samples left; a generate request always does.
  const RouterSeq* rs = owner.router ? &router_.at(owner.id) : nullptr;
  const bool samples = !rs || rs->task->samples_left > 0;
  if (decode_pass != (pending == 1 && samples)) return std::nullopt;
  const int32_t n = int32_t(std::min<int64_t>(pending, budget));
  StepItem it{owner.id, n, n == pending && samples};
  if (rs && it.sample && int64_t(s.tokens.size()) >= cfg_.max_seq_len) {
    finish_router_task(owner.id, absl::OutOfRangeError(absl::StrCat("sequence ", owner.id,
                                                                    " reached max_seq_len ", cfg_.max_seq_len)));
    return std::nullopt;
  }
  const LogprobsOptions& lp = rs ? rs->logprobs : entry->req.logprobs;
  it.logprobs = lp.enabled && it.sample;
  // A router item's prompt logprobs whenever asked (a decode item's one row has no known
  // next token); a generate request's on its first prefill only: a recomputation after
  // preemption with tokens generated has sent them already.
  it.prompt_logprobs = lp.prompt && (rs || entry->generated == 0);
  it.top_logprobs = lp.top_n;
  return it;
}

void Scheduler::plan_step(Plan& plan) {
  int64_t budget = cfg_.max_batch_tokens;
  const size_t max_items = size_t(cfg_.max_running_seqs);
  const bool router_first = step_count_ % 2 == 0;
  // The candidates: each with its generate request, or none for a router task.
  std::vector<std::pair<Owner, const Entry*>> generate, router;
  for (const Entry& e : running_) generate.push_back({{false, e.req.id}, &e});
  for (SeqId id : router_active_) router.push_back({{true, id}, nullptr});
  for (bool decode_pass : {true, false}) {
    for (const auto* group : {router_first ? &router : &generate, router_first ? &generate : &router}) {
      for (const auto& [owner, entry] : *group) {
        if (budget <= 0 || plan.items.size() >= max_items) break;
        // A router task finished earlier in this plan (max_seq_len) adds nothing.
        if (owner.router && !router_busy(owner.id)) continue;
        std::optional<StepItem> it = plan_item(owner, entry, decode_pass, budget);
        if (!it) continue;
        plan.items.push_back(*it);
        plan.owners.push_back(owner);
        budget -= it->num_tokens;
      }
    }
  }
}

absl::StatusOr<std::vector<TokenEvent>> Scheduler::step() {
  auto events = begin_step();
  if (!events.ok() || !step_in_flight()) return events;
  auto rest = end_step();
  if (!rest.ok()) return rest.status();
  events->insert(events->end(), rest->begin(), rest->end());
  return events;
}

absl::StatusOr<std::vector<TokenEvent>> Scheduler::begin_step() {
  if (in_flight_) return absl::FailedPreconditionError("a step is already in flight (end_step first)");
  std::vector<TokenEvent> events;
  Plan plan = schedule(events);
  if (plan.items.empty()) return events;
  ++step_count_;
  KVFUSE_RETURN_IF_ERROR(runner_.begin(StepPlan{plan.items, options_}));
  in_flight_ = std::move(plan);
  return events;
}

absl::StatusOr<std::vector<TokenEvent>> Scheduler::end_step() {
  if (!in_flight_) return absl::FailedPreconditionError("no step in flight (begin_step first)");
  const Plan plan = std::move(*in_flight_);
  in_flight_.reset();
  auto out = runner_.end();
  if (!out.ok()) return out.status();
  if (result_hook_) result_hook_(out->results);
  std::vector<TokenEvent> events;
  apply_results(out->results, plan.owners, events);
  return events;
}

Scheduler::Plan Scheduler::schedule(std::vector<TokenEvent>& events) {
  admit_waiting(events);
  Plan plan;
  plan_step(plan);
  reserve_pages(plan.items, plan.owners, events);
  return plan;
}

bool Scheduler::reserve(const StepItem& item) { return seqs_.reserve(item.id, item.num_tokens).ok(); }

void Scheduler::reserve_pages(std::vector<StepItem>& items, std::vector<Owner>& owners,
                              std::vector<TokenEvent>& events) {
  // Every item's pages before the step, in plan order (decodes first). A sequence that
  // cannot get them makes room by preempting the latest-admitted generate request —
  // possibly itself — and a generate request alone that still cannot fit fails. Router
  // sequences are never preempted: they take pages from generate requests, and their
  // task fails only when none are left to take.
  std::vector<bool> dropped(items.size(), false);
  auto drop = [&](SeqId id) {
    for (size_t k = 0; k < items.size(); ++k) dropped[k] = dropped[k] || items[k].id == id;
  };
  auto preempt_newest = [&] {
    drop(running_.back().req.id);
    preempt(running_.size() - 1);
  };
  for (size_t k = 0; k < items.size(); ++k) {
    if (dropped[k]) continue;
    const SeqId id = items[k].id;
    while (!reserve(items[k])) {
      if (owners[k].router) {
        if (!running_.empty()) {
          preempt_newest();
          continue;
        }
        finish_router_task(id,
                           absl::ResourceExhaustedError(absl::StrCat(
                               "sequence ", id, ": no free KV pages (the pool is held by other sequences)")));
        drop(id);
        break;
      }
      if (running_.size() == 1) {
        events.push_back(finish(
            running_[0], FinishReason::error,
            absl::ResourceExhaustedError(router_.empty()
                                             ? "sequence does not fit in the KV pool on its own"
                                             : "sequence does not fit in the KV pool beside the router's "
                                               "sequences")));
        running_.clear();
        drop(id);
        break;
      }
      const bool self = running_.back().req.id == id;
      preempt_newest();
      if (self) break;
    }
  }
  size_t kept = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    if (dropped[k]) continue;
    items[kept] = items[k];
    owners[kept] = owners[k];
    ++kept;
  }
  items.resize(kept);
  owners.resize(kept);
}

void Scheduler::apply_results(const std::vector<StepResult>& results, const std::vector<Owner>& owners,
                              std::vector<TokenEvent>& events) {
  const auto& cfg = cfg_;
  std::unordered_map<SeqId, size_t> index;
  for (size_t i = 0; i < running_.size(); ++i) index[running_[i].req.id] = i;
  std::vector<bool> done(running_.size(), false);
  for (size_t r = 0; r < results.size(); ++r) {
    const StepResult& res = results[r];
    if (owners[r].router) {
      apply_router_result(owners[r].id, res);
      continue;
    }
    const size_t i = index.at(owners[r].id);
    Entry& e = running_[i];
    if (!res.status.ok()) {
      events.push_back(finish(e, FinishReason::error, res.status));
      done[i] = true;
      continue;
    }
    e.prompt_logprobs.insert(e.prompt_logprobs.end(), res.prompt_logprobs.begin(), res.prompt_logprobs.end());
    if (!res.token) continue;
    ++e.generated;
    TokenEvent ev;
    ev.id = e.req.id;
    ev.token = res.token;
    ev.logprob = res.logprob;
    if (e.generated == 1) {
      ev.prompt_logprobs = std::move(e.prompt_logprobs);
      ev.cached_tokens = seqs_.get(e.req.id)->num_cached;
    }
    const FinishReason why = stop_reason(e.stop, spec_.eos_token_ids, *res.token, e.generated);
    const bool stop = why == FinishReason::stop;
    const bool length = why == FinishReason::length || int64_t(seqs_.get(e.req.id)->tokens.size()) >= cfg.max_seq_len;
    if (stop || length) {
      TokenEvent fin = finish(e, stop ? FinishReason::stop : FinishReason::length);
      ev.finish = fin.finish;
      ev.prompt_tokens = fin.prompt_tokens;
      ev.completion_tokens = fin.completion_tokens;
      done[i] = true;
    }
    events.push_back(ev);
  }
  std::vector<Entry> kept;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (!done[i]) kept.push_back(std::move(running_[i]));
  }
  running_ = std::move(kept);
}

}  // namespace kvfuse
