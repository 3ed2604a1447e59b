#include "server/generate_stream.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/status_codes.h"

namespace kvfuse::server {

std::shared_ptr<GenerateCall> GenerateCall::create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                                   std::function<void()> on_cancel) {
  std::shared_ptr<GenerateCall> call(new GenerateCall(ctx, max_queued, std::move(on_cancel)));
  call->self_ = call;
  return call;
}

GenerateCall::GenerateCall(grpc::CallbackServerContext* ctx, size_t max_queued,
                           std::function<void()> on_cancel)
    : ctx_(ctx), max_queued_(std::max<size_t>(1, max_queued)), on_cancel_(std::move(on_cancel)) {}

void GenerateCall::accept(uint64_t id) {
  std::unique_lock lock(mu_);
  id_ = id;
  if (finishing_) return;
  // Nothing has been sent yet, so the context's metadata is ours to change. Like a
  // write, the metadata op holds off Finish until it completes.
  ctx_->AddInitialMetadata("kvfuse-request-id", absl::StrCat(id));
  metadata_pending_ = true;
  lock.unlock();
  StartSendInitialMetadata();
}

void GenerateCall::OnSendInitialMetadataDone(bool ok) {
  std::unique_lock lock(mu_);
  metadata_pending_ = false;
  if (!ok) drop_queued(to_grpc(absl::CancelledError("sending metadata failed")));
  pump(lock);
}

void GenerateCall::push_token(int32_t token, const v1::GenerateResponse* logprobs) {
  std::unique_lock lock(mu_);
  if (finishing_) return;
  v1::GenerateResponse* msg = nullptr;
  if (queue_.size() >= max_queued_) {
    msg = &queue_.back();  // coalesce: the reader is behind
  } else {
    queue_.emplace_back();
    msg = &queue_.back();
    msg->set_id(id_);
    max_depth_ = std::max(max_depth_, queue_.size());
  }
  msg->add_token_ids(token);
  if (logprobs) {
    for (const auto& t : logprobs->logprobs()) *msg->add_logprobs() = t;
    for (const auto& t : logprobs->prompt_logprobs()) *msg->add_prompt_logprobs() = t;
  }
  pump(lock);
}

void GenerateCall::finish_ok(v1::GenerateResponse final_message) {
  std::unique_lock lock(mu_);
  if (finishing_) return;
  final_message.set_id(id_);
  queue_.push_back(std::move(final_message));
  finishing_ = true;
  final_status_ = grpc::Status::OK;
  pump(lock);
}

void GenerateCall::finish_error(const absl::Status& st) {
  std::unique_lock lock(mu_);
  if (finishing_) return;
  finishing_ = true;
  final_status_ = to_grpc(st, ctx_);
  pump(lock);
}

size_t GenerateCall::max_queue_depth_seen() const {
  std::lock_guard lock(mu_);
  return max_depth_;
}

void GenerateCall::pump(std::unique_lock<std::mutex>& lock) {
  if (writing_ || metadata_pending_ || finished_) return;
  if (!queue_.empty()) {
    in_flight_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    StartWrite(&in_flight_);
    return;
  }
  if (finishing_) {
    finished_ = true;
    const grpc::Status st = final_status_;
    lock.unlock();
    Finish(st);
  }
}

void GenerateCall::OnWriteDone(bool ok) {
  std::unique_lock lock(mu_);
  writing_ = false;
  // The stream is broken (the client went away): drop what is queued and end.
  if (!ok) drop_queued(to_grpc(absl::CancelledError("write failed")));
  pump(lock);
}

void GenerateCall::OnCancel() {
  cancelled_.store(true, std::memory_order_release);
  {
    std::unique_lock lock(mu_);
    drop_queued(grpc::Status::CANCELLED);
    pump(lock);
  }
  if (on_cancel_) on_cancel_();
}

void GenerateCall::drop_queued(grpc::Status st) {
  queue_.clear();
  if (!finishing_) final_status_ = std::move(st);
  finishing_ = true;
}

void GenerateCall::OnDone() {
  // The engine loop may still hold a reference; every producer call is a no-op now.
  std::shared_ptr<GenerateCall> keep = std::move(self_);
}

}  // namespace kvfuse::server
