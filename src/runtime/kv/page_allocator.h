// PageAllocator: the pages of one pool (the full pool, or the SWA pool) — which are free,
// how many holders each page in use has (docs/design.md#page-tables: shared prefixes hold a
// page from several sequences, and it is released when its last holder releases it), and
// which released pages still keep their contents for the prefix cache
// (src/runtime/kv/prefix_cache.h).
//
// Owns: the free list, one reference count per page, and the retained pages: a page the
// prefix cache keeps is marked retained; when its last reference goes it is not freed but
// becomes evictable, in the order pages were released. Nothing else: which sequence holds a
// page is the page tables' (src/runtime/kv/page_tables.h), which block a retained page holds
// the prefix cache's.
//
// Invariants:
// - every page is in exactly one state: free (count 0, on the free list once), in use
//   (count > 0, retained or not), or evictable (count 0, retained, on the eviction list once);
// - pages come out of a fresh allocator in order 0, 1, 2, ...; a freed page goes on top of
//   the free list and is the next one handed out (last freed, first reused);
// - allocate() takes free pages first, then evicts the least recently released evictable
//   ones, telling the eviction callback before the page is handed out; num_free() counts
//   both (what an allocation can take);
// - allocation is all or nothing: a request larger than num_free() takes nothing;
// - num_shared() is the number of pages with a count above 1;
// - freeing a page not in use, sharing a page not in use, reviving a page that is not
//   evictable, or naming a page out of range is a caller bug that would corrupt another
//   sequence's cache: the process aborts with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace kvfuse {

// A free list of page ids with reference counts and ownership checks. Allocation is
// all-or-nothing; a page returns to the free list when its last reference is freed, or
// waits, evictable, when it is retained.
class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return num_pages_; }
  // Pages an allocation can take: free and evictable.
  int64_t num_free() const { return int64_t(free_.size()) + num_evictable_; }
  int64_t num_used() const { return num_pages_ - num_free(); }
  int64_t num_evictable() const { return num_evictable_; }
  // Pages held by more than one reference.
  int64_t num_shared() const { return num_shared_; }
  bool is_used(int32_t page) const { return refs_[size_t(page)] > 0; }
  bool is_evictable(int32_t page) const { return refs_[size_t(page)] == 0 && retained_[size_t(page)]; }
  bool is_retained(int32_t page) const { return retained_[size_t(page)] != 0; }
  int32_t refs(int32_t page) const { return refs_[size_t(page)]; }

  // Appends n pages to out (one reference each), or leaves out untouched and returns false.
  bool allocate(int64_t n, std::vector<int32_t>& out);
  // One more reference to a page in use (sharing a page that is not is a bug: aborts).
  void share(int32_t page);
  // Drops one reference. Freeing a page that is not in use is a bug: aborts with a message.
  void free(int32_t page);

  // The prefix cache's side. on_evict(page) is called for every retained page that an
  // allocation or evict_all() takes back, before it is reused.
  void set_on_evict(std::function<void(int32_t)> on_evict) { on_evict_ = std::move(on_evict); }
  // Marks a page in use as retained (aborts for a page not in use).
  void retain(int32_t page);
  // An evictable page in use again, with one reference (a cache hit); aborts otherwise.
  void revive(int32_t page);
  // Evicts every evictable page (each to the free list, on_evict told); returns how many.
  int64_t evict_all();

 private:
  void check_range(int32_t page, const char* what) const;
  void evict(int32_t page);  // an evictable page to the free list
  void unlink(int32_t page);

  int64_t num_pages_;
  std::vector<int32_t> free_;      // a stack: back() is the next page handed out
  std::vector<int32_t> refs_;      // [num_pages]
  std::vector<uint8_t> retained_;  // [num_pages]
  // The evictable pages, least recently released first: a list through prev_/next_.
  std::vector<int32_t> prev_, next_;
  int32_t oldest_ = -1, newest_ = -1;
  int64_t num_evictable_ = 0;
  int64_t num_shared_ = 0;
  std::function<void(int32_t)> on_evict_;
};

}  // namespace kvfuse
