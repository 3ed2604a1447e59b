#include "src/runtime/kv/swa_map.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::die;

namespace {

void sort_unique(std::vector<int32_t>& pages) {
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
}

// A log may repeat a page (mapped, then unmapped before a sync); deduplicating once it
// outgrows the pool keeps it bounded even if no one reads it for a while.
void compact(std::vector<int32_t>& pages, int64_t num_pages) {
  if (pages.size() <= 2 * size_t(num_pages) + 64) return;
  sort_unique(pages);
}

}  // namespace

SwaMap::SwaMap(int64_t num_full_pages, int64_t num_swa_pages, int32_t page_size, int32_t num_storages)
    : num_full_pages_(num_full_pages),
      num_swa_pages_(num_swa_pages),
      page_size_(page_size),
      table_(size_t(num_full_pages * page_size), -1),
      sync_logs_(size_t(std::max(num_storages, 0))) {}

void SwaMap::check_full_page(int32_t full_page, const char* what) const {
  if (full_page < 0 || full_page >= num_full_pages_) {
    die(absl::StrCat("SWA table ", what, " of full page ", full_page, " out of range [0, ", num_full_pages_,
                     ")"));
  }
}

int32_t SwaMap::swa_page(int32_t full_page) const {
  check_full_page(full_page, "lookup");
  const int64_t slot = table_[size_t(int64_t(full_page) * page_size_)];
  return slot < 0 ? -1 : int32_t(slot / page_size_);
}

void SwaMap::map(int32_t full_page, int32_t swa_page) {
  check_full_page(full_page, "map");
  if (swa_page < 0 || swa_page >= num_swa_pages_) {
    die(absl::StrCat("SWA table map of full page ", full_page, " to SWA page ", swa_page,
                     " out of range [0, ", num_swa_pages_, ")"));
  }
  const int64_t ps = page_size_;
  for (int64_t o = 0; o < ps; ++o) table_[size_t(full_page * ps + o)] = swa_page * ps + o;
  record(full_page);
}

void SwaMap::unmap(int32_t full_page) {
  check_full_page(full_page, "unmap");
  const int64_t ps = page_size_;
  std::fill_n(table_.begin() + full_page * ps, ps, int64_t(-1));
  record(full_page);
}

void SwaMap::record(int32_t full_page) {
  for (Log& log : sync_logs_) {
    if (!log.open) continue;
    log.pages.push_back(full_page);
    compact(log.pages, num_full_pages_);
  }
  if (changes_.open) {
    changes_.pages.push_back(full_page);
    compact(changes_.pages, num_full_pages_);
  }
}

SwaMap::Log& SwaMap::sync_log(int32_t storage) {
  if (storage < 0 || size_t(storage) >= sync_logs_.size()) {
    die(absl::StrCat("SWA table: storage ", storage, " out of range [0, ", sync_logs_.size(), ")"));
  }
  return sync_logs_[size_t(storage)];
}

void SwaMap::open_sync_log(int32_t storage) {
  Log& log = sync_log(storage);
  log.open = true;
  log.pages.clear();
}

const std::vector<int32_t>& SwaMap::pages_to_sync(int32_t storage) {
  Log& log = sync_log(storage);
  sort_unique(log.pages);
  return log.pages;
}

void SwaMap::synced(int32_t storage) { sync_log(storage).pages.clear(); }

void SwaMap::track_changes() { changes_.open = true; }

std::vector<SwaPageMapping> SwaMap::take_changes() {
  sort_unique(changes_.pages);
  std::vector<SwaPageMapping> out;
  out.reserve(changes_.pages.size());
  for (int32_t page : changes_.pages) out.push_back({page, swa_page(page)});
  changes_.pages.clear();
  return out;
}

absl::Status SwaMap::apply_changes(const std::vector<SwaPageMapping>& changes) {
  for (const SwaPageMapping& m : changes) {
    if (m.full_page < 0 || m.full_page >= num_full_pages_ || m.swa_page < -1 ||
        m.swa_page >= num_swa_pages_) {
      return absl::InvalidArgumentError(absl::StrCat("kv pool: SWA table change of full page ", m.full_page,
                                                     " to SWA page ", m.swa_page, " is out of range"));
    }
    if (m.swa_page < 0) {
      unmap(m.full_page);
    } else {
      map(m.full_page, m.swa_page);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
