// The one place where the library's errors (absl::Status) become gRPC statuses: the
// status of a call, and the per-sequence status inside batch results. The numeric
// codes are the same in both (canonical error space); what this adds is the retry
// hint of RESOURCE_EXHAUSTED and UNAVAILABLE.
#pragma once

#include <cstdint>
#include <optional>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"

namespace kvfuse::server {

// Attaches a retry hint to a status (kept as a payload so it travels with the status
// through the engine loop to the mapping below).
absl::Status with_retry_after(absl::Status st, int64_t ms);
std::optional<int64_t> retry_after_ms(const absl::Status& st);

// The gRPC status of a call. A retry hint also goes into the `grpc-retry-pushback-ms`
// trailer, which gRPC clients with a retry policy honour (gRFC A6).
grpc::Status to_grpc(const absl::Status& st, grpc::ServerContextBase* ctx = nullptr);

// The status of one sequence inside a batch result.
void to_proto(const absl::Status& st, v1::SequenceStatus* out);

}  // namespace kvfuse::server
