// What the engine loop feeds a Generate request's tokens to: the call on the wire of
// whichever protocol brought the request (kvfuse.v1 Generate, server/generate_stream.h;
// smg's SGLang Generate, server/sglang_generate.h). The loop speaks kvfuse.v1's messages;
// each sink turns them into its protocol's. Every method is called on the loop thread
// and none may block.
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"

namespace kvfuse::server {

class GenerateSink {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~GenerateSink() = default;

  // The request was admitted under the engine id `id`.
  virtual void accept(uint64_t id) = 0;
  // One sampled token. `cached_tokens`: the request's prompt tokens taken from the prefix
  // cache. `logprobs` (may be null): its logprobs and prompt_logprobs go with the token.
  virtual void push_token(int32_t token, int32_t cached_tokens, const v1::GenerateResponse* logprobs) = 0;
  // The request finished (finish_reason and usage set); the call then ends OK.
  virtual void finish_ok(v1::GenerateResponse final_message) = 0;
  // The request failed; the call ends with `st` after what was already queued.
  virtual void finish_error(const absl::Status& st) = 0;
  // The client cancelled (or its deadline passed): the loop drops the request.
  virtual bool cancelled() const = 0;
  virtual Clock::time_point arrival() const = 0;
};

}  // namespace kvfuse::server
