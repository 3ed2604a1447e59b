#include "src/parallel/communicator.h"

#include "absl/strings/str_cat.h"

namespace kvfuse {

const char* to_string(DType t) { return t == DType::bf16 ? "bf16" : "f32"; }

size_t dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }

absl::Status check_collective_args(const char* op, const void* buf, int64_t count, const Communicator& c) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.name(), " ", op, " on rank ", c.rank(), ": count ", count, " is negative"));
  }
  if (buf == nullptr && count > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.name(), " ", op, " on rank ", c.rank(), ": null buffer for ", count, " elements"));
  }
  return absl::OkStatus();
}

absl::Status check_root(const char* op, int root, const Communicator& c) {
  if (root < 0 || root >= c.size()) {
    return absl::InvalidArgumentError(absl::StrCat(c.name(), " ", op, " on rank ", c.rank(), ": root ", root,
                                                   " is outside [0, ", c.size(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
