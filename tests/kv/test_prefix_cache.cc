// The prefix cache at the pool's level (src/runtime/kv/prefix_cache.h, page_allocator.h,
// kv_pool.h): retained pages and their eviction order, the chains and their verification
// (two prefixes forced onto one hash are told apart), the pool's accounting with cached
// pages (nothing leaked, references equal holders, a page a sequence holds is never
// evicted), FlushCache with live sequences, new scales, and the events.
#include <algorithm>
#include <numeric>
#include <vector>

#include "src/backends/cpu/cpu_backend.h"
#include "src/runtime/kv_pool.h"
#include "tests/util/aborts.h"
#include "tests/util/catch.h"

using namespace kvfuse;
using kvfuse::test::aborts;
using Pages = std::vector<int32_t>;

namespace {

KvPoolConfig cache_cfg(int64_t pages, bool swa = false) {
  KvPoolConfig c;
  c.num_layers = 2;
  c.page_size = 4;
  c.num_pages = pages;
  c.swa_num_pages = swa ? pages : 0;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.format = KvFormat::bf16;
  c.layer_is_swa = {swa, false};
  c.window = swa ? 8 : 0;
  c.max_step_tokens = 16;
  c.k_scale = {1.0f, 1.0f};
  c.v_scale = {1.0f, 1.0f};
  c.prefix_cache = true;
  c.prefix_cache_salt = 7;
  return c;
}

std::unique_ptr<KvPool> pool_of(const KvPoolConfig& c) {
  auto p = KvPool::create_shared(c, 1);
  REQUIRE(p.ok());
  return *std::move(p);
}

std::vector<int32_t> tokens_from(int32_t first, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// A sequence computed over `tokens`: added, reserved, every token computed.
void compute(KvPool& pool, SeqId id, const std::vector<int32_t>& tokens, bool take_cached = true) {
  REQUIRE(pool.add_sequence(id).ok());
  if (take_cached) REQUIRE(pool.take_cached_prefix(id, tokens, int64_t(tokens.size()) - 1).ok());
  REQUIRE(pool.reserve(id, int32_t(tokens.size())).ok());
  pool.cache_computed(id, tokens, int32_t(tokens.size()));
  REQUIRE(pool.check_invariants().ok());
}

uint64_t constant_hash(uint64_t, const int32_t*, int32_t) { return 42; }

}  // namespace

TEST_CASE("page allocator: retained pages wait evictable, least recently released first", "[kv_pool][prefix]") {
  PageAllocator a(4);
  std::vector<int32_t> evicted;
  a.set_on_evict([&](int32_t p) { evicted.push_back(p); });
  Pages p;
  REQUIRE(a.allocate(4, p));
  CHECK(p == Pages{0, 1, 2, 3});
  for (int32_t x : {0, 1, 2}) a.retain(x);
  for (int32_t x : {2, 0, 1, 3}) a.free(x);  // 3 is not retained: free
  CHECK(a.num_evictable() == 3);
  CHECK(a.num_free() == 4);
  CHECK(a.num_used() == 0);
  CHECK(a.is_evictable(2));
  a.revive(0);  // a hit: in use again, out of the eviction order
  CHECK(a.refs(0) == 1);
  CHECK(a.num_evictable() == 2);
  Pages q;
  REQUIRE(a.allocate(2, q));  // the free page first, then the oldest evictable
  CHECK(q == Pages{3, 2});
  CHECK(evicted == Pages{2});
  CHECK_FALSE(a.is_retained(2));
  CHECK_FALSE(a.allocate(2, q));  // one left: all or nothing
  CHECK(q.size() == 2);
  CHECK(a.evict_all() == 1);
  CHECK(evicted == Pages{2, 1});
  CHECK(a.num_free() == 1);
  // Misuse aborts: reviving a page that is not evictable, retaining a free page, freeing
  // or sharing a page that is not in use.
  CHECK(aborts([] {
    PageAllocator b(2);
    b.revive(0);
  }));
  CHECK(aborts([] {
    PageAllocator b(2);
    b.retain(1);
  }));
  CHECK(aborts([] {
    PageAllocator b(2);
    Pages r;
    b.allocate(1, r);
    b.retain(r[0]);
    b.free(r[0]);
    b.free(r[0]);  // evictable, not in use
  }));
  CHECK(aborts([] {
    PageAllocator b(4);
    b.share(2);
  }));
}

TEST_CASE("prefix cache: chains are matched whole pages at a time and verified token for token",
          "[kv_pool][prefix]") {
  PrefixCache c(4, 99);
  const std::vector<int32_t> t = tokens_from(100, 10);
  c.start(1, c.match(t.data(), 9));
  CHECK(c.add_computed(1, t.data(), 10, {5, 6, 7}) == Pages{5, 6});  // 2 whole pages
  CHECK(c.num_blocks() == 2);
  auto m = c.match(t.data(), 9);
  CHECK(m.pages == Pages{5, 6});
  CHECK(c.match(t.data(), 7).pages == Pages{5});  // whole pages within the limit
  std::vector<int32_t> u = t;
  u[5] = 0;  // the second page differs
  CHECK(c.match(u.data(), 9).pages == Pages{5});
  u[1] = 0;
  CHECK(c.match(u.data(), 9).pages.empty());
  // Events: one block_stored for the run, the first block without a parent.
  auto ev = c.take_events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvEvent::Kind::block_stored);
  CHECK(ev[0].block_hashes.size() == 2);
  CHECK_FALSE(ev[0].parent_block_hash.has_value());
  CHECK(ev[0].token_ids == std::vector<int32_t>(t.begin(), t.begin() + 8));
  CHECK(ev[0].block_size == 4);
  // A sequence that starts from the cached chain adds its third page with the chain's
  // last hash as parent.
  c.start(2, m);
  std::vector<int32_t> longer = tokens_from(100, 12);
  CHECK(c.add_computed(2, longer.data(), 12, {5, 6, 9}) == Pages{9});
  ev = c.take_events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].parent_block_hash == m.hash);
  // Content cached under another page is not cached twice.
  CHECK(c.add_computed(4, longer.data(), 12, {1, 2, 3}).empty());
  c.evicted(6);
  CHECK(c.match(longer.data(), 12).pages == Pages{5});  // the chain ends where a block went
  ev = c.take_events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvEvent::Kind::block_removed);
  CHECK(c.check({5, 9}).ok());
}

