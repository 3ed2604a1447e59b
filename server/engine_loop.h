// The engine loop: the one thread that owns the Engine and the Scheduler. gRPC
// handlers never touch either; they post commands, which run between steps, and get
// their answers through callbacks run on this thread. Between two steps the loop runs
// the posted commands, ends the work of cancelled calls (freeing their pages), then
// runs one step for every generate request and router task together.
//
// EngineLoop is the face the server sees and the loop body; its parts, one job each:
// LoopIntake (the posted calls and the batch calls' bookkeeping, server/loop_intake.h),
// LoopLifecycle (warm-up, state and health, watchdog, drain and stop,
// server/loop_lifecycle.h) and ServerInfo (GetInfo, GetLoad and the load metrics,
// server/server_info.h), over the work they share (server/loop_work.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"
#include "server/generate_sink.h"
#include "server/kv_events.h"
#include "server/loop_intake.h"
#include "server/loop_lifecycle.h"
#include "server/loop_work.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/server_info.h"
#include "src/runtime/scheduler.h"

namespace kvfuse::server {

class EngineLoop {
 public:
  using Done = CallDone;
  using Flag = CancelFlag;

  // `on_serving` runs (on the loop thread) whenever the server's health changes.
  EngineLoop(LoopOptions opts, ServerMetrics& metrics, std::function<void(bool)> on_serving);
  ~EngineLoop();

  void start();
  // Blocks until the engine is warm (OK), failed to start (its error), or timeout.
  absl::Status wait_until_ready(double timeout_s) { return life_.wait_until_ready(timeout_s); }
  LoopState state() const { return life_.state(); }
  // OK while calls can be served; UNAVAILABLE while warming up or once stopped.
  absl::Status check_available() const { return life_.check_available(); }
  // OK while new work (Generate, creating sequences) is admitted; UNAVAILABLE otherwise.
  absl::Status check_accepting() const { return life_.check_accepting(); }
  bool healthy() const { return life_.healthy(); }
  // True while the watchdog sees the loop stuck (see LoopOptions::watchdog_s).
  bool stalled() const { return life_.stalled(); }
  // After the warmup.
  const ServiceLimits& limits() const { return info_.limits(); }
  const v1::GetInfoResponse& info() const { return info_.info(); }

  // ---- Calls (any thread). `done` runs exactly once, on the loop thread, after the
  // response is filled; a set `cancelled` flag ends the call's work at the next step
  // boundary. Request and response must live until `done`.
  void prefill(const v1::PrefillRequest* req, v1::PrefillResponse* resp, Flag cancelled, Done done) {
    intake_.prefill(req, resp, std::move(cancelled), std::move(done));
  }
  void decode(const v1::DecodeRequest* req, v1::DecodeResponse* resp, Flag cancelled, Done done) {
    intake_.decode(req, resp, std::move(cancelled), std::move(done));
  }
  void release(const v1::ReleaseRequest* req, v1::ReleaseResponse* resp, Done done) {
    intake_.release(req, resp, std::move(done));
  }
  void abort(uint64_t id, Done done) { intake_.abort(id, std::move(done)); }
  void get_load(v1::GetLoadResponse* resp, Done done) { intake_.get_load(resp, std::move(done)); }
  void flush_cache(v1::FlushCacheResponse* resp, Done done) { intake_.flush_cache(resp, std::move(done)); }
  // The prefix cache's events (SubscribeKvEvents): the loop publishes each turn's.
  KvEventLog& kv_events() { return kv_events_; }
  // A Generate request of either protocol: the sink turns the loop's kvfuse.v1 messages
  // into its own (server/generate_sink.h).
  void generate(const v1::GenerateRequest* req, std::shared_ptr<GenerateSink> call) {
    intake_.generate(req, std::move(call));
  }
  // Wakes the loop: a call was cancelled.
  void wake() { intake_.wake(); }

  // ---- Shutdown ----
  // Stops admitting new work (UNAVAILABLE); in-flight work continues.
  void begin_drain();
  // Streams, batch calls, waiting requests and live router sequences.
  int64_t in_flight() const { return info_.in_flight(); }
  // What stop() found still in flight and ended with its status (0 before stop()).
  int64_t ended_by_stop() const { return life_.ended_by_stop(); }
  // Ends all remaining work with `why`, frees every sequence and stops the thread.
  void stop(const absl::Status& why);

 private:
  void run();
  void step();
  // Sends the events of the last step that step() held back (overlap_fanout) to their
  // streams. Runs before anything else touches the streams or the scheduler.
  void flush_events();
  void on_event(const TokenEvent& ev);
  // Ends a Generate request (final message ABORT) or releases a router sequence.
  void abort_sequence(SeqId id);
  void dispatch_router_results();
  void end_cancelled();
  // Stops a batch call's tasks with `why` and answers it.
  void end_batch(uint64_t batch_id, const absl::Status& why);
  void end_everything(const absl::Status& why);
  // The prefix cache's events since the last turn, to the log.
  void publish_kv_events();

  LoopOptions opts_;
  ServerMetrics& metrics_;
  LoopWork work_;  // loop thread only
  ServerInfo info_;
  LoopLifecycle life_;
  LoopIntake intake_;
  KvEventLog kv_events_;
  std::thread thread_;
  std::mutex join_mu_;
  // With overlap_fanout: the last step's events, sent while the device runs the next step
  // (or by flush_events() when commands come first or there is no next step).
  std::vector<TokenEvent> pending_events_;
};

}  // namespace kvfuse::server
