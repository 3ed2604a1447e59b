// A GPU runtime result (cudaError_t, hipError_t on AMD) or a kernel launcher's result
// (gpu::LaunchStatus) as an absl::Status: the one conversion of the host code that drives
// the GPU (src/backends/gpu, src/parallel/*.cu, and the GPU tests over them). Host code
// only; absl is not a dependency of kernels/, which is why this is not in kernels/common/.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/common/gpu.h"

namespace kvfuse {

// A launcher that refused its arguments says why (the whole argument tuple): that is an
// invalid argument, with its message. Any other failure, and every runtime error (a
// cudaError_t converts to a LaunchStatus without a message), is an internal error in
// gpu::error_message's words: "cuda error in <what>: cudaErrorX (text)".
inline absl::Status gpu_status(const gpu::LaunchStatus& st, const char* what) {
  if (st.ok()) return absl::OkStatus();
  if (!st.message().empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", st.message()));
  return absl::InternalError(gpu::error_message(st.code(), what));
}

}  // namespace kvfuse

// Returns gpu_status(expr, "expr") from the enclosing function (which returns a Status or
// StatusOr) when it is not OK: the failed call's own text names it.
#define KVFUSE_CUDA(expr)                                                            \
  do {                                                                               \
    if (absl::Status _gpu_st = ::kvfuse::gpu_status((expr), #expr); !_gpu_st.ok()) { \
      return _gpu_st;                                                                \
    }                                                                                \
  } while (0)
