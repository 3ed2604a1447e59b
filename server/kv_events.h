// The prefix cache's events on the wire (SubscribeKvEvents): the log the engine loop
// publishes each turn's events to, and one subscriber's server-streaming call.
//
// KvEventLog numbers batches 1, 2, ... without gaps and keeps the last `history` of them,
// so that a router that reconnects with its last number + 1 sees every later batch
// exactly once. It never waits for a subscriber: a call reads the log at its own pace
// (one batch per write) and is woken when a batch is published; a reader that falls
// further behind than the history ends with OUT_OF_RANGE, as a late reconnect does.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "src/runtime/kv/prefix_cache.h"

namespace kvfuse::server {

class KvEventsCall;

class KvEventLog {
 public:
  explicit KvEventLog(size_t history) : history_(history < 1 ? 1 : history) {}

  // One batch of the engine's events (none: nothing is published); wakes the subscribers.
  void publish(const std::vector<KvEvent>& events);
  // The batch numbered `seq`: nullopt if not published yet; OUT_OF_RANGE if it aged out.
  absl::StatusOr<std::optional<v1::KvEventBatch>> get(uint64_t seq) const;
  // Where a subscription starts: `start`, or the next batch. OUT_OF_RANGE for a batch that
  // aged out, INVALID_ARGUMENT for one past the next.
  absl::StatusOr<uint64_t> start_of(const std::optional<uint64_t>& start) const;
  uint64_t next_sequence_number() const;

  void subscribe(const std::shared_ptr<KvEventsCall>& call);
  // Ends every subscription with `why` (the server stops); later ones end at once.
  void close(const absl::Status& why);

 private:
  std::vector<std::shared_ptr<KvEventsCall>> live_calls();

  const size_t history_;
  mutable std::mutex mu_;
  std::deque<v1::KvEventBatch> batches_;  // the last history_ published
  uint64_t next_ = 1;
  std::vector<std::weak_ptr<KvEventsCall>> subscribers_;
  std::optional<absl::Status> closed_;
};

// One SubscribeKvEvents call: writes the log's batches from its cursor, one at a time.
class KvEventsCall final : public grpc::ServerWriteReactor<v1::KvEventBatch> {
 public:
  static std::shared_ptr<KvEventsCall> create(grpc::CallbackServerContext* ctx, KvEventLog& log, uint64_t start);
  // Ends the call now with `st` (an unusable request, or the server stopping).
  void finish(const absl::Status& st);
  // A batch was published: write it if idle.
  void wake();

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  KvEventsCall(grpc::CallbackServerContext* ctx, KvEventLog& log, uint64_t start)
      : ctx_(ctx), log_(log), cursor_(start) {}
  void pump(std::unique_lock<std::mutex>& lock);
  void end(std::unique_lock<std::mutex>& lock, grpc::Status st);

  grpc::CallbackServerContext* ctx_;
  KvEventLog& log_;
  std::shared_ptr<KvEventsCall> self_;  // released in OnDone
  std::mutex mu_;
  uint64_t cursor_;
  v1::KvEventBatch in_flight_;
  bool writing_ = false;
  std::optional<grpc::Status> end_;  // how the call ends, once decided
  bool finished_ = false;            // Finish has been called
};

}  // namespace kvfuse::server