TEST_CASE("prefix cache: prefixes forced onto one hash are told apart", "[kv_pool][prefix]") {
  PrefixCache c(4, 1, &constant_hash);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<int32_t> b = {9, 9, 9, 9, 5, 6, 7, 8, 9};  // same second page, another first
  CHECK(c.add_computed(1, a.data(), 8, {10, 11}) == Pages{10, 11});
  CHECK(c.add_computed(2, b.data(), 8, {20, 21}) == Pages{20, 21});  // same hashes, other content
  CHECK(c.match(a.data(), 8).pages == Pages{10, 11});
  CHECK(c.match(b.data(), 8).pages == Pages{20, 21});
  const std::vector<int32_t> d = {1, 2, 3, 4, 0, 0, 0, 0};
  CHECK(c.match(d.data(), 8).pages == Pages{10});
  // With the first page of a gone, b's second page is still not a's.
  c.evicted(10);
  CHECK(c.match(a.data(), 8).pages.empty());
  CHECK(c.check({11, 20, 21}).ok());
}

TEST_CASE("kv pool: cached pages outlive their sequence, serve the next one, count as free", "[kv_pool][prefix]") {
  auto pool = pool_of(cache_cfg(8));
  REQUIRE(pool->caching());
  const std::vector<int32_t> t = tokens_from(0, 14);  // 3 whole pages of 4, and 2 tokens
  compute(*pool, 1, t);
  CHECK(pool->cache_stats().cached_pages == 3);
  REQUIRE(pool->release(1).ok());
  CHECK(pool->usage(PoolKind::full).used_pages == 0);
  CHECK(pool->usage(PoolKind::full).free_pages == 8);
  CHECK(pool->cache_stats().evictable_pages == 3);
  REQUIRE(pool->check_invariants().ok());
  // The same prompt: the 3 pages back (13 tokens looked up: the last is computed).
  REQUIRE(pool->add_sequence(2).ok());
  auto hit = pool->take_cached_prefix(2, t, 13);
  REQUIRE(hit.ok());
  CHECK(*hit == 12);
  CHECK(pool->reserved_len(2) == 12);
  CHECK(pool->usage(PoolKind::full).used_pages == 3);
  CHECK(pool->cache_stats().evictable_pages == 0);
  // A third holder while the second lives: shared, counted once.
  REQUIRE(pool->add_sequence(3).ok());
  REQUIRE(pool->take_cached_prefix(3, t, 9).ok());
  CHECK(pool->reserved_len(3) == 8);
  CHECK(pool->usage(PoolKind::full).shared_pages == 2);
  REQUIRE(pool->check_invariants().ok());
  const KvPool::CacheStats s = pool->cache_stats();
  CHECK(s.query_tokens == 13 + 13 + 9);  // sequence 1 looked its prompt up too
  CHECK(s.hit_tokens == 12 + 8);
  for (SeqId id : {2, 3}) REQUIRE(pool->release(id).ok());
  CHECK(pool->usage(PoolKind::full).used_pages == 0);
  REQUIRE(pool->check_invariants().ok());
}

