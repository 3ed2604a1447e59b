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
    if (!s.extend() && !accept_new) {
      st = absl::UnavailableError("server is draining: no new sequences");
    } else {
      auto sampling = to_sampling(s.sampling(), vocab);  // validated on arrival; cannot fail here
      st = sampling.status();
      if (st.ok()) {
        st = sched.router_prefill(s.id(), std::vector<int32_t>(s.token_ids().begin(), s.token_ids().end()),
                                  *sampling, s.extend(), !s.no_sample());
      }
    }
    if (const SequenceState* seq = engine.sequence(s.id()); seq && sched.is_router_sequence(s.id())) {
      r->set_seq_len(uint32_t(seq->tokens.size()));
    }
    if (!st.ok()) {
      call->set_status(i, st);
      continue;
    }
    call->prompt_tokens_ += s.token_ids_size();
    call->index_[s.id()] = i;
    if (!s.extend()) call->created_.push_back(s.id());
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
    const SequenceState* seq = sched.is_router_sequence(s.id()) ? engine.sequence(s.id()) : nullptr;
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
    if (s.has_expected_len()) {
      // A replay: the tokens past expected_len were produced by the first attempt.
      const int64_t produced = len - int64_t(s.expected_len());
      if (produced < 0 || produced > steps) {
        call->set_status(i, absl::FailedPreconditionError(
                                absl::StrCat("sequence ", s.id(), " has ", len, " tokens; expected_len ",
                                             s.expected_len(), " plus ", steps, " steps cannot match it")));
        continue;
      }
      for (int64_t p = s.expected_len(); p < len; ++p) r->add_token_ids(seq->tokens[size_t(p)]);
      to_run = steps - int32_t(produced);
    }
    if (to_run == 0) continue;  // fully replayed
    if (auto st = sched.router_decode(s.id(), to_run); !st.ok()) {
      call->set_status(i, st);
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
  } else {
    v1::DecodeResult* r = decode_->mutable_results(i);
    for (int32_t t : res.tokens) r->add_token_ids(t);
    r->set_seq_len(uint32_t(res.seq_len));
  }
  if (!res.status.ok()) set_status(i, res.status);
}

void BatchCall::cancel(Scheduler& sched, const absl::Status& why) {
  for (SeqId id : running()) sched.router_stop(id, why);
  for (SeqId id : created_) {
    if (sched.is_router_sequence(id)) (void)sched.router_release(id);
  }
  // The stopped tasks' results are delivered here by the loop; anything left (a task
  // already gone) gets `why` directly.
  for (const auto& [id, i] : index_) set_status(i, why);
  index_.clear();
}

}  // namespace kvfuse::server
