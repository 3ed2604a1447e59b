#include "src/runtime/kv/invariants.h"

#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::pages_for;

absl::Status check_kv_pool_invariants(const PageTables& tables, const PageAllocator& full_alloc,
                                      const PageAllocator* swa_alloc, const SwaMap* swa_map, int32_t window) {
  auto fail = [](auto&&... parts) {
    return absl::InternalError(absl::StrCat("kv pool invariant: ", parts...));
  };
  const bool has_swa = swa_alloc != nullptr;
  const int64_t ps = tables.page_size();
  // Owner of each page as 1 + index into `ids`, 0 for none.
  std::vector<SeqId> ids;
  std::vector<int32_t> full_holders(size_t(full_alloc.num_pages()), 0);
  std::vector<int64_t> swa_owner(has_swa ? size_t(swa_alloc->num_pages()) : 0, 0);
  std::vector<int64_t> full_to_swa_page(size_t(full_alloc.num_pages()), -1);
  auto claim = [&](const PageAllocator& a, std::vector<int64_t>& owner, int32_t p, const char* pool,
                   SeqId id) -> absl::Status {
    if (p < 0 || p >= a.num_pages()) return fail(pool, " page ", p, " of sequence ", id, " out of range");
    if (!a.is_used(p)) return fail(pool, " page ", p, " of sequence ", id, " is on the free list");
    if (owner[size_t(p)] != 0) {
      return fail(pool, " page ", p, " owned by sequences ", ids[size_t(owner[size_t(p)] - 1)], " and ", id);
    }
    owner[size_t(p)] = int64_t(ids.size());
    return absl::OkStatus();
  };
  int64_t full_owned = 0, swa_owned = 0;
  for (const auto& [id, s] : tables.sequences()) {
    ids.push_back(id);
    if (int64_t(s.full.size()) != pages_for(s.len, tables.page_size())) {
      return fail("sequence ", id, " has ", s.full.size(), " full pages for ", s.len, " tokens");
    }
    if (s.swa.size() != (has_swa ? s.full.size() : 0)) {
      return fail("sequence ", id, " has ", s.swa.size(), " SWA entries for ", s.full.size(), " full pages");
    }
    for (int32_t p : s.full) {
      // Full pages may be shared (prefix reuse): one holder per reference.
      if (p < 0 || p >= full_alloc.num_pages())
        return fail("full page ", p, " of sequence ", id, " out of range");
      if (!full_alloc.is_used(p)) return fail("full page ", p, " of sequence ", id, " is on the free list");
      if (full_holders[size_t(p)]++ == 0) ++full_owned;
    }
    bool seen_mapped = false;
    for (size_t i = 0; i < s.swa.size(); ++i) {
      if (s.swa[i] < 0) {
        // Freed pages are a prefix, and only ones no future query can see.
        if (seen_mapped) return fail("sequence ", id, " SWA page ", i, " freed after a live one");
        if (int64_t(i + 1) * ps > int64_t(s.len) - window + 1) {
          return fail("sequence ", id, " SWA page ", i, " freed while still in the window (len ", s.len, ")");
        }
        continue;
      }
      seen_mapped = true;
      KVFUSE_RETURN_IF_ERROR(claim(*swa_alloc, swa_owner, s.swa[i], "SWA", id));
      full_to_swa_page[size_t(s.full[i])] = s.swa[i];
      ++swa_owned;
    }
  }
  int64_t shared = 0;
  for (int64_t p = 0; p < full_alloc.num_pages(); ++p) {
    const int32_t refs = full_alloc.refs(int32_t(p));
    if (refs != full_holders[size_t(p)]) {
      return fail("full page ", p, " has ", refs, " references and ", full_holders[size_t(p)], " holders");
    }
    shared += refs > 1 ? 1 : 0;
  }
  if (shared != full_alloc.num_shared()) {
    return fail("full pool: ", shared, " pages shared, ", full_alloc.num_shared(), " by count");
  }
  // Owned == used, and the allocator's bitmap agrees with its free list: no leak.
  for (const auto& [a, owned, pool] :
       {std::tuple{&full_alloc, full_owned, "full"}, std::tuple{swa_alloc, swa_owned, "SWA"}}) {
    if (a == nullptr) continue;
    int64_t used = 0;
    for (int64_t p = 0; p < a->num_pages(); ++p) used += a->is_used(int32_t(p)) ? 1 : 0;
    if (used != a->num_used() || owned != a->num_used()) {
      return fail(pool, " pool: ", owned, " pages owned, ", a->num_used(), " used by count, ", used,
                  " used by bitmap (", a->num_pages(), " total)");
    }
  }
  static const std::vector<int64_t> kNoTable;
  const std::vector<int64_t>& table = swa_map != nullptr ? swa_map->table() : kNoTable;
  if (!has_swa) {
    if (!table.empty()) return fail("SWA slot table present without SWA layers");
    return absl::OkStatus();
  }
  if (int64_t(table.size()) != full_alloc.num_pages() * ps) {
    return fail("SWA slot table has ", table.size(), " entries");
  }
  for (int64_t f = 0; f < full_alloc.num_pages(); ++f) {
    const int64_t m = full_to_swa_page[size_t(f)];
    for (int64_t o = 0; o < ps; ++o) {
      const int64_t want = m >= 0 ? m * ps + o : -1;
      if (table[size_t(f * ps + o)] != want) {
        return fail("SWA slot table entry ", f * ps + o, " is ", table[size_t(f * ps + o)], ", want ", want);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
