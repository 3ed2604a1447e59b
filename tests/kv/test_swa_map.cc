// SwaMap (src/runtime/kv/swa_map.h) on its own: the full_to_swa table page by page
// (map, remap, unmap), the sync logs of the device copies, and the change log that
// carries the table to another process's pool.
#include "tests/util/catch.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "src/runtime/kv/swa_map.h"
#include "tests/util/aborts.h"

namespace {

using namespace kvfuse;

using test::aborts;

// The entries of one full page.
std::vector<int64_t> page_entries(const SwaMap& m, int32_t full_page) {
  const auto& t = m.table();
  const int64_t ps = m.page_size();
  return {t.begin() + full_page * ps, t.begin() + (full_page + 1) * ps};
}

std::vector<int64_t> mapped_to(int32_t swa_page, int64_t ps) {
  std::vector<int64_t> v;
  for (int64_t o = 0; o < ps; ++o) v.push_back(swa_page * ps + o);
  return v;
}

// (full page, SWA page) pairs, comparable and printable.
using Pairs = std::vector<std::pair<int32_t, int32_t>>;
Pairs pairs(const std::vector<SwaPageMapping>& v) {
  Pairs out;
  for (const SwaPageMapping& m : v) out.emplace_back(m.full_page, m.swa_page);
  return out;
}

}  // namespace

TEST_CASE("swa map: pages are mapped, remapped and unmapped a page of entries at a time", "[kv_pool][swa]") {
  const int32_t ps = 4;
  SwaMap m(8, 3, ps, 1);
  CHECK(m.num_full_pages() == 8);
  CHECK(m.num_swa_pages() == 3);
  REQUIRE(m.table().size() == 8 * ps);
  CHECK(std::count(m.table().begin(), m.table().end(), int64_t(-1)) == 8 * ps);
  for (int32_t f = 0; f < 8; ++f) CHECK(m.swa_page(f) == -1);

  m.map(5, 2);
  CHECK(page_entries(m, 5) == mapped_to(2, ps));
  CHECK(m.swa_page(5) == 2);
  m.map(0, 0);
  CHECK(page_entries(m, 0) == mapped_to(0, ps));
  // Remapping a page replaces all its entries.
  m.map(5, 1);
  CHECK(page_entries(m, 5) == mapped_to(1, ps));
  CHECK(m.swa_page(5) == 1);
  // Neighbours untouched.
  CHECK(page_entries(m, 4) == std::vector<int64_t>(ps, -1));
  CHECK(page_entries(m, 6) == std::vector<int64_t>(ps, -1));
  CHECK(page_entries(m, 0) == mapped_to(0, ps));
  m.unmap(5);
  CHECK(page_entries(m, 5) == std::vector<int64_t>(ps, -1));
  CHECK(m.swa_page(5) == -1);
  m.unmap(5);  // unmapping an unmapped page is allowed and changes nothing
  CHECK(m.swa_page(5) == -1);
  CHECK(std::count(m.table().begin(), m.table().end(), int64_t(-1)) == 7 * ps);

  // A page out of range is a caller bug.
  CHECK(aborts([&] { m.map(8, 0); }));
  CHECK(aborts([&] { m.map(-1, 0); }));
  CHECK(aborts([&] { m.map(1, 3); }));
  CHECK(aborts([&] { m.map(1, -1); }));
  CHECK(aborts([&] { m.unmap(8); }));
  CHECK(aborts([&] { (void)m.swa_page(8); }));
}

