// The engine loop's intake: the calls that gRPC threads post to the loop, run by the
// loop between two steps. Each command checks the call against the loop's state (the
// request itself was validated on arrival), then answers it or adds its work: a
// Generate request becomes a stream, a Prefill or Decode a batch call, whose router
// tasks' results this class collects until the call is complete.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"
#include "server/generate_sink.h"
#include "server/loop_lifecycle.h"
#include "server/loop_work.h"
#include "server/metrics.h"
#include "server/server_info.h"

namespace kvfuse::server {

class LoopIntake {
 public:
  using Command = std::function<void()>;

  // `end_sequence` is the loop's: it ends a Generate request (final message ABORT) or
  // releases a router sequence.
  LoopIntake(LoopWork& work, LoopLifecycle& life, ServerInfo& info, ServerMetrics& metrics,
             std::function<void(SeqId)> end_sequence);

  // ---- Calls (any thread); see EngineLoop ----
  void prefill(const v1::PrefillRequest* req, v1::PrefillResponse* resp, CancelFlag cancelled, CallDone done);
  void decode(const v1::DecodeRequest* req, v1::DecodeResponse* resp, CancelFlag cancelled, CallDone done);
  void release(const v1::ReleaseRequest* req, v1::ReleaseResponse* resp, CallDone done);
  void abort(uint64_t id, CallDone done);
  void get_load(v1::GetLoadResponse* resp, CallDone done);
  void flush_cache(v1::FlushCacheResponse* resp, CallDone done);
  void generate(const v1::GenerateRequest* req, std::shared_ptr<GenerateSink> call);
  // Wakes the loop to look again (a call was cancelled, a drain or a stop began).
  void wake();

  // ---- The loop's side (loop thread) ----
  struct Turn {
    std::deque<Command> commands;
    bool stopping = false;  // stopping() held when the commands were taken
  };
  // Waits until a command is posted, the loop is woken, stopping() or has_work()
  // holds, and takes the commands posted until then.
  Turn wait(const std::function<bool()>& stopping, const std::function<bool()>& has_work);
  // Takes no more commands: returns those not yet taken. A call posted later runs on
  // its own thread, where it finds the loop stopped (UNAVAILABLE).
  std::deque<Command> close();
  // A router task has ended: its result goes to the batch call that runs it.
  void on_router_result(const RouterResult& r);
  // Ends a batch call with `st` (its results so far stand) and answers it.
  void complete_batch(uint64_t batch_id, const absl::Status& st);

 private:
  void post(Command cmd);
  // Posts `body` for a call that needs the loop to serve: while it cannot (warming up,
  // stopped), `done` gets why instead.
  void post_served(CallDone done, std::function<void(const CallDone&)> body);
  void add_batch(std::unique_ptr<BatchCall> call, CancelFlag cancelled, CallDone done);
  uint64_t next_generate_id();

  LoopWork& work_;
  LoopLifecycle& life_;
  ServerInfo& info_;
  ServerMetrics& metrics_;
  std::function<void(SeqId)> end_sequence_;

  // Posted commands and wake-ups (any thread).
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Command> commands_;
  bool woken_ = false;
  bool accepting_commands_ = true;  // false once the loop has taken its last commands

  // Loop thread only.
  std::unordered_map<SeqId, uint64_t> task_owner_;  // router sequence -> batch running its task
  uint64_t next_batch_id_ = 1;
  uint64_t next_auto_id_ = uint64_t(1) << 63;
};

}  // namespace kvfuse::server
