#include "src/runtime/kv/page_allocator.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::die;

PageAllocator::PageAllocator(int64_t num_pages) : num_pages_(num_pages) {
  if (num_pages < 0 || num_pages > std::numeric_limits<int32_t>::max()) {
    die(absl::StrCat("PageAllocator: bad page count ", num_pages));
  }
  // Pushed in reverse so pages come out 0, 1, 2, ...: deterministic and easy to read.
  free_.reserve(size_t(num_pages));
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(int32_t(p));
  refs_.assign(size_t(num_pages), 0);
  retained_.assign(size_t(num_pages), 0);
  prev_.assign(size_t(num_pages), -1);
  next_.assign(size_t(num_pages), -1);
}

void PageAllocator::check_range(int32_t page, const char* what) const {
  if (page < 0 || page >= num_pages_) die(absl::StrCat(what, " of page ", page, " out of range [0, ", num_pages_, ")"));
}

bool PageAllocator::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n < 0 || n > num_free()) return false;
  out.reserve(out.size() + size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    if (free_.empty()) evict(oldest_);
    const int32_t p = free_.back();
    free_.pop_back();
    if (refs_[size_t(p)] != 0 || retained_[size_t(p)]) die(absl::StrCat("page ", p, " on the free list is in use"));
    refs_[size_t(p)] = 1;
    out.push_back(p);
  }
  return true;
}

void PageAllocator::free(int32_t page) {
  check_range(page, "free");
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("double free of page ", page));
  if (--r == 1) --num_shared_;
  if (r > 0) return;
  if (!retained_[size_t(page)]) {
    free_.push_back(page);
    return;
  }
  // Evictable: the newest end of the list.
  prev_[size_t(page)] = newest_;
  next_[size_t(page)] = -1;
  if (newest_ >= 0) next_[size_t(newest_)] = page;
  newest_ = page;
  if (oldest_ < 0) oldest_ = page;
  ++num_evictable_;
}

void PageAllocator::share(int32_t page) {
  check_range(page, "share");
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("share of page ", page, ", which is not in use"));
  if (r++ == 1) ++num_shared_;
}

void PageAllocator::retain(int32_t page) {
  check_range(page, "retain");
  if (refs_[size_t(page)] <= 0) die(absl::StrCat("retain of page ", page, ", which is not in use"));
  retained_[size_t(page)] = 1;
}

void PageAllocator::unlink(int32_t page) {
  const int32_t p = prev_[size_t(page)], n = next_[size_t(page)];
  (p >= 0 ? next_[size_t(p)] : oldest_) = n;
  (n >= 0 ? prev_[size_t(n)] : newest_) = p;
  prev_[size_t(page)] = next_[size_t(page)] = -1;
  --num_evictable_;
}

void PageAllocator::revive(int32_t page) {
  check_range(page, "revive");
  if (!is_evictable(page)) die(absl::StrCat("revive of page ", page, ", which is not evictable"));
  unlink(page);
  refs_[size_t(page)] = 1;
}

void PageAllocator::evict(int32_t page) {
  if (page < 0 || !is_evictable(page)) die(absl::StrCat("evict of page ", page, ", which is not evictable"));
  unlink(page);
  retained_[size_t(page)] = 0;
  if (on_evict_) on_evict_(page);
  free_.push_back(page);
}

int64_t PageAllocator::evict_all() {
  int64_t n = 0;
  while (oldest_ >= 0) {
    evict(oldest_);
    ++n;
  }
  return n;
}

}  // namespace kvfuse
