// One Generate call on the wire: a server-streaming reactor fed by the engine loop.
//
// The loop must never wait for a client, so it only ever queues: at most
// `max_queued` messages wait for the network, and once that many wait, new tokens are
// appended to the last waiting message instead. A slow reader therefore receives
// fewer, larger chunks; no token is lost or reordered, and what waits is bounded by
// the request's max_tokens.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.grpc.pb.h"

namespace kvfuse::server {

class GenerateCall final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  using Clock = std::chrono::steady_clock;

  // The call keeps itself alive until gRPC is done with it (OnDone); the engine loop
  // holds its own reference for as long as it produces tokens. `on_cancel` runs when
  // the client cancels or its deadline passes (from a gRPC thread).
  static std::shared_ptr<GenerateCall> create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                              std::function<void()> on_cancel);

  // ---- Producer side (the engine loop); none of these blocks ----
  // Sends the initial metadata with the request id (`kvfuse-request-id`), so that a
  // client can Abort before the first token arrives.
  void accept(uint64_t id);
  // `logprobs` (may be null): its logprobs and prompt_logprobs go with the token.
  void push_token(int32_t token, const v1::GenerateResponse* logprobs = nullptr);
  // Queues the final message; the call then ends OK.
  void finish_ok(v1::GenerateResponse final_message);
  // Ends the call with an error after the messages already queued.
  void finish_error(const absl::Status& st);

  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  Clock::time_point arrival() const { return arrival_; }
  size_t max_queue_depth_seen() const;

  // ---- gRPC reactions ----
  void OnSendInitialMetadataDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  GenerateCall(grpc::CallbackServerContext* ctx, size_t max_queued, std::function<void()> on_cancel);
  // Starts the next write, or the Finish once nothing is left. Called with mu_ held;
  // releases it before calling into gRPC, whose reactions may run inline and take it.
  void pump(std::unique_lock<std::mutex>& lock);
  // The stream ends early (broken or cancelled): what is queued is dropped, and the
  // call ends with `st` unless its end was already set. Called with mu_ held.
  void drop_queued(grpc::Status st);

  grpc::CallbackServerContext* ctx_;
  const size_t max_queued_;
  std::function<void()> on_cancel_;
  const Clock::time_point arrival_ = Clock::now();
  std::shared_ptr<GenerateCall> self_;  // released in OnDone
  std::atomic<bool> cancelled_{false};

  mutable std::mutex mu_;
  uint64_t id_ = 0;
  std::deque<v1::GenerateResponse> queue_;
  v1::GenerateResponse in_flight_;
  bool writing_ = false;
  bool metadata_pending_ = false;
  bool finishing_ = false;  // no more messages will be queued
  bool finished_ = false;   // Finish has been called
  grpc::Status final_status_;
  size_t max_depth_ = 0;
};

}  // namespace kvfuse::server
