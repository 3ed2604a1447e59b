#include "server/batch_calls.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/request_validation.h"
#include "server/status_codes.h"

namespace kvfuse::server {

void BatchCall::set_status(int index, const absl::Status& st) {
  absl::Status s = st;
  if (s.code() == absl::StatusCode::kResourceExhausted) s = with_retry_after(s, retry_after_ms_);
  if (s.code() == absl::StatusCode::kInternal) saw_internal_ = true;
  to_proto(s, prefill_ ? prefill_->mutable_results(index)->mutable_status()
                       : decode_->mutable_results(index)->mutable_status());
}

namespace {

// What a Prefill with expected_len finds: its tokens not yet appended (run it),
// appended but not finished by an earlier attempt (resume that work), or finished.
enum class Replay { none, resume, done };

absl::StatusOr<Replay> prefill_replay(const Scheduler& sched, const Engine& engine,
                                      const v1::PrefillSequence& s) {
  const Sequence* seq = sched.is_router_sequence(s.id()) ? engine.sequence(s.id()) : nullptr;
  if (!seq) return Replay::none;  // a new sequence is created; an extend is NOT_FOUND
  const int64_t len = int64_t(seq->tokens.size());
  const int64_t e = s.expected_len();
  const int64_t n = s.token_ids_size();
  if (s.extend() && len == e) return Replay::none;
  if (sched.router_busy(s.id())) {
    return absl::AbortedError(absl::StrCat("sequence ", s.id(), " is busy with another call"));
  }
  const bool sample = !s.no_sample();
  const bool chunk_there =
      len >= e + n && std::equal(s.token_ids().begin(), s.token_ids().end(), seq->tokens.begin() + e);
  if (chunk_there && len == e + n && seq->num_pending() > 0) return Replay::resume;
  if (chunk_there && len == e + n && !sample) return Replay::done;
  if (chunk_there && len == e + n + 1 && sample && seq->num_pending() == 1) return Replay::done;
  if (!s.extend()) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", s.id(), " already exists with ", len,
                                                 " tokens that this prompt of ", n, " did not make"));
  }
  return absl::FailedPreconditionError(absl::StrCat("sequence ", s.id(), " has ", len,
                                                    " tokens; expected_len ", e, " plus this chunk of ", n,
                                                    " cannot match it"));
}

// The logprobs of a Decode's replayed tokens (those past expected_len), kept by the
// scheduler when the earlier attempt computed them.
void add_replayed_logprobs(const Scheduler& sched, const v1::DecodeSequence& s, v1::DecodeResult* r) {
  if (!s.has_expected_len() || r->token_ids_size() == 0) return;
  for (const TokenLogprob& t : sched.router_logprobs(s.id(), s.expected_len())) to_proto(t, r->add_logprobs());
}

}  // namespace

std::unique_ptr<BatchCall> BatchCall::prefill(Scheduler& sched, const Engine& engine,
                                              const v1::PrefillRequest& req, v1::PrefillResponse* resp,
                                              bool accept_new, int64_t retry_after_ms) {
  std::unique_ptr<BatchCall> call(new BatchCall(resp, nullptr, retry_after_ms));
  const int32_t vocab = engine.spec().vocab;
  for (int i = 0; i < req.sequences_size(); ++i) {
    const v1::PrefillSequence& s = req.sequences(i);
    v1::PrefillResult* r = resp->add_results();
    r->set_id(s.id());
    absl::Status st;
    Replay replay = Replay::none;
    if (s.has_expected_len()) {
      auto found = prefill_replay(sched, engine, s);
      st = found.status();
      if (found.ok()) replay = *found;
    }
    if (!st.ok()) {
      // The replay check failed: the result says why.
    } else if (replay == Replay::done) {
      // The earlier attempt's answer: its token, the finish it caused and its logprob.
      const std::vector<int32_t>& tokens = engine.sequence(s.id())->tokens;
      if (!s.no_sample()) {
        r->set_token_id(tokens.back());
        r->set_finish_reason(to_proto(sched.router_finish(s.id())));
        const auto lp = sched.router_logprobs(s.id(), int64_t(tokens.size()) - 1);
        if (!lp.empty()) to_proto(lp.back(), r->mutable_logprob());
      }
    } else if (replay == Replay::resume) {
      st = sched.router_resume(s.id(), !s.no_sample());
    } else if (!s.extend() && !accept_new) {
      st = absl::UnavailableError("server is draining: no new sequences");
    } else {
      auto sampling = to_sampling(s.sampling(), vocab);  // validated on arrival; cannot fail here
      st = sampling.status();
      if (st.ok()) {
        std::optional<StopRules> stop;
        if (s.has_stop()) stop = stop_rules(s.stop());  // validated on arrival
        std::optional<LogprobsOptions> logprobs;
        if (s.has_logprobs()) logprobs = *to_logprobs(s.logprobs());  // validated on arrival
        st = sched.router_prefill(s.id(), std::vector<int32_t>(s.token_ids().begin(), s.token_ids().end()),
                                  *sampling, s.extend(), !s.no_sample(), std::move(stop), logprobs);
      }
    }
    if (const Sequence* seq = engine.sequence(s.id()); seq && sched.is_router_sequence(s.id())) {
      r->set_seq_len(uint32_t(seq->tokens.size()));
      if (st.ok() && !s.extend()) r->set_cached_tokens(uint32_t(seq->num_cached));
    }
    if (!st.ok()) {
      call->set_status(i, st);
      continue;
    }
    if (replay == Replay::done) continue;
    if (replay == Replay::none) call->prompt_tokens_ += s.token_ids_size();
    call->index_[s.id()] = i;
    if (!s.extend()) call->created_.push_back({s.id(), sched.router_generation(s.id())});
  }
  return call;
}

