// smg's SGLang GenerateRequest (proto/smg/sglang_scheduler.proto) as the kvfuse.v1
// GenerateRequest the engine loop runs, plus what shapes the answer (stream, chunk size,
// logprobs). Every field kvfuse cannot honour is refused (INVALID_ARGUMENT naming the
// field), never ignored; docs/sglang.md has the field-by-field table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvfuse/v1/decode.pb.h"
#include "server/request_validation.h"
#include "smg/sglang_scheduler.pb.h"

namespace kvfuse::server {

namespace sgl = ::sglang::grpc::scheduler;

// SGLang's default max_new_tokens (when the request leaves it unset).
inline constexpr int32_t kSglangDefaultMaxNewTokens = 128;

// How the answer to one SGLang Generate request is shaped.
struct SglangReplyOptions {
  std::string request_id;
  bool stream = false;
  int32_t stream_interval = 1;    // tokens per chunk (stream only)
  bool return_logprob = false;    // output logprobs
  int32_t top_logprobs_num = 0;   // with return_logprob
  int32_t logprob_start_len = -1; // with return_logprob: input logprobs from here; -1 none
  std::vector<uint32_t> input_ids;
};

struct SglangGenerate {
  v1::GenerateRequest request;  // id 0: the loop picks the engine id
  SglangReplyOptions reply;
};

// The request as kvfuse runs it; INVALID_ARGUMENT names the SGLang field at fault.
// `request_id` is the id the call goes by (the request's, or one the server made up).
absl::StatusOr<SglangGenerate> from_sglang(const sgl::GenerateRequest& req, const std::string& request_id,
                                           const ServiceLimits& lim);

// The custom_params key kvfuse reads: the sampler's seed (SGLang's proto has no seed field).
inline constexpr char kSglangSeedParam[] = "seed";

}  // namespace kvfuse::server
