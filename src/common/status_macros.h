// Early return on an error status, for code that makes many fallible calls in a row.
#pragma once

#include "absl/status/status.h"

#define KVFUSE_RETURN_IF_ERROR(expr) \
  do {                               \
    const absl::Status _st = (expr); \
    if (!_st.ok()) return _st;       \
  } while (0)
