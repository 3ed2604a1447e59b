// The engine loop: the one thread that owns the Engine and the Scheduler. gRPC
// handlers never touch either; they post commands, which run between steps, and get
// their answers through callbacks run on this thread. Between two steps the loop runs
// the posted commands, ends the work of cancelled calls (freeing their pages), then
// runs one step for every generate request and router task together.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"
#include "server/batch_calls.h"
#include "server/generate_stream.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/watchdog.h"
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

enum class LoopState { warming, serving, draining, stopped, failed };
const char* to_string(LoopState s);

// The server's log of loading the weights (rank 0's and a follower's): event=loading_weights
// as it begins and then every `every_s` seconds, event=weights_loaded at the end.
LoadProgressFn log_load_progress(double every_s = 10);

class EngineLoop {
 public:
  using Done = std::function<void(const absl::Status&)>;
  using Flag = std::shared_ptr<std::atomic<bool>>;

  // `on_serving` runs (on the loop thread) whenever the server's health changes.
  EngineLoop(LoopOptions opts, ServerMetrics& metrics, std::function<void(bool)> on_serving);
  ~EngineLoop();

  void start();
  // Blocks until the engine is warm (OK), failed to start (its error), or timeout.
  absl::Status wait_until_ready(double timeout_s);
  LoopState state() const { return state_.load(); }
  // OK while calls can be served; UNAVAILABLE while warming up or once stopped.
  absl::Status check_available() const;
  // OK while new work (Generate, creating sequences) is admitted; UNAVAILABLE otherwise.
  absl::Status check_accepting() const;
  bool healthy() const { return healthy_.load(); }
  // True while the watchdog sees the loop stuck (see LoopOptions::watchdog_s).
  bool stalled() const { return watchdog_.stalled(); }
  // After the warmup.
  const ServiceLimits& limits() const { return limits_; }
  const v1::GetInfoResponse& info() const { return info_; }

  // ---- Calls (any thread). `done` runs exactly once, on the loop thread, after the
  // response is filled; a set `cancelled` flag ends the call's work at the next step
  // boundary. Request and response must live until `done`.
  void prefill(const v1::PrefillRequest* req, v1::PrefillResponse* resp, Flag cancelled, Done done);
  void decode(const v1::DecodeRequest* req, v1::DecodeResponse* resp, Flag cancelled, Done done);
  void release(const v1::ReleaseRequest* req, v1::ReleaseResponse* resp, Done done);
  void abort(uint64_t id, Done done);
  void get_load(v1::GetLoadResponse* resp, Done done);
  void generate(const v1::GenerateRequest* req, std::shared_ptr<GenerateCall> call);
  // Wakes the loop: a call was cancelled.
  void wake();

  // ---- Shutdown ----
  // Stops admitting new work (UNAVAILABLE); in-flight work continues.
  void begin_drain();
  // Streams, batch calls, waiting requests and live router sequences.
  int64_t in_flight() const { return in_flight_.load(); }
  // What stop() found still in flight and ended with its status (0 before stop()).
  int64_t ended_by_stop() const { return ended_by_stop_.load(); }
  // Ends all remaining work with `why`, frees every sequence and stops the thread.
  void stop(const absl::Status& why);

 private:
  struct Stream {
    std::shared_ptr<GenerateCall> call;
    GenerateCall::Clock::time_point first_token, last_token;
    int32_t prompt_tokens = 0;
    int32_t completion_tokens = 0;
    int32_t cached_tokens = 0;
  };
  struct Batch {
    std::unique_ptr<BatchCall> call;
    Flag cancelled;
    Done done;
  };

  void post(std::function<void()> cmd);
  void run();
  absl::Status warm_up();
  void set_healthy(bool healthy);

  // Tells on_serving whether the server serves now (warm, not draining, healthy).
  void update_health();
  void run_commands();
  void end_cancelled();
  void step();
  // Sends the events of the last step that step() held back (overlap_fanout) to their
  // streams. Runs before anything else touches the streams or the scheduler.
  void flush_events();
  void on_event(const TokenEvent& ev);
  // Ends a Generate request (final message ABORT) or releases a router sequence.
  void abort_sequence(SeqId id);
  void dispatch_router_results();
  void add_batch(std::unique_ptr<BatchCall> call, Flag cancelled, Done done);
  void complete_batch(uint64_t batch_id, const absl::Status& st);
  void end_everything(const absl::Status& why);
  void fill_load(v1::GetLoadResponse* resp) const;
  void publish_load();
  absl::Status with_hint(absl::Status st) const;
  int64_t retry_after_ms() const;
  uint64_t next_generate_id();

  LoopOptions opts_;
  ServerMetrics& metrics_;
  std::function<void(bool)> on_serving_;
  std::thread thread_;
  std::atomic<LoopState> state_{LoopState::warming};
  std::atomic<bool> healthy_{true};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> ended_by_stop_{0};
  Watchdog watchdog_;
  absl::Status start_error_;  // set before state_ becomes failed
  ServiceLimits limits_;      // set before state_ becomes serving
  v1::GetInfoResponse info_;  // set before state_ becomes serving

  // Commands and wakeups.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  bool woken_ = false;
  bool stop_requested_ = false;
  bool drain_requested_ = false;
  bool ready_ = false;              // warmup over and health set
  bool accepting_commands_ = true;  // false once the loop has taken its last commands
  absl::Status stop_status_;
  std::condition_variable ready_cv_;
  std::mutex join_mu_;
  std::mutex health_mu_;

  // Loop thread only.
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> sched_;
  std::unordered_map<SeqId, Stream> streams_;
  std::unordered_map<uint64_t, Batch> batches_;
  std::unordered_map<SeqId, uint64_t> task_owner_;  // router sequence -> batch running its task
  uint64_t next_batch_id_ = 1;
  uint64_t next_auto_id_ = uint64_t(1) << 63;
  double step_ms_ewma_ = 0;
  // With overlap_fanout: the last step's events, sent while the device runs the next step
  // (or by flush_events() when commands come first or there is no next step).
  std::vector<TokenEvent> pending_events_;
};

}  // namespace kvfuse::server
