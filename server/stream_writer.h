// The write side of a server-streaming call whose producer must never wait for the
// client: the engine loop only ever queues. At most `max_queued` messages wait for the
// network; once that many wait, a new message is merged into the last waiting one
// (protobuf MergeFrom: repeated fields append, set scalars replace), so a slow reader
// receives fewer, larger messages, nothing is lost or reordered, and what waits is
// bounded by what the request may produce. Used by kvfuse.v1 Generate
// (server/generate_stream.h) and by smg's SGLang Generate (server/sglang_generate.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "server/status_codes.h"

namespace kvfuse::server {

template <class Msg>
class StreamWriter : public grpc::ServerWriteReactor<Msg> {
 public:
  // `on_cancel` runs when the client cancels or its deadline passes (a gRPC thread).
  StreamWriter(grpc::CallbackServerContext* ctx, size_t max_queued, std::function<void()> on_cancel)
      : ctx_(ctx), max_queued_(std::max<size_t>(1, max_queued)), on_cancel_(std::move(on_cancel)) {}

  // ---- Producer side; none of these blocks ----
  // Sends the initial metadata with `key: value` before any message.
  void send_metadata(const std::string& key, const std::string& value) {
    std::unique_lock lock(mu_);
    if (finishing_) return;
    // Nothing has been sent yet, so the context's metadata is ours to change. Like a
    // write, the metadata op holds off Finish until it completes.
    ctx_->AddInitialMetadata(key, value);
    metadata_pending_ = true;
    lock.unlock();
    this->StartSendInitialMetadata();
  }
  // Queues `msg`, or merges it into the last waiting message when the reader is behind.
  void push(Msg msg) {
    std::unique_lock lock(mu_);
    if (finishing_) return;
    if (queue_.size() >= max_queued_) {
      queue_.back().MergeFrom(msg);
    } else {
      queue_.push_back(std::move(msg));
      max_depth_ = std::max(max_depth_, queue_.size());
    }
    pump(lock);
  }
  // Queues the final message (never merged); the call then ends OK.
  void push_final(Msg msg) {
    std::unique_lock lock(mu_);
    if (finishing_) return;
    queue_.push_back(std::move(msg));
    finishing_ = true;
    final_status_ = grpc::Status::OK;
    pump(lock);
  }
  // Ends the call with an error after the messages already queued.
  void end_with(const absl::Status& st) {
    std::unique_lock lock(mu_);
    if (finishing_) return;
    finishing_ = true;
    final_status_ = to_grpc(st, ctx_);
    pump(lock);
  }

  bool stream_cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  size_t max_queue_depth_seen() const {
    std::lock_guard lock(mu_);
    return max_depth_;
  }

  // ---- gRPC reactions ----
  void OnSendInitialMetadataDone(bool ok) override {
    std::unique_lock lock(mu_);
    metadata_pending_ = false;
    if (!ok) drop_queued(to_grpc(absl::CancelledError("sending metadata failed")));
    pump(lock);
  }
  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    writing_ = false;
    // The stream is broken (the client went away): drop what is queued and end.
    if (!ok) drop_queued(to_grpc(absl::CancelledError("write failed")));
    pump(lock);
  }
  void OnCancel() override {
    cancelled_.store(true, std::memory_order_release);
    {
      std::unique_lock lock(mu_);
      drop_queued(grpc::Status::CANCELLED);
      pump(lock);
    }
    if (on_cancel_) on_cancel_();
  }

 protected:
  grpc::CallbackServerContext* context() const { return ctx_; }

 private:
  // Starts the next write, or the Finish once nothing is left. Called with mu_ held;
  // releases it before calling into gRPC, whose reactions may run inline and take it.
  void pump(std::unique_lock<std::mutex>& lock) {
    if (writing_ || metadata_pending_ || finished_) return;
    if (!queue_.empty()) {
      in_flight_ = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
      lock.unlock();
      this->StartWrite(&in_flight_);
      return;
    }
    if (finishing_) {
      finished_ = true;
      const grpc::Status st = final_status_;
      lock.unlock();
      this->Finish(st);
    }
  }
  // The stream ends early (broken or cancelled): what is queued is dropped, and the
  // call ends with `st` unless its end was already set. Called with mu_ held.
  void drop_queued(grpc::Status st) {
    queue_.clear();
    if (!finishing_) final_status_ = std::move(st);
    finishing_ = true;
  }

  grpc::CallbackServerContext* ctx_;
  const size_t max_queued_;
  std::function<void()> on_cancel_;
  std::atomic<bool> cancelled_{false};

  mutable std::mutex mu_;
  std::deque<Msg> queue_;
  Msg in_flight_;
  bool writing_ = false;
  bool metadata_pending_ = false;
  bool finishing_ = false;  // no more messages will be queued
  bool finished_ = false;   // Finish has been called
  grpc::Status final_status_;
  size_t max_depth_ = 0;
};

}  // namespace kvfuse::server
