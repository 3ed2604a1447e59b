// PageTables (src/runtime/kv/page_tables.h) on its own: a sequence's pages as it grows,
// the slots of its positions, the pages growth needs, SWA pages leaving the window,
// prefix sharing and release. The pages are the test's own here (no allocator): the
// tables place exactly what they are given.
#include "tests/util/catch.h"

#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "src/runtime/kv/page_tables.h"
#include "tests/util/aborts.h"

namespace {

using namespace kvfuse;

using test::aborts;

using Pairs = std::vector<std::pair<int32_t, int32_t>>;
Pairs pairs(const std::vector<SwaPageMapping>& v) {
  Pairs out;
  for (const SwaPageMapping& m : v) out.emplace_back(m.full_page, m.swa_page);
  return out;
}

using Pages = std::vector<int32_t>;

}  // namespace

TEST_CASE("page tables: sequences are added once, and unknown ids read as empty", "[kv_pool]") {
  PageTables t(16, false);
  CHECK(t.page_size() == 16);
  CHECK_FALSE(t.with_swa());
  CHECK(t.size() == 0);
  REQUIRE(t.add(3).ok());
  const absl::Status dup = t.add(3);
  CHECK(dup.code() == absl::StatusCode::kAlreadyExists);
  CHECK(std::string(dup.message()) == "kv pool: sequence 3 already exists");
  CHECK(t.contains(3));
  CHECK_FALSE(t.contains(4));
  CHECK(t.size() == 1);
  REQUIRE(t.find(3) != nullptr);
  CHECK(t.find(3)->len == 0);
  CHECK(t.find(4) == nullptr);
  CHECK(t.reserved_len(4) == 0);
  CHECK(t.full_pages(4).empty());
  CHECK(t.swa_pages(4).empty());
  CHECK(t.pages_held(4).full == 0);
  // An unknown id counts as empty: what admission asks before adding a sequence.
  CHECK(t.pages_needed(4, 33).full == 3);
  CHECK(t.pages_needed(4, 33).swa == 0);
  CHECK(t.trim_window(4, 8).empty());
  CHECK(aborts([&] { (void)t.slot(4, 0); }));
}

TEST_CASE("page tables: a sequence grows page by page, and its slots follow its pages", "[kv_pool]") {
  const int32_t ps = 4;
  PageTables t(ps, false);
  REQUIRE(t.add(1).ok());
  CHECK(t.pages_needed(1, 0).full == 0);
  CHECK(t.pages_needed(1, 5).full == 2);
  CHECK(t.grow(1, 5, {7, 2}, {}).empty());  // no SWA: nothing mapped
  CHECK(t.reserved_len(1) == 5);
  CHECK(t.full_pages(1) == Pages{7, 2});
  CHECK(t.swa_pages(1).empty());
  CHECK(t.slot(1, 0) == 7 * ps);
  CHECK(t.slot(1, 3) == 7 * ps + 3);
  CHECK(t.slot(1, 4) == 2 * ps);
  CHECK(aborts([&] { (void)t.slot(1, 5); }));  // past the reserved length
  CHECK(aborts([&] { (void)t.slot(1, -1); }));
  // Within the last page: no page needed.
  CHECK(t.pages_needed(1, 8).full == 0);
  CHECK(t.pages_needed(1, 3).full == 0);  // shrinking: nothing
  t.grow(1, 8, {}, {});
  CHECK(t.slot(1, 7) == 2 * ps + 3);
  CHECK(t.pages_needed(1, 9).full == 1);
  t.grow(1, 9, {0}, {});
  CHECK(t.full_pages(1) == Pages{7, 2, 0});  // pages never move
  CHECK(t.pages_held(1).full == 3);
  CHECK(t.pages_held(1).swa == 0);
  // Growth with pages other than those needed is a caller bug.
  CHECK(aborts([&] { t.grow(1, 13, {}, {}); }));
  CHECK(aborts([&] { t.grow(1, 13, {5, 6}, {}); }));
  CHECK(aborts([&] { t.grow(1, 4, {}, {}); }));   // below len
  CHECK(aborts([&] { t.grow(2, 4, {5}, {}); }));  // unknown
}

