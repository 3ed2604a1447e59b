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
}

bool PageAllocator::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n < 0 || n > num_free()) return false;
  out.reserve(out.size() + size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    if (refs_[size_t(p)] != 0) die(absl::StrCat("page ", p, " on the free list is in use"));
    refs_[size_t(p)] = 1;
    out.push_back(p);
  }
  return true;
}

void PageAllocator::free(int32_t page) {
  if (page < 0 || page >= num_pages_)
    die(absl::StrCat("free of page ", page, " out of range [0, ", num_pages_, ")"));
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("double free of page ", page));
  if (--r == 1) --num_shared_;
  if (r == 0) free_.push_back(page);
}

void PageAllocator::share(int32_t page) {
  if (page < 0 || page >= num_pages_)
    die(absl::StrCat("share of page ", page, " out of range [0, ", num_pages_, ")"));
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("share of free page ", page));
  if (r++ == 1) ++num_shared_;
}

}  // namespace kvfuse
