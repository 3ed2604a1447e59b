#include "src/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvfuse {

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::none:
      return "none";
    case FinishReason::length:
      return "length";
    case FinishReason::stop:
      return "stop";
    case FinishReason::abort:
      return "abort";
    case FinishReason::error:
      return "error";
  }
  return "?";
}

Scheduler::Scheduler(Engine& engine, SchedulerLimits limits) : engine_(engine), limits_(limits) {}

bool Scheduler::contains(SeqId id) const {
  auto match = [id](const Entry& e) { return e.req.id == id; };
  return std::any_of(running_.begin(), running_.end(), match) || std::any_of(waiting_.begin(), waiting_.end(), match);
}

PagesNeeded Scheduler::pages_to_finish_prefill(const Entry& e) const {
  // Pages the sequence still needs to hold its whole prompt plus the first sampled
  // token. For SWA, the window plus one step's chunk bounds what is held at once.
  const auto& cfg = engine_.config();
  const int64_t ps = cfg.page_size;
  const int64_t len = int64_t(e.tokens.size()) + 1;
  PagesNeeded need;
  const auto* s = engine_.sequence(e.req.id);
  const int64_t held_full = s ? int64_t(engine_.pool().page_table(e.req.id, PoolKind::full).size()) : 0;
  need.full = std::max<int64_t>(0, (len + ps - 1) / ps - held_full);
  if (engine_.pool().has_swa()) {
    const int64_t span = std::min<int64_t>(len, int64_t(engine_.pool().config().window) + cfg.max_batch_tokens);
    need.swa = (span + ps - 1) / ps + 1;
    if (s) {
      int64_t held = 0;
      for (int32_t p : engine_.pool().page_table(e.req.id, PoolKind::swa)) held += p >= 0;
      need.swa = std::max<int64_t>(0, need.swa - held);
    }
  }
  return need;
}

bool Scheduler::can_admit(const Entry& e) const {
  // Admit only if every running sequence can still finish its prefill afterwards, so
  // that prefill chunks never starve each other (decode growth is handled by preemption).
  PagesNeeded promised;
  for (const Entry& r : running_) {
    const PagesNeeded n = pages_to_finish_prefill(r);
    promised.full += n.full;
    promised.swa += n.swa;
  }
  const PagesNeeded need = pages_to_finish_prefill(e);
  const KvPool& pool = engine_.pool();
  if (pool.usage(PoolKind::full).free_pages - promised.full < need.full) return false;
  if (pool.has_swa() && pool.usage(PoolKind::swa).free_pages - promised.swa < need.swa) return false;
  return true;
}