TEST_CASE("page tables swa: SWA pages sit beside full pages and leave with the window", "[kv_pool][swa]") {
  const int32_t ps = 4, window = 6;
  PageTables t(ps, true);
  REQUIRE(t.add(1).ok());
  PagesNeeded need = t.pages_needed(1, 6);
  CHECK(need.full == 2);
  CHECK(need.swa == 2);
  CHECK(pairs(t.grow(1, 6, {10, 11}, {0, 1})) == Pairs{{10, 0}, {11, 1}});
  CHECK(t.swa_pages(1) == Pages{0, 1});
  // The partly filled page keeps its SWA page: growing into it and one more page needs one of each.
  need = t.pages_needed(1, 9);
  CHECK(need.full == 1);
  CHECK(need.swa == 1);
  CHECK(aborts([&] { t.grow(1, 9, {12}, {}); }));      // short of SWA pages
  CHECK(aborts([&] { t.grow(1, 9, {12}, {2, 3}); }));  // too many
  CHECK(pairs(t.grow(1, 9, {12}, {5})) == Pairs{{12, 5}});
  CHECK(t.pages_held(1).swa == 3);
  // len 9, window 6: positions < 9 - 6 + 1 = 4 are out of every future window: page 0.
  CHECK(pairs(t.trim_window(1, window)) == Pairs{{10, 0}});
  CHECK(t.swa_pages(1) == Pages{-1, 1, 5});
  CHECK(t.full_pages(1) == Pages{10, 11, 12});  // full pages stay
  CHECK(t.pages_held(1).full == 3);
  CHECK(t.pages_held(1).swa == 2);
  CHECK(t.trim_window(1, window).empty());  // nothing more
  // Growing to 20: pages 3 and 4 are new; at len 20, positions < 15 leave (pages 1, 2).
  need = t.pages_needed(1, 20);
  CHECK(need.full == 2);
  CHECK(need.swa == 2);
  CHECK(pairs(t.grow(1, 20, {13, 14}, {6, 7})) == Pairs{{13, 6}, {14, 7}});
  CHECK(pairs(t.trim_window(1, window)) == Pairs{{12, 5}, {11, 1}});  // last page first
  CHECK(t.swa_pages(1) == Pages{-1, -1, -1, 6, 7});
  // A window wider than the sequence frees nothing.
  REQUIRE(t.add(2).ok());
  t.grow(2, 16, {20, 21, 22, 23}, {8, 9, 10, 11});
  CHECK(t.trim_window(2, 100).empty());
  // Without SWA layers trimming does nothing.
  PageTables plain(ps, false);
  REQUIRE(plain.add(1).ok());
  plain.grow(1, 40, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {});
  CHECK(plain.trim_window(1, 1).empty());
}

TEST_CASE("page tables: a cached prefix's pages become a new sequence's first pages", "[kv_pool][prefix]") {
  PageTables t(16, false);
  REQUIRE(t.add(1).ok());
  t.grow(1, 70, {4, 3, 2, 1, 0}, {});
  REQUIRE(t.add(2).ok());
  REQUIRE(t.adopt_prefix(2, {4, 3, 2}).ok());
  CHECK(t.full_pages(2) == Pages{4, 3, 2});
  CHECK(t.reserved_len(2) == 48);
  CHECK(t.slot(2, 47) == t.slot(1, 47));
  CHECK(t.full_pages(1).size() == 5);  // the other holder keeps its pages
  t.grow(2, 50, {7}, {});
  CHECK(t.full_pages(2) == Pages{4, 3, 2, 7});

  REQUIRE(t.add(3).ok());
  CHECK(t.adopt_prefix(2, {5}).code() == absl::StatusCode::kInvalidArgument);  // has pages
  CHECK(std::string(t.adopt_prefix(2, {5}).message()) ==
        "kv pool: adopt_prefix for sequence 2, which holds 50 positions");
  CHECK(t.adopt_prefix(9, {5}).code() == absl::StatusCode::kNotFound);  // no sequence
  REQUIRE(t.adopt_prefix(3, {}).ok());  // nothing cached is fine
  CHECK(t.reserved_len(3) == 0);
  CHECK(t.full_pages(3).empty());

  PageTables swa(16, true);
  REQUIRE(swa.add(1).ok());
  CHECK(swa.adopt_prefix(1, {}).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("page tables: release hands back a sequence's pages and forgets it", "[kv_pool]") {
  PageTables t(8, true);
  REQUIRE(t.add(5).ok());
  t.grow(5, 20, {3, 1, 4}, {2, 0, 1});
  t.trim_window(5, 4);  // positions < 17 leave: pages 0 and 1
  absl::StatusOr<SeqPages> pages = t.release(5);
  REQUIRE(pages.ok());
  CHECK(pages->len == 20);
  CHECK(pages->full == Pages{3, 1, 4});
  CHECK(pages->swa == Pages{-1, -1, 1});
  CHECK_FALSE(t.contains(5));
  CHECK(t.size() == 0);
  const absl::Status again = t.release(5).status();
  CHECK(again.code() == absl::StatusCode::kNotFound);
  CHECK(std::string(again.message()) == "kv pool: release of unknown sequence 5");
  REQUIRE(t.add(5).ok());  // the id can come back, empty
  CHECK(t.reserved_len(5) == 0);
}
