#include "server/status_codes.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvfuse::server {

namespace {
constexpr char kRetryPayload[] = "type.kvfuse.dev/retry-after-ms";

int code_number(const absl::Status& st) {
  // absl and gRPC share the canonical codes 0..16; anything else is UNKNOWN.
  const int c = static_cast<int>(st.code());
  return c >= 0 && c <= 16 ? c : static_cast<int>(absl::StatusCode::kUnknown);
}
}  // namespace

absl::Status with_retry_after(absl::Status st, int64_t ms) {
  st.SetPayload(kRetryPayload, absl::Cord(absl::StrCat(ms)));
  return st;
}

std::optional<int64_t> retry_after_ms(const absl::Status& st) {
  const auto payload = st.GetPayload(kRetryPayload);
  int64_t ms = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &ms)) return std::nullopt;
  return ms;
}

grpc::Status to_grpc(const absl::Status& st, grpc::ServerContextBase* ctx) {
  if (st.ok()) return grpc::Status::OK;
  std::string message(st.message());
  if (const auto ms = retry_after_ms(st)) {
    absl::StrAppend(&message, " (retry after ", *ms, " ms)");
    if (ctx) ctx->AddTrailingMetadata("grpc-retry-pushback-ms", absl::StrCat(*ms));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code_number(st)), message);
}

void to_proto(const absl::Status& st, v1::SequenceStatus* out) {
  out->set_code(static_cast<v1::SequenceStatus::Code>(code_number(st)));
  out->set_message(std::string(st.message()));
  if (const auto ms = retry_after_ms(st)) out->set_retry_after_ms(uint32_t(*ms));
}

}  // namespace kvfuse::server
