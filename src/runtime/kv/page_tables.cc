#include "src/runtime/kv/page_tables.h"

#include <algorithm>
#include <cstddef>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::die;
using kv_detail::pages_for;

namespace {
const std::vector<int32_t> kNoPages;
}  // namespace

PageTables::PageTables(int32_t page_size, bool with_swa) : page_size_(page_size), with_swa_(with_swa) {}

absl::Status PageTables::add(SeqId id) {
  if (!seqs_.emplace(id, SeqPages{}).second) {
    return absl::AlreadyExistsError(absl::StrCat("kv pool: sequence ", id, " already exists"));
  }
  return absl::OkStatus();
}

const SeqPages* PageTables::find(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

int32_t PageTables::reserved_len(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.len;
}

int64_t PageTables::slot(SeqId id, int32_t pos) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) die(absl::StrCat("slot: unknown sequence ", id));
  const SeqPages& s = it->second;
  if (pos < 0 || pos >= s.len)
    die(absl::StrCat("slot: position ", pos, " of sequence ", id, " not in [0, ", s.len, ")"));
  return int64_t(s.full[size_t(pos / page_size_)]) * page_size_ + pos % page_size_;
}

const std::vector<int32_t>& PageTables::full_pages(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? kNoPages : it->second.full;
}

const std::vector<int32_t>& PageTables::swa_pages(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? kNoPages : it->second.swa;
}

// An unknown id counts as an empty sequence, so admission control can size a request
// before add_sequence.
PagesNeeded PageTables::pages_needed(SeqId id, int32_t new_len) const {
  auto it = seqs_.find(id);
  const int64_t len = it == seqs_.end() ? 0 : it->second.len;
  if (new_len <= len) return {};
  PagesNeeded need;
  const int64_t have = it == seqs_.end() ? 0 : int64_t(it->second.full.size());
  const int64_t target = pages_for(new_len, page_size_);
  need.full = target - have;
  if (with_swa_) {
    // Pages covering [len, new_len) without an SWA page. Only the first can already
    // have one (a partly filled page); trimmed pages all lie before it.
    for (int64_t i = len / page_size_; i < target; ++i) {
      const bool mapped =
          it != seqs_.end() && i < int64_t(it->second.swa.size()) && it->second.swa[size_t(i)] >= 0;
      need.swa += mapped ? 0 : 1;
    }
  }
  return need;
}

PagesNeeded PageTables::pages_held(SeqId id) const {
  PagesNeeded held;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return held;
  held.full = int64_t(it->second.full.size());
  for (int32_t p : it->second.swa) held.swa += p >= 0;
  return held;
}

std::vector<SwaPageMapping> PageTables::grow(SeqId id, int32_t new_len,
                                             const std::vector<int32_t>& full_pages,
                                             const std::vector<int32_t>& swa_pages) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) die(absl::StrCat("grow: unknown sequence ", id));
  SeqPages& s = it->second;
  if (new_len < s.len || int64_t(s.full.size() + full_pages.size()) != pages_for(new_len, page_size_)) {
    die(absl::StrCat("grow: sequence ", id, " from ", s.len, " to ", new_len, " tokens with ", s.full.size(),
                     " + ", full_pages.size(), " full pages"));
  }
  const int64_t first_new = s.len / page_size_;
  s.full.insert(s.full.end(), full_pages.begin(), full_pages.end());
  std::vector<SwaPageMapping> placed;
  if (with_swa_) {
    s.swa.resize(s.full.size(), -1);
    size_t next = 0;
    for (size_t i = size_t(first_new); i < s.full.size(); ++i) {
      if (s.swa[i] >= 0) continue;
      if (next == swa_pages.size()) die(absl::StrCat("grow: sequence ", id, " short of SWA pages"));
      s.swa[i] = swa_pages[next++];
      placed.push_back({s.full[i], s.swa[i]});
    }
    if (next != swa_pages.size()) die(absl::StrCat("grow: sequence ", id, " given too many SWA pages"));
  }
  s.len = new_len;
  return placed;
}

absl::Status PageTables::adopt_prefix(SeqId id, const std::vector<int32_t>& pages) {
  if (with_swa_) return absl::FailedPreconditionError("kv pool: cached prefix pages are not taken with SWA layers");
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("kv pool: adopt_prefix for unknown sequence ", id));
  if (it->second.len != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv pool: adopt_prefix for sequence ", id, ", which holds ", it->second.len, " positions"));
  }
  it->second.full = pages;
  it->second.len = int32_t(pages.size()) * page_size_;
  return absl::OkStatus();
}

// Call after the step that wrote the reserved positions: a query at position p sees keys
// p-W+1..p, so once queries up to len-1 have run, the next one is at p >= len and no
// key below len-W+1 is ever read again. Trimming between reserve() and the step would
// free keys the step's own queries still read.
std::vector<SwaPageMapping> PageTables::trim_window(SeqId id, int32_t window) {
  std::vector<SwaPageMapping> freed;
  if (!with_swa_) return freed;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return freed;
  SeqPages& s = it->second;
  const int64_t visible_from = int64_t(s.len) - window + 1;
  // Page i is dead when (i+1)*page_size <= visible_from. Freed pages form a prefix
  // (grow only maps pages at or after len), so walk down from the last dead page
  // until one already freed: O(pages freed), not O(sequence length).
  const int64_t last_dead = std::min<int64_t>(visible_from / page_size_, int64_t(s.swa.size())) - 1;
  for (int64_t i = last_dead; i >= 0 && s.swa[size_t(i)] >= 0; --i) {
    freed.push_back({s.full[size_t(i)], s.swa[size_t(i)]});
    s.swa[size_t(i)] = -1;
  }
  return freed;
}

absl::StatusOr<SeqPages> PageTables::release(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("kv pool: release of unknown sequence ", id));
  SeqPages pages = std::move(it->second);
  seqs_.erase(it);
  return pages;
}

}  // namespace kvfuse
