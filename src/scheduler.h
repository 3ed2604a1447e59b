// Continuous batching over the engine: admission by KV capacity, chunked prefill
// under the per-step token budget, decode of every running sequence each step, and
// preemption by recomputation when the pool runs dry. Single-threaded: the caller (the
// server's engine loop, a benchmark, a test) drives step().
#pragma once

#include <deque>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "src/engine.h"

namespace kvfuse {

enum class FinishReason { none, length, stop, abort, error };
const char* to_string(FinishReason r);

struct GenerateRequest {
  SeqId id = 0;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;
};

// What one step did for one request: at most one new token, and whether it finished.
struct TokenEvent {
  SeqId id = 0;
  std::optional<int32_t> token;
  FinishReason finish = FinishReason::none;
  absl::Status status;  // set when finish == error
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
};

struct SchedulerLimits {
  size_t max_waiting = 4096;
};

class Scheduler {
 public:
  explicit Scheduler(Engine& engine, SchedulerLimits limits = {});

  // INVALID_ARGUMENT (bad prompt or parameters), ALREADY_EXISTS (live id),
  // RESOURCE_EXHAUSTED (queue full, or a request larger than the whole pool).
  absl::Status submit(GenerateRequest req);
  // Ends a request, waiting or running, and frees its pages now. NOT_FOUND if unknown.
  absl::Status abort(SeqId id);
  // Runs one engine step if any request can make progress and returns its events.
  absl::StatusOr<std::vector<TokenEvent>> step();

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  bool contains(SeqId id) const;
  int64_t num_preemptions() const { return preemptions_; }

 private:
  struct Entry {
    GenerateRequest req;
    std::vector<int32_t> tokens;  // prompt plus tokens generated so far (recompute after preemption)
    int32_t generated = 0;
    std::optional<Rng> rng;  // carried across preemption so seeded sampling is unchanged
  };
  PagesNeeded pages_to_finish_prefill(const Entry& e) const;
  bool can_admit(const Entry& e) const;
  absl::Status admit(Entry& e);
  void preempt(size_t running_index);
  TokenEvent finish(Entry& e, FinishReason reason, absl::Status status = absl::OkStatus());

  Engine& engine_;
  SchedulerLimits limits_;
  std::deque<Entry> waiting_;
  std::vector<Entry> running_;
  int64_t preemptions_ = 0;
};

}  // namespace kvfuse
