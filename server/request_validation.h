// Checks of every request field that need no engine state: sizes, token ids against
// the vocabulary, sampling parameters, duplicate ids. They run on the gRPC thread, so
// a malformed request is rejected (INVALID_ARGUMENT) without touching the engine loop;
// what depends on the sequences' state is checked on the loop.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvfuse/v1/decode.pb.h"
#include "src/runtime/sampler.h"
#include "src/runtime/scheduler.h"

namespace kvfuse::server {

struct ServiceLimits {
  int32_t vocab = 0;
  int32_t max_seq_len = 0;
  int32_t max_decode_steps = 256;      // per Decode call
  int32_t max_batch_sequences = 4096;  // per Prefill / Decode / Release call
  int32_t max_stop_tokens = 64;        // per Generate request
  int32_t default_max_tokens = 16;     // Generate with max_tokens 0
};

absl::Status validate(const v1::PrefillRequest& req, const ServiceLimits& lim);
absl::Status validate(const v1::DecodeRequest& req, const ServiceLimits& lim);
absl::Status validate(const v1::ReleaseRequest& req, const ServiceLimits& lim);
absl::Status validate(const v1::AbortRequest& req);
absl::Status validate(const v1::GenerateRequest& req, const ServiceLimits& lim);

// The engine's sampling parameters (unset top_p is 1), validated.
absl::StatusOr<SamplingParams> to_sampling(const v1::SamplingParams& p, int32_t vocab);
// The router path's stop rules, validated (INVALID_ARGUMENT naming the field).
absl::StatusOr<StopRules> to_stop_rules(const v1::StopRules& p, const ServiceLimits& lim);
// The same without the checks, for rules validated on arrival.
StopRules stop_rules(const v1::StopRules& p);
// Logprobs parameters, validated (INVALID_ARGUMENT naming the field).
absl::StatusOr<LogprobsOptions> to_logprobs(const v1::LogprobsParams& p);
// The tokens a Generate request may produce: max_tokens, or the default for 0.
int32_t generate_max_tokens(const v1::GenerateRequest& req, const ServiceLimits& lim);
// The proto form of a token's logprobs.
void to_proto(const TokenLogprob& t, v1::TokenLogprob* out);
// Steps of a Decode call (0 means 1).
int32_t decode_steps(const v1::DecodeRequest& req);
// The proto's finish reason (error has none: the status says it).
v1::FinishReason to_proto(FinishReason r);

}  // namespace kvfuse::server
