// Router-driven sequences of the Scheduler (see scheduler.h): a router creates and
// extends them and asks for work in tasks; their items join the same engine steps as
// the generate requests'.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/runtime/scheduler.h"

namespace kvfuse {

namespace {
absl::Status not_found(SeqId id) { return absl::NotFoundError(absl::StrCat("sequence ", id, " not found")); }
absl::Status busy(SeqId id) {
  // ABORTED: a concurrency conflict that the caller resolves by retrying once the
  // other call on this sequence is done.
  return absl::AbortedError(absl::StrCat("sequence ", id, " is busy with another call"));
}
}  // namespace

bool Scheduler::router_busy(SeqId id) const {
  auto it = router_.find(id);
  return it != router_.end() && it->second.task.has_value();
}

std::vector<SeqId> Scheduler::router_sequence_ids() const {
  std::vector<SeqId> ids;
  ids.reserve(router_.size());
  for (const auto& [id, _] : router_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

PagesNeeded Scheduler::pages_to_reach(SeqId id, int64_t new_len) const {
  return pool_.pages_to_reach(id, int32_t(std::min<int64_t>(new_len, cfg_.max_seq_len)));
}

absl::Status Scheduler::check_router_capacity(SeqId id, int64_t new_len) const {
  // (The sequence itself has no task now, so nothing of its own is in `promised`.)
  const PagesNeeded need = pages_to_reach(id, new_len);
  PagesNeeded takeable;
  for (const Entry& e : running_) {
    const PagesNeeded h = pool_.pages_held(e.req.id);
    takeable.full += h.full;
    takeable.swa += h.swa;
  }
  // Pages promised to other router tasks are not free for this one.
  const PagesNeeded promised = router_pages_promised();
  const KvPool& pool = pool_;
  const int64_t free_full = pool.usage(PoolKind::full).free_pages - promised.full;
  if (need.full > free_full + takeable.full ||
      (pool.has_swa() && need.swa > pool.usage(PoolKind::swa).free_pages - promised.swa + takeable.swa)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence ", id, " needs ", need.full, " more KV pages; ", std::max<int64_t>(0, free_full),
        " are free and ", takeable.full, " can be freed for it"));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::router_prefill(SeqId id, std::vector<int32_t> tokens, const SamplingParams& sampling,
                                       bool extend, bool sample, std::optional<StopRules> stop,
                                       std::optional<LogprobsOptions> logprobs) {
  if (tokens.empty()) return absl::InvalidArgumentError(extend ? "no tokens to append" : "empty prompt");
  if (logprobs) KVFUSE_RETURN_IF_ERROR(validate_logprobs(*logprobs));
  if (!extend) {
    if (contains(id) || seqs_.get(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
    }
    KVFUSE_RETURN_IF_ERROR(check_router_capacity(id, int64_t(tokens.size())));
    KVFUSE_RETURN_IF_ERROR(seqs_.add(id, std::move(tokens), sampling, SequenceOwner::router));
    if (absl::Status st = seqs_.admit(id, !(logprobs && logprobs->prompt)); !st.ok()) {
      (void)seqs_.release(id);
      return st;
    }
    RouterSeq& rs = router_[id];
    rs.generation = next_router_generation_++;
    if (stop) rs.stop = std::move(*stop);
    if (logprobs) rs.logprobs = *logprobs;
  } else {
    if (!router_.count(id)) return not_found(id);
    if (router_busy(id)) return busy(id);
    const int64_t len = int64_t(seqs_.get(id)->tokens.size()) + int64_t(tokens.size());
    KVFUSE_RETURN_IF_ERROR(check_router_capacity(id, len));
    KVFUSE_RETURN_IF_ERROR(seqs_.append(id, tokens));
    RouterSeq& rs = router_[id];
    rs.finished = FinishReason::none;
    if (stop) {
      rs.stop = std::move(*stop);
      rs.generated = 0;
    }
    if (logprobs) rs.logprobs = *logprobs;
  }
  start_router_task(id, sample ? 1 : 0);
  return absl::OkStatus();
}

absl::Status Scheduler::router_resume(SeqId id, bool sample) {
  if (!router_.count(id)) return not_found(id);
  if (router_busy(id)) return busy(id);
  const Sequence* s = seqs_.get(id);
  if (s->num_pending() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " has no pending token to compute"));
  }
  KVFUSE_RETURN_IF_ERROR(check_router_capacity(id, int64_t(s->tokens.size())));
  start_router_task(id, sample ? 1 : 0);
  return absl::OkStatus();
}

uint64_t Scheduler::router_generation(SeqId id) const {
  auto it = router_.find(id);
  return it == router_.end() ? 0 : it->second.generation;
}

FinishReason Scheduler::router_finish(SeqId id) const {
  auto it = router_.find(id);
  return it == router_.end() ? FinishReason::none : it->second.finished;
}

absl::Status Scheduler::router_decode(SeqId id, int32_t steps, std::optional<StopRules> stop,
                                      std::optional<LogprobsOptions> logprobs, int32_t counted) {
  if (!router_.count(id)) return not_found(id);
  if (router_busy(id)) return busy(id);
  if (steps < 1) return absl::InvalidArgumentError(absl::StrCat("steps ", steps, " must be >= 1"));
  if (logprobs) KVFUSE_RETURN_IF_ERROR(validate_logprobs(*logprobs));
  RouterSeq& rs = router_.at(id);
  if (!stop && rs.finished != FinishReason::none) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " finished (", to_string(rs.finished),
                                                      "): release it, or decode with new stop rules"));
  }
  const Sequence* s = seqs_.get(id);
  // The tokens an earlier attempt sampled, under this call's rules.
  FinishReason finish = FinishReason::none;
  if (stop && counted > 0) {
    const size_t first = s->tokens.size() - size_t(counted);
    for (int32_t k = 0; k < counted && finish == FinishReason::none; ++k) {
      finish = stop_reason(*stop, spec_.eos_token_ids, s->tokens[first + size_t(k)], k + 1);
      if (finish != FinishReason::none && k + 1 < counted) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence ", id, ": this call's stop rules end it at its token ", first + size_t(k),
            ", but it holds ", counted - k - 1, " more past expected_len: not a retry of the call that made them"));
      }
    }
  }
  if (finish == FinishReason::none) {
    if (s->num_pending() == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", id,
                       " has no token to decode from: its last prefill sampled nothing; prefill more tokens"));
    }
    // Every step but the last computes the token sampled by the step before.
    KVFUSE_RETURN_IF_ERROR(check_router_capacity(id, int64_t(s->tokens.size()) + steps - 1));
  }
  if (stop) {
    rs.stop = std::move(*stop);
    rs.generated = counted;
    rs.finished = finish;
  }
  if (logprobs) rs.logprobs = *logprobs;
  if (finish == FinishReason::none) start_router_task(id, steps);
  return absl::OkStatus();
}

