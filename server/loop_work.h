// What the parts of the engine loop share: the loop's options, and the work its thread
// owns — the engine, the scheduler and the calls in flight on them. The loop body
// (server/engine_loop.cc) steps that work, the intake (server/loop_intake.h) adds to
// it, the lifecycle (server/loop_lifecycle.h) makes the engine at warm-up, and the
// server info (server/server_info.h) reports its load.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "server/batch_calls.h"
#include "server/generate_sink.h"
#include "server/request_validation.h"
#include "server/status_codes.h"
#include "src/loading/config.h"
#include "src/runtime/engine.h"
#include "src/runtime/scheduler.h"

namespace kvfuse::server {

struct LoopOptions {
  Config config;
  size_t max_waiting = 4096;  // generate requests queued for KV capacity
  ServiceLimits limits;       // vocab and max_seq_len are filled in from the engine
  // Tests: the engine's backend (default: the one config.device names).
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> make_backend;
  // Tests: runs on the loop thread before the warmup, e.g. to hold the server in
  // "warming up" while a test checks that calls get UNAVAILABLE.
  std::function<void()> before_warmup;
  // Tests: sees every step's results (fault injection, see Scheduler::set_result_hook).
  std::function<void(std::vector<StepResult>&)> result_hook;
  // Health turns NOT_SERVING when the loop has work and makes no progress (no step or
  // command finishes) for this long; it turns back when a step completes. 0: off.
  // Generous by default: one long prefill step of a large model on a CPU takes a while.
  double watchdog_s = 300;
};

// A call's answer: runs exactly once, on the loop thread (or, once the loop is gone,
// on the thread that posted the call).
using CallDone = std::function<void(const absl::Status&)>;
// Raised by a gRPC thread when its call is cancelled; read by the loop between steps.
using CancelFlag = std::shared_ptr<std::atomic<bool>>;

// The hint that goes with RESOURCE_EXHAUSTED: when a retry may find room. Pages come
// back as requests finish, which takes some steps: a few dozen steps is a fair first
// guess, from the recent mean step time.
class RetryHint {
 public:
  void observe_step(double ms) { step_ms_ewma_ = step_ms_ewma_ == 0 ? ms : 0.9 * step_ms_ewma_ + 0.1 * ms; }
  int64_t after_ms() const { return int64_t(std::clamp(20.0 * std::max(1.0, step_ms_ewma_), 50.0, 5000.0)); }
  // `st` with the hint attached when it is RESOURCE_EXHAUSTED.
  absl::Status attach(absl::Status st) const {
    if (st.code() == absl::StatusCode::kResourceExhausted) return with_retry_after(std::move(st), after_ms());
    return st;
  }

 private:
  double step_ms_ewma_ = 0;
};

// Loop thread only.
struct LoopWork {
  // A Generate request in flight (kvfuse.v1's or smg's SGLang Generate).
  struct Stream {
    std::shared_ptr<GenerateSink> call;
    GenerateSink::Clock::time_point first_token, last_token;
    int32_t prompt_tokens = 0;
    int32_t completion_tokens = 0;
    int32_t cached_tokens = 0;
  };
  // A Prefill or Decode call in flight.
  struct Batch {
    std::unique_ptr<BatchCall> call;
    CancelFlag cancelled;
    CallDone done;
    bool is_cancelled() const { return cancelled && cancelled->load(); }
  };

  // Null until the warm-up has made them (and for good when it failed).
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Scheduler> sched;
  std::unordered_map<SeqId, Stream> streams;
  std::unordered_map<uint64_t, Batch> batches;
  RetryHint retry;

  bool started() const { return sched != nullptr; }
  // A live Generate request or router sequence (started() only).
  bool live(SeqId id) const { return streams.count(id) || sched->is_router_sequence(id); }
  // Streams, batch calls, waiting requests and live router sequences (started() only).
  int64_t in_flight() const {
    return int64_t(streams.size() + batches.size() + sched->num_router_sequences());
  }
};

}  // namespace kvfuse::server