std::unique_ptr<BatchCall> BatchCall::decode(Scheduler& sched, const Engine& engine,
                                             const v1::DecodeRequest& req, v1::DecodeResponse* resp,
                                             int64_t retry_after_ms) {
  std::unique_ptr<BatchCall> call(new BatchCall(nullptr, resp, retry_after_ms));
  const int32_t steps = decode_steps(req);
  for (int i = 0; i < req.sequences_size(); ++i) {
    const v1::DecodeSequence& s = req.sequences(i);
    v1::DecodeResult* r = resp->add_results();
    r->set_id(s.id());
    const Sequence* seq = sched.is_router_sequence(s.id()) ? engine.sequence(s.id()) : nullptr;
    if (!seq) {
      call->set_status(i, absl::NotFoundError(absl::StrCat("no router-driven sequence ", s.id())));
      continue;
    }
    const int64_t len = int64_t(seq->tokens.size());
    r->set_seq_len(uint32_t(len));
    int32_t to_run = steps;
    if (sched.router_busy(s.id())) {
      call->set_status(i,
                       absl::AbortedError(absl::StrCat("sequence ", s.id(), " is busy with another call")));
      continue;
    }
    int32_t counted = 0;  // tokens of an earlier attempt that this call's rules count
    if (s.has_expected_len()) {
      // A replay: the tokens past expected_len were produced by an earlier attempt.
      const int64_t produced = len - int64_t(s.expected_len());
      if (produced < 0 || produced > steps) {
        call->set_status(i, absl::FailedPreconditionError(
                                absl::StrCat("sequence ", s.id(), " has ", len, " tokens; expected_len ",
                                             s.expected_len(), " plus ", steps, " steps cannot match it")));
        continue;
      }
      for (int64_t p = s.expected_len(); p < len; ++p) r->add_token_ids(seq->tokens[size_t(p)]);
      to_run = steps - int32_t(produced);
      counted = int32_t(produced);
      // A finished sequence answers with its finish: the earlier attempt's, which this
      // call's rules (a retry carries the same) do not undo; with no token past
      // expected_len, new rules make it live again.
      if (const FinishReason finished = sched.router_finish(s.id());
          finished != FinishReason::none && (produced > 0 || !s.has_stop())) {
        r->set_finish_reason(to_proto(finished));
        add_replayed_logprobs(sched, s, r);
        continue;
      }
    }
    if (to_run == 0) {  // fully replayed
      add_replayed_logprobs(sched, s, r);
      continue;
    }
    std::optional<StopRules> stop;
    if (s.has_stop()) stop = stop_rules(s.stop());  // validated on arrival
    std::optional<LogprobsOptions> logprobs;
    if (s.has_logprobs()) logprobs = *to_logprobs(s.logprobs());  // validated on arrival
    if (auto st = sched.router_decode(s.id(), to_run, std::move(stop), logprobs, counted); !st.ok()) {
      call->set_status(i, st);
      continue;
    }
    add_replayed_logprobs(sched, s, r);
    if (!sched.router_busy(s.id())) {  // this call's rules end the sequence at a replayed token
      r->set_finish_reason(to_proto(sched.router_finish(s.id())));
      continue;
    }
    call->index_[s.id()] = i;
  }
  return call;
}

std::vector<SeqId> BatchCall::running() const {
  std::vector<SeqId> ids;
  ids.reserve(index_.size());
  for (const auto& [id, _] : index_) ids.push_back(id);
  return ids;
}

void BatchCall::on_result(const RouterResult& res) {
  auto it = index_.find(res.id);
  if (it == index_.end()) return;
  const int i = it->second;
  index_.erase(it);
  generated_tokens_ += int64_t(res.tokens.size());
  if (prefill_) {
    v1::PrefillResult* r = prefill_->mutable_results(i);
    if (!res.tokens.empty()) r->set_token_id(res.tokens.back());
    r->set_seq_len(uint32_t(res.seq_len));
    r->set_finish_reason(to_proto(res.finish));
    if (!res.logprobs.empty()) to_proto(res.logprobs.back(), r->mutable_logprob());
    for (const TokenLogprob& t : res.prompt_logprobs) to_proto(t, r->add_prompt_logprobs());
  } else {
    v1::DecodeResult* r = decode_->mutable_results(i);
    for (int32_t t : res.tokens) r->add_token_ids(t);
    r->set_seq_len(uint32_t(res.seq_len));
    r->set_finish_reason(to_proto(res.finish));
    for (const TokenLogprob& t : res.logprobs) to_proto(t, r->add_logprobs());
  }
  if (!res.status.ok()) set_status(i, res.status);
}

void BatchCall::cancel(Scheduler& sched, const absl::Status& why) {
  for (SeqId id : running()) sched.router_stop(id, why);
  // Only the sequences this call still owns: one it created may have been released
  // by another caller and created again under the same id since.
  for (const auto& [id, generation] : created_) {
    if (sched.router_generation(id) == generation) (void)sched.router_release(id);
  }
  // The stopped tasks' results are delivered here by the loop; anything left (a task
  // already gone) gets `why` directly.
  for (const auto& [id, i] : index_) set_status(i, why);
  index_.clear();
}

}  // namespace kvfuse::server
