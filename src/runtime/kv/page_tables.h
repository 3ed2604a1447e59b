// PageTables: each live sequence's page tables (docs/design.md#page-tables) and the slots
// they give its positions (docs/design.md#slots-and-slot-mapping).
//
// Owns, per sequence: the positions reserved (len), the full-pool page of every run of
// page_size positions (entry i covers [i * page_size, (i + 1) * page_size)), and with SWA
// layers the SWA page beside each, -1 once it left the window.
//
// Invariants, per sequence:
// - full holds exactly pages_for(len) pages; pages never move once placed;
// - with SWA layers swa has one entry per full page, else none;
// - freed SWA entries (-1) are a prefix of swa, and only of pages no future query can see:
//   (i + 1) * page_size <= len - window + 1.
// The pages themselves come from and go back to the allocators (page_allocator.h), and SWA
// mappings are mirrored in the slot table (swa_map.h): the caller (KvPool) allocates
// before grow, and frees and unmaps what trim_window and release hand back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/runtime/kv/swa_map.h"

namespace kvfuse {

using SeqId = uint64_t;

struct PagesNeeded {
  int64_t full = 0;
  int64_t swa = 0;
};

// One sequence's pages.
struct SeqPages {
  int32_t len = 0;            // positions reserved
  std::vector<int32_t> full;  // full-pool pages, pages_for(len) of them
  std::vector<int32_t> swa;   // with SWA layers: the SWA page beside each full page, -1 once freed
};

class PageTables {
 public:
  PageTables(int32_t page_size, bool with_swa);

  int32_t page_size() const { return page_size_; }
  bool with_swa() const { return with_swa_; }

  // ALREADY_EXISTS if live.
  absl::Status add(SeqId id);
  bool contains(SeqId id) const { return seqs_.count(id) != 0; }
  size_t size() const { return seqs_.size(); }
  // Null for an unknown id.
  const SeqPages* find(SeqId id) const;
  const std::unordered_map<SeqId, SeqPages>& sequences() const { return seqs_; }

  // 0 for an unknown id.
  int32_t reserved_len(SeqId id) const;
  // Full-pool slot of a reserved position; an unknown id or a position outside [0, len) aborts.
  int64_t slot(SeqId id, int32_t pos) const;
  // The tables; empty for an unknown id.
  const std::vector<int32_t>& full_pages(SeqId id) const;
  const std::vector<int32_t>& swa_pages(SeqId id) const;

  // Pages that growing to new_len takes: full pages past those held, and SWA pages for the
  // pages covering [len, new_len) without one. An unknown id is an empty sequence.
  PagesNeeded pages_needed(SeqId id, int32_t new_len) const;
  // Pages held now (SWA: those still mapped); none for an unknown id.
  PagesNeeded pages_held(SeqId id) const;

  // Grows a live sequence to new_len (>= len) with exactly the pages pages_needed counted:
  // appends full_pages, and gives each page from len's on that has no SWA page the next of
  // swa_pages. Returns the SWA pages it placed, with their full pages, in page order.
  std::vector<SwaPageMapping> grow(SeqId id, int32_t new_len, const std::vector<int32_t>& full_pages,
                                   const std::vector<int32_t>& swa_pages);
  // The prefix cache's hit: gives `id` (live, nothing reserved) `pages` as its first full
  // pages, len = their tokens (the caller takes a reference to each). FAILED_PRECONDITION
  // with SWA layers, NOT_FOUND for an unknown id, INVALID_ARGUMENT if it holds pages.
  absl::Status adopt_prefix(SeqId id, const std::vector<int32_t>& pages);
  // Marks freed the SWA pages of positions before len - window + 1 and returns them, with
  // their full pages, last page first. Nothing for an unknown id or without SWA layers.
  std::vector<SwaPageMapping> trim_window(SeqId id, int32_t window);
  // Removes a sequence and returns its pages. NOT_FOUND if unknown.
  absl::StatusOr<SeqPages> release(SeqId id);

 private:
  int32_t page_size_;
  bool with_swa_;
  std::unordered_map<SeqId, SeqPages> seqs_;
};

}  // namespace kvfuse
