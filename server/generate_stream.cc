#include "server/generate_stream.h"

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

std::shared_ptr<GenerateCall> GenerateCall::create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                                   std::function<void()> on_cancel) {
  std::shared_ptr<GenerateCall> call(new GenerateCall(ctx, max_queued, std::move(on_cancel)));
  call->self_ = call;
  return call;
}

void GenerateCall::accept(uint64_t id) {
  id_ = id;
  send_metadata("kvfuse-request-id", absl::StrCat(id));
}

void GenerateCall::push_token(int32_t token, int32_t, const v1::GenerateResponse* logprobs) {
  v1::GenerateResponse msg;
  msg.set_id(id_);
  msg.add_token_ids(token);
  if (logprobs) {
    for (const auto& t : logprobs->logprobs()) *msg.add_logprobs() = t;
    for (const auto& t : logprobs->prompt_logprobs()) *msg.add_prompt_logprobs() = t;
  }
  push(std::move(msg));
}

void GenerateCall::finish_ok(v1::GenerateResponse final_message) {
  final_message.set_id(id_);
  push_final(std::move(final_message));
}

void GenerateCall::OnDone() {
  // The engine loop may still hold a reference; every producer call is a no-op now.
  std::shared_ptr<GenerateCall> keep = std::move(self_);
}

}  // namespace kvfuse::server