TEST_CASE("kv pool: a reservation evicts cached pages, later blocks first, never a held one", "[kv_pool][prefix]") {
  auto pool = pool_of(cache_cfg(6));
  const std::vector<int32_t> t = tokens_from(0, 17);  // 4 whole pages and 1 token: 5 pages
  compute(*pool, 1, t);
  auto stored = pool->take_kv_events();
  REQUIRE(stored.size() == 1);
  REQUIRE(stored[0].block_hashes.size() == 4);
  REQUIRE(pool->release(1).ok());
  // Sequence 2 holds the first two cached pages.
  REQUIRE(pool->add_sequence(2).ok());
  REQUIRE(*pool->take_cached_prefix(2, std::vector<int32_t>(t.begin(), t.begin() + 9), 8) == 8);
  // 2 free pages and 2 evictable (the chain's third and fourth) remain: sequence 3 takes all.
  REQUIRE(pool->add_sequence(3).ok());
  CHECK(pool->usage(PoolKind::full).free_pages == 4);
  REQUIRE(pool->reserve(3, 16).ok());
  auto ev = pool->take_kv_events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvEvent::Kind::block_removed);
  // The fourth block went before the third: released last page first, evicted oldest first.
  CHECK(ev[0].block_hashes == std::vector<uint64_t>{stored[0].block_hashes[3], stored[0].block_hashes[2]});
  REQUIRE(pool->add_sequence(4).ok());
  CHECK(pool->reserve(4, 4).code() == absl::StatusCode::kResourceExhausted);  // held pages stay
  CHECK(pool->cache_stats().cached_pages == 2);
  REQUIRE(pool->check_invariants().ok());
  for (SeqId id : {2, 3, 4}) REQUIRE(pool->release(id).ok());
  CHECK(pool->usage(PoolKind::full).used_pages == 0);
  REQUIRE(pool->check_invariants().ok());
}

TEST_CASE("kv pool: FlushCache drops the unheld cached pages only, and new scales end every chain",
          "[kv_pool][prefix]") {
  auto pool = pool_of(cache_cfg(12));
  const std::vector<int32_t> a = tokens_from(0, 9), b = tokens_from(50, 9);
  compute(*pool, 1, a);
  compute(*pool, 2, b);
  REQUIRE(pool->release(1).ok());
  (void)pool->take_kv_events();
  CHECK(pool->flush_cache() == 2);  // a's two pages; b's are held
  CHECK(pool->cache_stats().cached_pages == 2);
  auto ev = pool->take_kv_events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvEvent::Kind::block_removed);
  REQUIRE(pool->check_invariants().ok());
  REQUIRE(pool->release(2).ok());
  CHECK(pool->flush_cache() == 2);
  ev = pool->take_kv_events();
  REQUIRE(ev.size() == 2);
  CHECK(ev[1].kind == KvEvent::Kind::all_blocks_cleared);
  CHECK(pool->usage(PoolKind::full).free_pages == 12);
  // KV cached under other scales is not served (a pool with storage, for the scales).
  auto backend = make_cpu_backend();
  auto stored = KvPool::create(*backend, cache_cfg(12));
  REQUIRE(stored.ok());
  KvPool& p2 = **stored;
  compute(p2, 3, a);
  REQUIRE(p2.release(3).ok());
  REQUIRE(p2.set_scales(1, 1.0f, 1.0f).ok());  // the same scales: the chains stay
  REQUIRE(p2.add_sequence(4).ok());
  CHECK(*p2.take_cached_prefix(4, a, 8) == 8);
  REQUIRE(p2.release(4).ok());
  REQUIRE(p2.set_scales(1, 2.0f, 1.0f).ok());
  REQUIRE(p2.add_sequence(5).ok());
  CHECK(*p2.take_cached_prefix(5, a, 8) == 0);
  CHECK(p2.cache_stats().cached_pages == 0);  // flushed with the old scales
  REQUIRE(p2.check_invariants().ok());
}

TEST_CASE("kv pool: no prefix cache with SWA layers or when the config says off", "[kv_pool][prefix]") {
  CHECK_FALSE(pool_of(cache_cfg(8, /*swa=*/true))->caching());
  KvPoolConfig off = cache_cfg(8);
  off.prefix_cache = false;
  auto pool = pool_of(off);
  CHECK_FALSE(pool->caching());
  compute(*pool, 1, tokens_from(0, 9));
  REQUIRE(pool->release(1).ok());
  REQUIRE(pool->add_sequence(2).ok());
  CHECK(*pool->take_cached_prefix(2, tokens_from(0, 9), 8) == 0);
  CHECK(pool->cache_stats().cached_pages == 0);
}
