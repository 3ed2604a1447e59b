// PageAllocator (src/runtime/kv/page_allocator.h) on its own: the order pages come out in
// and go back, reference counts of shared pages, all-or-nothing exhaustion, and the
// aborts on a caller's bug. A randomized test checks it against a model of the free list.
#include "tests/util/catch.h"

#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <vector>

#include "src/runtime/kv/page_allocator.h"
#include "tests/util/aborts.h"

namespace {

using namespace kvfuse;

using test::aborts;

std::vector<int32_t> take(PageAllocator& a, int64_t n) {
  std::vector<int32_t> out;
  REQUIRE(a.allocate(n, out));
  return out;
}

}  // namespace

TEST_CASE("page allocator: pages come out in order, and the last freed is the first reused", "[kv_pool]") {
  PageAllocator a(6);
  CHECK(a.num_pages() == 6);
  CHECK(a.num_free() == 6);
  CHECK(a.num_used() == 0);
  CHECK(take(a, 2) == std::vector<int32_t>{0, 1});
  CHECK(take(a, 3) == std::vector<int32_t>{2, 3, 4});
  a.free(3);
  a.free(0);
  a.free(4);
  CHECK(a.num_free() == 4);
  // A stack: 4 (freed last), then 0, then 3, then the never-used 5.
  CHECK(take(a, 1) == std::vector<int32_t>{4});
  CHECK(take(a, 3) == std::vector<int32_t>{0, 3, 5});
  CHECK(a.num_free() == 0);
  for (int32_t p = 0; p < 6; ++p) {
    CHECK(a.is_used(p));
    CHECK(a.refs(p) == 1);
  }
}

TEST_CASE("page allocator: allocation is all or nothing", "[kv_pool]") {
  PageAllocator a(4);
  std::vector<int32_t> out = {99};
  CHECK_FALSE(a.allocate(5, out));
  CHECK(out == std::vector<int32_t>{99});
  CHECK(a.num_free() == 4);
  CHECK_FALSE(a.allocate(-1, out));
  CHECK(out == std::vector<int32_t>{99});
  CHECK(a.allocate(0, out));
  CHECK(out == std::vector<int32_t>{99});
  CHECK(a.allocate(4, out));
  CHECK(out == std::vector<int32_t>{99, 0, 1, 2, 3});
  CHECK(a.num_free() == 0);
  CHECK_FALSE(a.allocate(1, out));
  CHECK(out.size() == 5);
  CHECK(a.allocate(0, out));  // nothing asked, nothing needed
  a.free(2);
  CHECK_FALSE(a.allocate(2, out));
  CHECK(a.num_free() == 1);
  CHECK(a.allocate(1, out));
  CHECK(out.back() == 2);

  PageAllocator empty(0);
  CHECK(empty.num_free() == 0);
  CHECK(empty.allocate(0, out));
  CHECK_FALSE(empty.allocate(1, out));
}

TEST_CASE("page allocator: a shared page is counted once and freed by its last reference",
          "[kv_pool][prefix]") {
  PageAllocator a(4);
  CHECK(take(a, 3) == std::vector<int32_t>{0, 1, 2});
  CHECK(a.num_shared() == 0);
  a.share(1);
  CHECK(a.refs(1) == 2);
  CHECK(a.num_shared() == 1);
  a.share(1);  // a third holder: still one shared page
  CHECK(a.refs(1) == 3);
  CHECK(a.num_shared() == 1);
  a.share(2);
  CHECK(a.num_shared() == 2);
  CHECK(a.num_used() == 3);  // pages, not references
  a.free(1);
  CHECK(a.refs(1) == 2);
  CHECK(a.num_shared() == 2);
  a.free(1);
  CHECK(a.refs(1) == 1);
  CHECK(a.num_shared() == 1);
  CHECK(a.is_used(1));
  CHECK(a.num_free() == 1);
  a.free(1);
  CHECK_FALSE(a.is_used(1));
  CHECK(a.num_free() == 2);
  CHECK(take(a, 1) == std::vector<int32_t>{1});  // back on top of the free list
  a.free(2);
  CHECK(a.num_shared() == 0);
  CHECK(a.refs(2) == 1);
}

TEST_CASE("page allocator: a caller's bug aborts", "[kv_pool]") {
  CHECK(aborts([] { PageAllocator a(-1); }));
  CHECK(aborts([] { PageAllocator a(int64_t(1) << 32); }));
  CHECK(aborts([] {
    PageAllocator a(4);
    a.free(0);  // never allocated
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    take(a, 1);
    a.free(0);
    a.free(0);
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    a.free(-1);
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    a.free(4);
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    a.share(0);  // free
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    a.share(4);
  }));
  CHECK(aborts([] {
    PageAllocator a(4);
    const std::vector<int32_t> p = take(a, 1);
    a.share(p[0]);
    a.free(p[0]);
    a.free(p[0]);
    a.free(p[0]);  // one more than held
  }));
  // The same calls within bounds do not abort.
  CHECK_FALSE(aborts([] {
    PageAllocator a(4);
    const std::vector<int32_t> p = take(a, 1);
    a.share(p[0]);
    a.free(p[0]);
    a.free(p[0]);
  }));
}

TEST_CASE("page allocator: randomized allocate/share/free matches a model of the free list", "[kv_pool]") {
  constexpr int32_t kPages = 37;
  PageAllocator a(kPages);
  // The model: a stack whose top is the next page handed out, and a count per page.
  std::vector<int32_t> stack;
  for (int32_t p = kPages - 1; p >= 0; --p) stack.push_back(p);
  std::map<int32_t, int32_t> refs;  // pages in use
  std::mt19937_64 rng(0x5eed0a11);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto pick_used = [&]() {
    auto it = refs.begin();
    std::advance(it, uniform(0, int64_t(refs.size()) - 1));
    return it->first;
  };
  int64_t refused = 0;
  for (int op = 0; op < 20000; ++op) {
    const int64_t r = uniform(0, 99);
    if (r < 40 || refs.empty()) {
      const int64_t n = uniform(0, 8);
      std::vector<int32_t> out;
      const bool ok = a.allocate(n, out);
      REQUIRE(ok == (n <= int64_t(stack.size())));
      if (!ok) {
        REQUIRE(out.empty());
        ++refused;
        continue;
      }
      REQUIRE(int64_t(out.size()) == n);
      for (int32_t p : out) {
        REQUIRE(p == stack.back());
        stack.pop_back();
        refs[p] = 1;
      }
    } else if (r < 55) {
      const int32_t p = pick_used();
      a.share(p);
      ++refs[p];
    } else {
      const int32_t p = pick_used();
      a.free(p);
      if (--refs[p] == 0) {
        refs.erase(p);
        stack.push_back(p);
      }
    }
    int64_t shared = 0;
    for (const auto& [p, n] : refs) shared += n > 1 ? 1 : 0;
    REQUIRE(a.num_free() == int64_t(stack.size()));
    REQUIRE(a.num_used() == int64_t(refs.size()));
    REQUIRE(a.num_shared() == shared);
    for (int32_t p = 0; p < kPages; ++p) {
      const auto it = refs.find(p);
      REQUIRE(a.refs(p) == (it == refs.end() ? 0 : it->second));
    }
  }
  CHECK(refused > 100);  // it ran dry, often
}