TEST_CASE("swa map: each storage's sync log holds the pages changed since its last sync", "[kv_pool][swa]") {
  SwaMap m(16, 16, 2, 2);
  // No log is open before its storage exists: nothing recorded.
  m.map(3, 0);
  CHECK(m.pages_to_sync(0).empty());
  CHECK(m.pages_to_sync(1).empty());
  m.open_sync_log(0);
  m.map(9, 1);
  m.map(2, 2);
  m.unmap(9);
  m.map(9, 3);
  CHECK(m.pages_to_sync(0) == std::vector<int32_t>{2, 9});  // sorted, each page once
  CHECK(m.pages_to_sync(1).empty());
  m.open_sync_log(1);
  m.unmap(3);
  CHECK(m.pages_to_sync(0) == std::vector<int32_t>{2, 3, 9});
  CHECK(m.pages_to_sync(1) == std::vector<int32_t>{3});
  m.synced(0);
  CHECK(m.pages_to_sync(0).empty());
  CHECK(m.pages_to_sync(1) == std::vector<int32_t>{3});  // storages sync independently
  m.map(15, 4);
  CHECK(m.pages_to_sync(0) == std::vector<int32_t>{15});
  CHECK(m.pages_to_sync(1) == std::vector<int32_t>{3, 15});
  // Opening a log again starts it afresh (its storage uploaded the whole table).
  m.open_sync_log(1);
  CHECK(m.pages_to_sync(1).empty());
  // Many changes of few pages keep a log to those pages.
  for (int i = 0; i < 1000; ++i) {
    m.map(int32_t(i % 3), int32_t(i % 16));
    m.unmap(int32_t(i % 3));
  }
  CHECK(m.pages_to_sync(1) == std::vector<int32_t>{0, 1, 2});
  CHECK(m.pages_to_sync(0) == std::vector<int32_t>{0, 1, 2, 15});
  CHECK(aborts([&] { m.open_sync_log(2); }));
  CHECK(aborts([&] { (void)m.pages_to_sync(-1); }));
  CHECK(aborts([&] { m.synced(2); }));
}

TEST_CASE("swa map: the change log hands over each changed page once, with its mapping now",
          "[kv_pool][swa]") {
  SwaMap m(10, 6, 3, 1);
  m.map(1, 1);
  CHECK(m.take_changes().empty());  // not tracking yet
  m.track_changes();
  m.map(7, 2);
  m.map(4, 5);
  m.map(7, 3);  // remapped: its latest mapping
  m.unmap(1);   // mapped before tracking, unmapped since
  m.map(0, 0);
  m.unmap(0);  // mapped and unmapped: reported unmapped
  CHECK(pairs(m.take_changes()) == Pairs{{0, -1}, {1, -1}, {4, 5}, {7, 3}});
  CHECK(m.take_changes().empty());  // taken
  m.unmap(4);
  CHECK(pairs(m.take_changes()) == Pairs{{4, -1}});
}

TEST_CASE("swa map: applied changes reproduce the other table, and a bad one stops them", "[kv_pool][swa]") {
  const int32_t ps = 4;
  SwaMap leader(32, 12, ps, 1);
  SwaMap follower(32, 12, ps, 1);
  leader.track_changes();
  follower.open_sync_log(0);
  std::mt19937_64 rng(0x5eed5a);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int round = 0; round < 50; ++round) {
    for (int i = 0, n = int(uniform(0, 10)); i < n; ++i) {
      const int32_t f = int32_t(uniform(0, 31));
      if (uniform(0, 2) == 0) {
        leader.unmap(f);
      } else {
        leader.map(f, int32_t(uniform(0, 11)));
      }
    }
    const std::vector<SwaPageMapping> changes = leader.take_changes();
    REQUIRE(follower.apply_changes(changes).ok());
    REQUIRE(follower.table() == leader.table());
    // The follower's device copy is told of exactly those pages.
    std::vector<int32_t> pages;
    for (const SwaPageMapping& c : changes) pages.push_back(c.full_page);
    REQUIRE(follower.pages_to_sync(0) == pages);
    follower.synced(0);
  }

  SwaMap m(8, 4, ps, 1);
  for (const SwaPageMapping& bad :
       {SwaPageMapping{8, 0}, SwaPageMapping{-1, 0}, SwaPageMapping{2, 4}, SwaPageMapping{2, -2}}) {
    CAPTURE(bad.full_page, bad.swa_page);
    const absl::Status st = m.apply_changes({{1, 3}, bad, {5, 2}});
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()) == "kv pool: SWA table change of full page " +
                                           std::to_string(bad.full_page) + " to SWA page " +
                                           std::to_string(bad.swa_page) + " is out of range");
    CHECK(m.swa_page(1) == 3);   // applied before the bad one
    CHECK(m.swa_page(5) == -1);  // not after it
    m.unmap(1);
  }
  CHECK(m.apply_changes({}).ok());
  CHECK(m.apply_changes({{3, 0}, {3, -1}, {6, 1}}).ok());
  CHECK(m.swa_page(3) == -1);
  CHECK(m.swa_page(6) == 1);
}
