// PageAllocator: the pages of one pool (the full pool, or the SWA pool) — which are free,
// and how many holders each page in use has (docs/design.md#page-tables: prefix reuse
// shares full-pool pages, and a page is freed when its last holder releases it).
//
// Owns: the free list and one reference count per page. Nothing else: which sequence holds
// a page is the page tables' (src/runtime/kv/page_tables.h).
//
// Invariants:
// - a page is on the free list exactly when its count is 0, and then only once;
// - pages come out of a fresh allocator in order 0, 1, 2, ...; a freed page goes on top of
//   the free list and is the next one handed out (last freed, first reused);
// - allocation is all or nothing: a request larger than the free list takes nothing;
// - num_shared() is the number of pages with a count above 1;
// - freeing a free page, sharing a free page, or naming a page out of range is a caller
//   bug that would corrupt another sequence's cache: the process aborts with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvfuse {

// A free list of page ids with reference counts and ownership checks. Allocation is
// all-or-nothing; a page returns to the free list when its last reference is freed.
class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const { return int64_t(free_.size()); }
  int64_t num_used() const { return num_pages_ - num_free(); }
  // Pages held by more than one reference.
  int64_t num_shared() const { return num_shared_; }
  bool is_used(int32_t page) const { return refs_[size_t(page)] > 0; }
  int32_t refs(int32_t page) const { return refs_[size_t(page)]; }

  // Appends n pages to out (one reference each), or leaves out untouched and returns false.
  bool allocate(int64_t n, std::vector<int32_t>& out);
  // One more reference to a page in use (sharing a page that is free is a bug: aborts).
  void share(int32_t page);
  // Drops one reference. Freeing a page that is not in use is a bug: aborts with a message.
  void free(int32_t page);

 private:
  int64_t num_pages_;
  std::vector<int32_t> free_;  // a stack: back() is the next page handed out
  std::vector<int32_t> refs_;  // [num_pages]
  int64_t num_shared_ = 0;
};

}  // namespace kvfuse
