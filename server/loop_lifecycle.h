// The engine loop's lifecycle: the warm-up that makes the engine, the loop's state
// (warming, serving, draining, stopped, failed) and what the server can take in each,
// health (the state, internal errors and the watchdog together), and the requests to
// drain and to stop. The loop thread moves the state; any thread reads it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>

#include "absl/status/status.h"
#include "server/loop_work.h"
#include "server/server_info.h"
#include "server/watchdog.h"
#include "src/loading/config.h"

namespace kvfuse::server {

enum class LoopState { warming, serving, draining, stopped, failed };
const char* to_string(LoopState s);

// The server's log of loading the weights (rank 0's and a follower's): event=loading_weights
// as it begins and then every `every_s` seconds, event=weights_loaded at the end.
LoadProgressFn log_load_progress(double every_s = 10);

class LoopLifecycle {
 public:
  // `on_serving` runs whenever health may have changed, with whether the server serves.
  LoopLifecycle(const LoopOptions& opts, std::function<void(bool)> on_serving);
  ~LoopLifecycle();
  LoopLifecycle(const LoopLifecycle&) = delete;
  LoopLifecycle& operator=(const LoopLifecycle&) = delete;

  // ---- Warm-up (loop thread) ----
  // Makes the engine and the scheduler in `work`, runs a prefill and a decode step
  // through them and builds `info`; then the state turns serving (draining when a
  // drain or stop was asked for meanwhile) or failed, health follows, and whoever
  // waits in wait_until_ready() is let go.
  void warm_up(LoopWork& work, ServerInfo& info);
  // Blocks until the engine is warm (OK), failed to start (its error), or timeout.
  absl::Status wait_until_ready(double timeout_s);

  // ---- State (any thread) ----
  LoopState state() const { return state_.load(); }
  // OK while calls can be served; UNAVAILABLE while warming up or once stopped.
  absl::Status check_available() const;
  // OK while new work (Generate, creating sequences) is admitted; UNAVAILABLE otherwise.
  absl::Status check_accepting() const;
  bool healthy() const { return healthy_.load(); }
  bool stalled() const { return watchdog_.stalled(); }
  // What health reports: warm, not draining, no internal error, not stalled.
  bool serving() const;
  // An internal error (false) or its end; health follows.
  void set_healthy(bool healthy);

  // ---- Watchdog ----
  void start_watchdog() { watchdog_.start(); }
  void stop_watchdog() { watchdog_.stop(); }
  // A progress mark of the loop; `working`: it has work in hand from now on.
  void beat(bool working) { watchdog_.beat(working); }

  // ---- Drain and stop (any thread; the caller wakes the loop) ----
  // Stops admitting new work (state draining, health NOT_SERVING).
  void begin_drain();
  // The loop ends its work with `why` and leaves; the first request's `why` counts.
  void request_stop(const absl::Status& why);
  bool stop_requested() const { return stop_requested_.load(); }
  // Loop thread, once it has left its loop with `ended` calls still in flight: the
  // state turns stopped. Returns the status to end them with.
  absl::Status enter_stopped(int64_t ended);
  // What the loop found still in flight when it stopped (0 before).
  int64_t ended_by_stop() const { return ended_by_stop_.load(); }

 private:
  absl::Status start_engine(LoopWork& work, ServerInfo& info);
  // Tells on_serving whether the server serves now.
  void update_health();

  const LoopOptions& opts_;
  std::function<void(bool)> on_serving_;
  std::atomic<LoopState> state_{LoopState::warming};
  std::atomic<bool> healthy_{true};
  std::atomic<bool> stop_requested_{false};
  std::atomic<int64_t> ended_by_stop_{0};

  mutable std::mutex mu_;
  std::condition_variable ready_cv_;
  bool ready_ = false;  // warmup over and health set
  bool drain_requested_ = false;
  absl::Status start_error_;  // set before state_ becomes failed
  absl::Status stop_status_;
  std::mutex health_mu_;
  // Last: its thread calls update_health(), so it stops before the rest goes.
  Watchdog watchdog_;
};

}  // namespace kvfuse::server
