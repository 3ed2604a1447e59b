// Prefill and Decode calls in progress on the engine loop. A call starts one router
// task per sequence; each sequence's result is filled in as its task ends, and the
// call completes when the last one has. Loop thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"
#include "src/runtime/engine.h"
#include "src/runtime/scheduler.h"

namespace kvfuse::server {

class BatchCall {
 public:
  // Starts the tasks; a sequence that cannot start gets its result now. With
  // `accept_new` false (draining), creating a sequence fails UNAVAILABLE.
  // `retry_after_ms` is the hint attached to RESOURCE_EXHAUSTED results.
  static std::unique_ptr<BatchCall> prefill(Scheduler& sched, const Engine& engine,
                                            const v1::PrefillRequest& req, v1::PrefillResponse* resp,
                                            bool accept_new, int64_t retry_after_ms);
  // `expected_len` makes a replay safe: the tokens already past expected_len count as
  // produced by this call, and only the missing steps run.
  static std::unique_ptr<BatchCall> decode(Scheduler& sched, const Engine& engine,
                                           const v1::DecodeRequest& req, v1::DecodeResponse* resp,
                                           int64_t retry_after_ms);

  // Sequences whose tasks run for this call.
  std::vector<SeqId> running() const;
  bool done() const { return index_.empty(); }
  // Records a finished task of one of running().
  void on_result(const RouterResult& r);
  // Stops the running tasks with `why`, and releases the sequences this call created
  // and still owns (a cancelled Prefill leaves nothing behind, so a retry can create
  // them again; a sequence created under the same id by a later call is left alone).
  // A cancelled extend stays appended: its retry with expected_len finishes it.
  void cancel(Scheduler& sched, const absl::Status& why);

  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t generated_tokens() const { return generated_tokens_; }
  bool saw_internal_error() const { return saw_internal_; }

 private:
  BatchCall(v1::PrefillResponse* p, v1::DecodeResponse* d, int64_t retry_after_ms)
      : prefill_(p), decode_(d), retry_after_ms_(retry_after_ms) {}
  void set_status(int index, const absl::Status& st);

  v1::PrefillResponse* prefill_;
  v1::DecodeResponse* decode_;
  int64_t retry_after_ms_;
  std::unordered_map<SeqId, int> index_;  // running sequence -> result index
  // Sequences this Prefill created, with their Scheduler::router_generation.
  std::vector<std::pair<SeqId, uint64_t>> created_;
  int64_t prompt_tokens_ = 0;
  int64_t generated_tokens_ = 0;
  bool saw_internal_ = false;
};

}  // namespace kvfuse::server