absl::Status Scheduler::submit(GenerateRequest req) {
  const auto& cfg = engine_.config();
  if (contains(req.id) || engine_.sequence(req.id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", req.id, " already exists"));
  }
  if (req.prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (req.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens ", req.max_new_tokens, " must be >= 1"));
  }
  if (int64_t(req.prompt.size()) + 1 > cfg.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", req.prompt.size(), " tokens exceeds max_seq_len ", cfg.max_seq_len, " - 1"));
  }
  const int32_t vocab = engine_.spec().vocab;
  for (size_t i = 0; i < req.prompt.size(); ++i) {
    if (req.prompt[i] < 0 || req.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", req.prompt[i], " at index ", i,
                                                     " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (auto st = validate_sampling(req.sampling, vocab); !st.ok()) return st;
  if (waiting_.size() >= limits_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat("waiting queue is full (", limits_.max_waiting, " requests)"));
  }
  Entry e;
  e.tokens = req.prompt;
  e.req = std::move(req);
  const PagesNeeded need = pages_to_finish_prefill(e);
  const KvPool& pool = engine_.pool();
  if (need.full > pool.usage(PoolKind::full).total_pages ||
      (pool.has_swa() && need.swa > pool.usage(PoolKind::swa).total_pages)) {
    return absl::ResourceExhaustedError(absl::StrCat("prompt of ", e.tokens.size(),
                                                     " tokens needs more KV pages than the pool holds"));
  }
  waiting_.push_back(std::move(e));
  return absl::OkStatus();
}

absl::Status Scheduler::admit(Entry& e) {
  return engine_.add_sequence(e.req.id, e.tokens, e.req.sampling, e.rng ? &*e.rng : nullptr);
}

TokenEvent Scheduler::finish(Entry& e, FinishReason reason, absl::Status status) {
  if (engine_.sequence(e.req.id)) (void)engine_.release(e.req.id);
  TokenEvent ev;
  ev.id = e.req.id;
  ev.finish = reason;
  ev.status = std::move(status);
  ev.prompt_tokens = int32_t(e.req.prompt.size());
  ev.completion_tokens = e.generated;
  return ev;
}

absl::Status Scheduler::abort(SeqId id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->req.id == id) {
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
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
}

void Scheduler::preempt(size_t i) {
  // Recompute later: keep the tokens and the sampler state, free the pages now.
  Entry e = std::move(running_[i]);
  running_.erase(running_.begin() + int64_t(i));
  if (const auto* s = engine_.sequence(e.req.id)) e.rng = s->rng;
  (void)engine_.release(e.req.id);
  waiting_.push_front(std::move(e));
  ++preemptions_;
}

absl::StatusOr<std::vector<TokenEvent>> Scheduler::step() {
  const auto& cfg = engine_.config();
  std::vector<TokenEvent> events;

  while (!waiting_.empty() && int64_t(running_.size()) < cfg.max_running_seqs && can_admit(waiting_.front())) {
    Entry e = std::move(waiting_.front());
    waiting_.pop_front();
    if (auto st = admit(e); !st.ok()) {
      events.push_back(finish(e, FinishReason::error, st));
      continue;
    }
    running_.push_back(std::move(e));
  }
  if (running_.empty()) return events;

  // Decodes first (one token each), then prefill chunks in arrival order.
  std::vector<StepItem> items;
  std::vector<size_t> owner;
  int64_t budget = cfg.max_batch_tokens;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
      const SequenceState* s = engine_.sequence(running_[i].req.id);
      const int32_t pending = s->num_pending();
      if ((pass == 0) != (pending == 1)) continue;
      const int32_t n = int32_t(std::min<int64_t>(pending, budget));
      items.push_back({s->id, n, n == pending});
      owner.push_back(i);
      budget -= n;
    }
  }
  auto results = engine_.step(items);
  if (!results.ok()) return results.status();

  std::vector<size_t> to_preempt;
  std::vector<bool> done(running_.size(), false);
  for (size_t r = 0; r < results->size(); ++r) {
    const StepResult& res = (*results)[r];
    Entry& e = running_[owner[r]];
    if (res.status.code() == absl::StatusCode::kResourceExhausted) {
      to_preempt.push_back(owner[r]);
      continue;
    }
    if (!res.status.ok()) {
      events.push_back(finish(e, FinishReason::error, res.status));
      done[owner[r]] = true;
      continue;
    }
    if (!res.token) continue;
    e.tokens.push_back(*res.token);
    ++e.generated;
    TokenEvent ev;
    ev.id = e.req.id;
    ev.token = res.token;
    const bool stop = std::find(e.req.stop_token_ids.begin(), e.req.stop_token_ids.end(), *res.token) !=
                      e.req.stop_token_ids.end();
    const bool length = e.generated >= e.req.max_new_tokens || int64_t(e.tokens.size()) >= cfg.max_seq_len;
    if (stop || length) {
      TokenEvent fin = finish(e, stop ? FinishReason::stop : FinishReason::length);
      ev.finish = fin.finish;
      ev.prompt_tokens = fin.prompt_tokens;
      ev.completion_tokens = fin.completion_tokens;
      done[owner[r]] = true;
    }
    events.push_back(ev);
  }

  // A sequence that could not get pages gives way: preempt the latest-admitted running
  // sequences until it fits, or fail it if it is alone and still cannot.
  std::sort(to_preempt.begin(), to_preempt.end());
  std::vector<Entry> kept;
  std::vector<size_t> failed;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (done[i]) continue;
    kept.push_back(std::move(running_[i]));
    if (std::binary_search(to_preempt.begin(), to_preempt.end(), i)) failed.push_back(kept.size() - 1);
  }
  running_ = std::move(kept);
  if (!failed.empty()) {
    if (running_.size() == 1) {
      events.push_back(finish(running_[0], FinishReason::error,
                              absl::ResourceExhaustedError("sequence does not fit in the KV pool on its own")));
      running_.clear();
    } else {
      // Preempting the newest sequence frees its pages for the older ones next step.
      preempt(running_.size() - 1);
    }
  }
  return events;
}

}  // namespace kvfuse
