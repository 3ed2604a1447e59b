// The KV pool's consistency check: that its pieces agree with one another, for tests
// (KvPool::check_invariants).
//
// Checks, in one pass:
// - each sequence's tables have their shape (page_tables.h), and its freed SWA pages are a
//   prefix of pages out of the window;
// - every page a table names is in range and in use; each full page has as many references
//   as tables holding it, each SWA page exactly one holder; the shared count is right;
// - pages in use are exactly the pages held (no leak), and each allocator's counts agree
//   with its reference counts;
// - the SWA slot table maps exactly the full pages whose sequences hold an SWA page beside
//   them, to that page, and nothing else.
// Owns nothing.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "src/runtime/kv/page_allocator.h"
#include "src/runtime/kv/page_tables.h"
#include "src/runtime/kv/swa_map.h"

namespace kvfuse {

// INTERNAL ("kv pool invariant: ...") naming the first disagreement found, or OK. Without
// SWA layers swa_alloc and swa_map are null.
absl::Status check_kv_pool_invariants(const PageTables& tables, const PageAllocator& full_alloc,
                                      const PageAllocator* swa_alloc, const SwaMap* swa_map, int32_t window);

}  // namespace kvfuse
