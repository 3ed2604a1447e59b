// One smg SGLang Generate call on the wire, and the table of live calls by request_id.
//
// The engine loop feeds the call kvfuse.v1's messages (a GenerateSink,
// server/generate_sink.h) exactly as it feeds a kvfuse.v1 Generate stream; this class
// turns them into SGLang's: with `stream`, chunks of `stream_interval` tokens with the
// cumulative counts and that chunk's logprobs, then one `complete`; without, the
// `complete` alone. The complete carries every token (output_ids), finish_reason
// "stop" | "length" | "abort", matched_token_id when a stop or EOS token ended the
// request (kvfuse includes that token in output_ids), and the cumulative logprobs.
// Queueing and coalescing are StreamWriter's (server/stream_writer.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "server/generate_sink.h"
#include "server/sglang_request.h"
#include "server/stream_writer.h"
#include "smg/sglang_scheduler.grpc.pb.h"

namespace kvfuse::server {

class SglangGenerateCall;

// The live SGLang calls by request_id (any thread). A request_id is live from the
// Generate that brings it until its call ends; a second Generate with a live id is
// ALREADY_EXISTS, one with an ended id is a new request.
class SglangRequestTable {
 public:
  absl::Status add(const std::string& request_id, const std::shared_ptr<SglangGenerateCall>& call);
  // Removes `request_id` if it still names `call`.
  void remove(const std::string& request_id, const SglangGenerateCall* call);
  std::shared_ptr<SglangGenerateCall> find(const std::string& request_id) const;
  // A request_id for a request that came without one.
  std::string make_id();

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::weak_ptr<SglangGenerateCall>> live_;
  uint64_t next_ = 1;
};

class SglangGenerateCall final : public StreamWriter<sgl::GenerateResponse>, public GenerateSink {
 public:
  // `abort_engine_id` ends the request in the engine (kvfuse.v1 Abort): the call uses it
  // for an Abort that came before the loop admitted the request.
  static std::shared_ptr<SglangGenerateCall> create(grpc::CallbackServerContext* ctx, size_t max_queued,
                                                    std::function<void()> on_cancel,
                                                    std::shared_ptr<SglangRequestTable> table,
                                                    std::function<void(uint64_t)> abort_engine_id);
  // Before the loop sees the call: how to answer.
  void set_reply(SglangReplyOptions reply) { reply_ = std::move(reply); }
  // SGLang Abort (any thread): the engine id to abort now, or nullopt when the loop has
  // not admitted the request yet (it is then aborted as it is admitted).
  std::optional<uint64_t> request_abort();

  // ---- GenerateSink (the engine loop) ----
  void accept(uint64_t id) override;
  void push_token(int32_t token, int32_t cached_tokens, const v1::GenerateResponse* logprobs) override;
  void finish_ok(v1::GenerateResponse final_message) override;
  void finish_error(const absl::Status& st) override;
  bool cancelled() const override { return stream_cancelled(); }
  Clock::time_point arrival() const override { return arrival_; }

  void OnDone() override;

 private:
  SglangGenerateCall(grpc::CallbackServerContext* ctx, size_t max_queued, std::function<void()> on_cancel,
                     std::shared_ptr<SglangRequestTable> table, std::function<void(uint64_t)> abort_engine_id)
      : StreamWriter(ctx, max_queued, std::move(on_cancel)),
        table_(std::move(table)),
        abort_engine_id_(std::move(abort_engine_id)) {}

  sgl::GenerateResponse message() const;
  // The tokens since the last chunk, as one chunk.
  void send_chunk();
  void add_logprob(const v1::TokenLogprob& t, sgl::OutputLogProbs* out) const;
  // kvfuse.v1's prompt logprobs (every prompt token's but the first) as SGLang's input
  // logprobs from logprob_start_len (the first prompt token has no value).
  void set_input_logprobs(const v1::GenerateResponse& lp);

  const Clock::time_point arrival_ = Clock::now();
  std::shared_ptr<SglangGenerateCall> self_;  // released in OnDone
  std::shared_ptr<SglangRequestTable> table_;
  std::function<void(uint64_t)> abort_engine_id_;
  SglangReplyOptions reply_;

  std::mutex abort_mu_;  // the engine id and an early Abort meet here
  uint64_t engine_id_ = 0;
  bool abort_requested_ = false;

  // Loop thread only.
  std::vector<uint32_t> output_ids_;
  sgl::OutputLogProbs output_logprobs_;  // cumulative
  std::optional<sgl::InputLogProbs> input_logprobs_;
  sgl::GenerateStreamChunk pending_;  // not sent yet
  int32_t pending_tokens_ = 0;
  bool input_logprobs_sent_ = false;
  int32_t cached_tokens_ = 0;
};

}  // namespace kvfuse::server
