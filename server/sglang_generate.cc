#include "server/sglang_generate.h"

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

// ---- SglangRequestTable --------------------------------------------------------------------

absl::Status SglangRequestTable::add(const std::string& request_id, const std::shared_ptr<SglangGenerateCall>& call) {
  std::lock_guard lock(mu_);
  auto [it, inserted] = live_.try_emplace(request_id, call);
  if (!inserted) {
    if (!it->second.expired()) {
      return absl::AlreadyExistsError(absl::StrCat("request_id \"", request_id, "\" is live"));
    }
    it->second = call;
  }
  return absl::OkStatus();
}

void SglangRequestTable::remove(const std::string& request_id, const SglangGenerateCall* call) {
  std::lock_guard lock(mu_);
  auto it = live_.find(request_id);
  if (it == live_.end()) return;
  auto held = it->second.lock();
  if (!held || held.get() == call) live_.erase(it);
}

std::shared_ptr<SglangGenerateCall> SglangRequestTable::find(const std::string& request_id) const {
  std::lock_guard lock(mu_);
  auto it = live_.find(request_id);
  return it == live_.end() ? nullptr : it->second.lock();
}

std::string SglangRequestTable::make_id() {
  std::lock_guard lock(mu_);
  std::string id;
  do {
    id = absl::StrCat("kvfuse-", next_++);
  } while (live_.count(id));
  return id;
}

// ---- SglangGenerateCall --------------------------------------------------------------------

std::shared_ptr<SglangGenerateCall> SglangGenerateCall::create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                                               std::function<void()> on_cancel,
                                                               std::shared_ptr<SglangRequestTable> table,
                                                               std::function<void(uint64_t)> abort_engine_id) {
  std::shared_ptr<SglangGenerateCall> call(
      new SglangGenerateCall(ctx, max_queued, std::move(on_cancel), std::move(table), std::move(abort_engine_id)));
  call->self_ = call;
  return call;
}

std::optional<uint64_t> SglangGenerateCall::request_abort() {
  std::lock_guard lock(abort_mu_);
  if (engine_id_ != 0) return engine_id_;
  abort_requested_ = true;
  return std::nullopt;
}

void SglangGenerateCall::accept(uint64_t id) {
  bool abort_now = false;
  {
    std::lock_guard lock(abort_mu_);
    engine_id_ = id;
    abort_now = abort_requested_;
  }
  // Posted to the loop: it runs after this command, and the stream ends with "abort".
  if (abort_now && abort_engine_id_) abort_engine_id_(id);
}

sgl::GenerateResponse SglangGenerateCall::message() const {
  sgl::GenerateResponse m;
  m.set_request_id(reply_.request_id);
  return m;
}

namespace {
// A position's most likely tokens, as SGLang lists them.
void add_top(const v1::TokenLogprob& t, sgl::TopLogProbs* top) {
  for (const v1::TopLogprob& e : t.top()) {
    top->add_values(e.logprob());
    top->add_token_ids(uint32_t(e.token_id()));
  }
}
}  // namespace

void SglangGenerateCall::add_logprob(const v1::TokenLogprob& t, sgl::OutputLogProbs* out) const {
  out->add_token_logprobs(t.logprob());
  out->add_token_ids(uint32_t(t.token_id()));
  if (reply_.top_logprobs_num > 0) add_top(t, out->add_top_logprobs());
}

void SglangGenerateCall::set_input_logprobs(const v1::GenerateResponse& lp) {
  sgl::InputLogProbs in;
  const auto& prompt_lp = lp.prompt_logprobs();  // entry i is prompt token i + 1's
  for (size_t i = size_t(reply_.logprob_start_len); i < reply_.input_ids.size(); ++i) {
    sgl::InputTokenLogProb* v = in.add_token_logprobs();
    in.add_token_ids(reply_.input_ids[i]);
    sgl::TopLogProbs* top = reply_.top_logprobs_num > 0 ? in.add_top_logprobs() : nullptr;
    if (i == 0 || int(i - 1) >= prompt_lp.size()) continue;  // the first token has no logprob
    const v1::TokenLogprob& t = prompt_lp[int(i - 1)];
    v->set_value(t.logprob());
    if (top) add_top(t, top);
  }
  input_logprobs_ = std::move(in);
}

void SglangGenerateCall::push_token(int32_t token, int32_t cached_tokens, const v1::GenerateResponse* logprobs) {
  output_ids_.push_back(uint32_t(token));
  cached_tokens_ = cached_tokens;
  if (reply_.return_logprob && reply_.logprob_start_len >= 0 && !input_logprobs_) {
    set_input_logprobs(logprobs ? *logprobs : v1::GenerateResponse());
  }
  if (reply_.return_logprob && logprobs) {
    for (const v1::TokenLogprob& t : logprobs->logprobs()) {
      add_logprob(t, &output_logprobs_);
      if (reply_.stream) add_logprob(t, pending_.mutable_output_logprobs());
    }
  }
  if (!reply_.stream) return;
  pending_.add_token_ids(uint32_t(token));
  if (++pending_tokens_ >= reply_.stream_interval) send_chunk();
}

void SglangGenerateCall::send_chunk() {
  sgl::GenerateResponse m = message();
  sgl::GenerateStreamChunk* c = m.mutable_chunk();
  *c = std::move(pending_);
  pending_ = sgl::GenerateStreamChunk();
  pending_tokens_ = 0;
  c->set_prompt_tokens(uint32_t(reply_.input_ids.size()));
  c->set_completion_tokens(uint32_t(output_ids_.size()));
  c->set_cached_tokens(uint32_t(cached_tokens_));
  if (input_logprobs_ && !input_logprobs_sent_) {
    *c->mutable_input_logprobs() = *input_logprobs_;
    input_logprobs_sent_ = true;
  }
  push(std::move(m));
}

void SglangGenerateCall::finish_ok(v1::GenerateResponse final_message) {
  if (reply_.stream && pending_tokens_ > 0) send_chunk();
  sgl::GenerateResponse m = message();
  sgl::GenerateComplete* c = m.mutable_complete();
  for (uint32_t t : output_ids_) c->add_output_ids(t);
  switch (final_message.finish_reason()) {
    case v1::FINISH_REASON_STOP:
      c->set_finish_reason("stop");
      if (!output_ids_.empty()) c->set_matched_token_id(output_ids_.back());
      break;
    case v1::FINISH_REASON_LENGTH:
      c->set_finish_reason("length");
      break;
    default:
      c->set_finish_reason("abort");
      break;
  }
  const v1::Usage& u = final_message.usage();
  c->set_prompt_tokens(u.prompt_tokens());
  c->set_completion_tokens(u.completion_tokens());
  c->set_cached_tokens(u.cached_tokens());
  if (reply_.return_logprob) *c->mutable_output_logprobs() = output_logprobs_;
  if (input_logprobs_) *c->mutable_input_logprobs() = *input_logprobs_;
  table_->remove(reply_.request_id, this);
  push_final(std::move(m));
}

void SglangGenerateCall::finish_error(const absl::Status& st) {
  table_->remove(reply_.request_id, this);
  end_with(st);
}

void SglangGenerateCall::OnDone() {
  table_->remove(reply_.request_id, this);
  // The engine loop may still hold a reference; every producer call is a no-op now.
  std::shared_ptr<SglangGenerateCall> keep = std::move(self_);
}

}  // namespace kvfuse::server
