// What the pieces of the KV pool (src/runtime/kv/) share: how they stop on a caller's bug,
// and how many pages a run of positions takes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/common/arith.h"

namespace kvfuse::kv_detail {

// Misuse that would otherwise corrupt another sequence's cache (a double free, a slot
// past the reserved length) is a bug in the caller, not a runtime condition: stop loudly.
[[noreturn]] inline void die(const std::string& msg) {
  std::fprintf(stderr, "kvfuse: kv_pool: %s\n", msg.c_str());
  std::abort();
}

// Pages that hold positions [0, len).
inline int64_t pages_for(int64_t len, int32_t page_size) { return ceil_div(len, page_size); }

}  // namespace kvfuse::kv_detail
