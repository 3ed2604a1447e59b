// One kvfuse.v1 Generate call on the wire: a server-streaming reactor fed by the engine
// loop (a GenerateSink, server/generate_sink.h). The loop never waits for the client:
// the queueing and coalescing are StreamWriter's (server/stream_writer.h), so a slow
// reader receives fewer, larger chunks and no token is lost or reordered.
#pragma once

#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "server/generate_sink.h"
#include "server/stream_writer.h"

namespace kvfuse::server {

class GenerateCall final : public StreamWriter<v1::GenerateResponse>, public GenerateSink {
 public:
  // The call keeps itself alive until gRPC is done with it (OnDone); the engine loop
  // holds its own reference for as long as it produces tokens. `on_cancel` runs when
  // the client cancels or its deadline passes (from a gRPC thread).
  static std::shared_ptr<GenerateCall> create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                              std::function<void()> on_cancel);

  // ---- GenerateSink (the engine loop); none of these blocks ----
  // Sends the initial metadata with the request id (`kvfuse-request-id`), so that a
  // client can Abort before the first token arrives.
  void accept(uint64_t id) override;
  void push_token(int32_t token, int32_t cached_tokens, const v1::GenerateResponse* logprobs) override;
  void finish_ok(v1::GenerateResponse final_message) override;
  void finish_error(const absl::Status& st) override { end_with(st); }
  bool cancelled() const override { return stream_cancelled(); }
  Clock::time_point arrival() const override { return arrival_; }

  void OnDone() override;

 private:
  GenerateCall(grpc::CallbackServerContext* ctx, size_t max_queued, std::function<void()> on_cancel)
      : StreamWriter(ctx, max_queued, std::move(on_cancel)) {}

  const Clock::time_point arrival_ = Clock::now();
  std::shared_ptr<GenerateCall> self_;  // released in OnDone
  std::atomic<uint64_t> id_{0};
};

}  // namespace kvfuse::server
