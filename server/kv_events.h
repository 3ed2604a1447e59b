// The prefix cache's events on the wire (SubscribeKvEvents): the log the engine loop
// publishes each turn's events to, and one subscriber's server-streaming call.
//
// KvEventLog numbers batches 1, 2, ... without gaps and keeps the last `history` of them,
// so that a router that reconnects with its last number + 1 sees every later batch
// exactly once. It never waits for a subscriber: a call reads the log at its own pace
// (one batch per write) and is woken when a batch is published; a reader that falls
// further behind than the history ends with OUT_OF_RANGE, as a late reconnect does.
// The log keeps kvfuse.v1's batches; a call writes them in its protocol's shape
// (kvfuse.v1's as they are, smg's converted by to_smg, server/sglang_info.h).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "server/status_codes.h"
#include "src/runtime/kv/prefix_cache.h"

namespace kvfuse::server {

// A subscription, as the log sees it.
class KvEventsSubscriber {
 public:
  virtual ~KvEventsSubscriber() = default;
  // Ends the call now with `st` (an unusable request, or the server stopping).
  virtual void finish(const absl::Status& st) = 0;
  // A batch was published: write it if idle.
  virtual void wake() = 0;
};

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

  void subscribe(const std::shared_ptr<KvEventsSubscriber>& call);
  // Ends every subscription with `why` (the server stops); later ones end at once.
  void close(const absl::Status& why);

 private:
  std::vector<std::shared_ptr<KvEventsSubscriber>> live_calls();

  const size_t history_;
  mutable std::mutex mu_;
  std::deque<v1::KvEventBatch> batches_;  // the last history_ published
  uint64_t next_ = 1;
  std::vector<std::weak_ptr<KvEventsSubscriber>> subscribers_;
  std::optional<absl::Status> closed_;
};

// One SubscribeKvEvents call: writes the log's batches from its cursor, one at a time,
// each as `convert` makes it a `Msg`.
template <class Msg>
class KvEventsCallOf final : public grpc::ServerWriteReactor<Msg>, public KvEventsSubscriber {
 public:
  using Convert = std::function<void(const v1::KvEventBatch&, Msg*)>;

  static std::shared_ptr<KvEventsCallOf> create(grpc::CallbackServerContext* ctx, KvEventLog& log, uint64_t start,
                                                Convert convert) {
    std::shared_ptr<KvEventsCallOf> call(new KvEventsCallOf(ctx, log, start, std::move(convert)));
    call->self_ = call;
    return call;
  }
  void finish(const absl::Status& st) override {
    std::unique_lock lock(mu_);
    end(lock, to_grpc(st, ctx_));
  }
  void wake() override {
    std::unique_lock lock(mu_);
    pump(lock);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    writing_ = false;
    if (!ok) return end(lock, grpc::Status::CANCELLED);  // the stream broke: the client went away
    pump(lock);
  }
  void OnCancel() override {
    std::unique_lock lock(mu_);
    end(lock, grpc::Status::CANCELLED);
  }
  void OnDone() override { std::shared_ptr<KvEventsCallOf> keep = std::move(self_); }

 private:
  KvEventsCallOf(grpc::CallbackServerContext* ctx, KvEventLog& log, uint64_t start, Convert convert)
      : ctx_(ctx), log_(log), convert_(std::move(convert)), cursor_(start) {}

  void pump(std::unique_lock<std::mutex>& lock) {
    if (end_) return end(lock, *end_);
    if (writing_) return;
    auto batch = log_.get(cursor_);
    if (!batch.ok()) return end(lock, to_grpc(batch.status(), ctx_));  // the reader fell behind the history
    if (!*batch) return;  // nothing new: wake() comes with the next batch
    in_flight_.Clear();
    convert_(**batch, &in_flight_);
    ++cursor_;
    writing_ = true;
    lock.unlock();
    this->StartWrite(&in_flight_);
  }
  // Ends the call with `st` once no write is in flight (then, or from OnWriteDone).
  void end(std::unique_lock<std::mutex>& lock, grpc::Status st) {
    if (!end_) end_ = std::move(st);
    if (writing_ || finished_) return;
    finished_ = true;
    const grpc::Status final_status = *end_;
    lock.unlock();
    this->Finish(final_status);
  }

  grpc::CallbackServerContext* ctx_;
  KvEventLog& log_;
  Convert convert_;
  std::shared_ptr<KvEventsCallOf> self_;  // released in OnDone
  std::mutex mu_;
  uint64_t cursor_;
  Msg in_flight_;
  bool writing_ = false;
  std::optional<grpc::Status> end_;  // how the call ends, once decided
  bool finished_ = false;            // Finish has been called
};

// A SubscribeKvEvents call of either protocol, from `start` (nullopt: the next batch),
// each batch written as `convert` makes it a `Msg`. `available` not OK (the loop cannot
// serve), or a start the log cannot give (KvEventLog::start_of), ends it at once.
template <class Msg>
grpc::ServerWriteReactor<Msg>* start_kv_events(grpc::CallbackServerContext* ctx, KvEventLog& log,
                                               const absl::Status& available, const std::optional<uint64_t>& start,
                                               typename KvEventsCallOf<Msg>::Convert convert) {
  absl::StatusOr<uint64_t> from = log.start_of(start);
  if (!available.ok()) from = available;
  auto call = KvEventsCallOf<Msg>::create(ctx, log, from.ok() ? *from : 0, std::move(convert));
  if (!from.ok()) {
    call->finish(from.status());
  } else {
    log.subscribe(call);
  }
  return call.get();
}

}  // namespace kvfuse::server