std::vector<TokenLogprob> Scheduler::router_logprobs(SeqId id, int64_t from) const {
  auto it = router_.find(id);
  const Sequence* s = seqs_.get(id);
  if (it == router_.end() || !s) return {};
  const RouterSeq& rs = it->second;
  const int64_t len = int64_t(s->tokens.size());
  if (from < 0 || from > len || rs.recent_end != len || int64_t(rs.recent_logprobs.size()) < len - from) return {};
  return {rs.recent_logprobs.end() - (len - from), rs.recent_logprobs.end()};
}

void Scheduler::start_router_task(SeqId id, int32_t samples) {
  const Sequence* s = seqs_.get(id);
  RouterTask task;
  task.samples_left = samples;
  task.target_len = int64_t(s->tokens.size()) + std::max(0, samples - 1);
  task.result.id = id;
  router_[id].task = std::move(task);
  router_active_.push_back(id);
}

void Scheduler::finish_router_task(SeqId id, absl::Status status) {
  auto it = router_.find(id);
  if (it == router_.end() || !it->second.task) return;
  RouterResult r = std::move(it->second.task->result);
  r.status = std::move(status);
  if (const Sequence* s = seqs_.get(id)) r.seq_len = int32_t(s->tokens.size());
  router_results_.push_back(std::move(r));
  it->second.task.reset();
  router_active_.erase(std::find(router_active_.begin(), router_active_.end(), id));
}

void Scheduler::router_stop(SeqId id, const absl::Status& why) { finish_router_task(id, why); }

absl::Status Scheduler::router_release(SeqId id) {
  if (!router_.count(id)) return not_found(id);
  finish_router_task(id, absl::CancelledError(absl::StrCat("sequence ", id, " was released")));
  router_.erase(id);
  return seqs_.release(id);
}

std::vector<RouterResult> Scheduler::take_router_results() {
  std::vector<RouterResult> out;
  out.swap(router_results_);
  return out;
}

PagesNeeded Scheduler::router_pages_promised() const {
  PagesNeeded promised;
  for (SeqId id : router_active_) {
    const PagesNeeded n = pages_to_reach(id, router_.at(id).task->target_len);
    promised.full += n.full;
    promised.swa += n.swa;
  }
  return promised;
}

void Scheduler::apply_router_result(SeqId id, const StepResult& res) {
  if (!res.status.ok()) {
    finish_router_task(id, res.status);
    return;
  }
  RouterSeq& rs = router_.at(id);
  RouterTask& t = *rs.task;
  t.result.prompt_logprobs.insert(t.result.prompt_logprobs.end(), res.prompt_logprobs.begin(),
                                  res.prompt_logprobs.end());
  if (res.logprob) t.result.logprobs.push_back(*res.logprob);
  if (res.token) {
    // Kept for a replay of this call (router_logprobs): the new token is the last.
    const int64_t len = int64_t(seqs_.get(id)->tokens.size());
    if (!res.logprob || rs.recent_end != len - 1) rs.recent_logprobs.clear();
    if (res.logprob) {
      rs.recent_logprobs.push_back(*res.logprob);
      if (rs.recent_logprobs.size() > limits_.replay_logprobs) rs.recent_logprobs.pop_front();
    }
    rs.recent_end = len;
    t.result.tokens.push_back(*res.token);
    --t.samples_left;
    rs.finished = stop_reason(rs.stop, spec_.eos_token_ids, *res.token, ++rs.generated);
    if (rs.finished != FinishReason::none) {
      t.result.finish = rs.finished;
      finish_router_task(id, absl::OkStatus());
      return;
    }
  }
  // Done when every sample is taken; a compute-only task when nothing is pending.
  if (t.samples_left == 0 && (res.token || seqs_.get(id)->num_pending() == 0)) {
    finish_router_task(id, absl::OkStatus());
  }
}

}  // namespace kvfuse
