// KvPool (src/runtime/kv_pool.h) and PageAllocator (src/runtime/kv/page_allocator.h):
// ownership, all-or-nothing reservation, sliding-window page freeing, slot mapping and
// the full_to_swa table, config checks.
// A randomized test drives the pool like a scheduler does and checks it against a
// shadow model kept by the test.
#include "tests/util/catch.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <new>
#include <random>
#include <set>
#include <tuple>

#include "src/common/arith.h"
#include "src/runtime/kv_pool.h"
#include "tests/kv/kv_view_checks.h"
#include "tests/util/aborts.h"

namespace {

using namespace kvfuse;

// Host memory standing in for a device; the pool only allocates and copies. Fresh
// memory is filled with 0xa5 so a test can see that the pool zeroes its buffers.
class HostTestBackend final : public Backend {
 public:
  static constexpr std::align_val_t kAlign{256};
  int64_t live_allocs = 0;
  int64_t fail_alloc_after = -1;  // >= 0: allocations after this many fail
  int64_t allocs_done = 0;
  int64_t copied_to_device_bytes = 0;
  std::vector<size_t> alloc_sizes;

  Device device() const override { return Device::cpu; }
  std::string description() const override { return "host test backend"; }
  KvFormat resolve_kv_format(KvCacheDtype d) const override {
    return d == KvCacheDtype::bf16       ? KvFormat::bf16
           : d == KvCacheDtype::fp8_e5m2 ? KvFormat::fp8_e5m2
                                         : KvFormat::fp8_e4m3fn;
  }
  absl::Status check_supported(const ModelSpec&, KvFormat) const override { return absl::OkStatus(); }
  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override {
    if (fail_alloc_after >= 0 && allocs_done >= fail_alloc_after)
      return absl::ResourceExhaustedError("test: out of memory");
    ++allocs_done;
    ++live_allocs;
    alloc_sizes.push_back(bytes);
    void* p = ::operator new(bytes, kAlign);
    std::memset(p, 0xa5, bytes);
    return DeviceBuffer(p, bytes, [this](void* q) {
      ::operator delete(q, kAlign);
      --live_allocs;
    });
  }
  absl::Status memset(void* dst, int value, size_t bytes) override {
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    copied_to_device_bytes += int64_t(bytes);
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status synchronize() override { return absl::OkStatus(); }
  absl::Status copy_2d(void*, size_t, const void*, size_t, size_t, int64_t) override { return no(); }
  absl::StatusOr<LinearWeight> upload_linear(const bf16_t*, int64_t, int64_t, const bf16_t*) override {
    return no();
  }
  absl::Status embedding(const int32_t*, int64_t, const bf16_t*, int64_t, bf16_t*) override { return no(); }
  absl::Status rmsnorm(const bf16_t*, const bf16_t*, int64_t, int64_t, float, bf16_t*) override {
    return no();
  }
  absl::Status linear(const bf16_t*, int64_t, const LinearWeight&, bf16_t*) override { return no(); }
  absl::Status linear_logits(const bf16_t*, int64_t, const LinearWeight&, float*) override { return no(); }
  absl::Status rope(bf16_t*, int64_t, int32_t, bf16_t*, int64_t, int32_t, int32_t, const int32_t*, int64_t,
                    const float*, float) override {
    return no();
  }
  absl::Status silu_mul(const bf16_t*, int64_t, int64_t, bf16_t*) override { return no(); }
  absl::Status residual_add(bf16_t*, const bf16_t*, int64_t) override { return no(); }
  absl::Status gather_rows(const bf16_t*, int64_t, const int32_t*, int64_t, bf16_t*) override { return no(); }
  absl::Status kv_write(const KvWriteArgs&, KvWritePath) override { return no(); }
  absl::Status kv_write_rope(const KvWriteRopeArgs&) override { return no(); }
  absl::Status reserve_kv_write(int64_t, int64_t) override { return no(); }
  absl::Status attention(const AttnArgs&, AttentionPath) override { return no(); }
  absl::Status argmax_rows(const float*, int64_t, int64_t, int32_t*, int32_t*) override { return no(); }
  absl::Status sample_rows(const float*, int64_t, int64_t, const RowSampling*, int32_t*) override {
    return no();
  }
  absl::Status adjust_rows(float*, int64_t, int64_t, const int32_t*, LogitAdjust*, bool) override { return no(); }
  absl::Status add_rmsnorm(bf16_t*, const bf16_t*, const bf16_t*, int64_t, int64_t, float, bf16_t*) override {
    return no();
  }
  absl::Status logprobs_rows(const float*, int64_t, int64_t, const LogprobRow*, const int32_t*, const int32_t*,
                             const RowSampling*, LogprobOut*) override {
    return no();
  }

 private:
  static absl::Status no() { return absl::UnimplementedError("test backend: ops are not used by KvPool"); }
};

KvPoolConfig make_cfg(std::vector<bool> swa_layers, int32_t page_size, int64_t pages, int64_t swa_pages,
                      int32_t window) {
  KvPoolConfig c;
  c.num_layers = int32_t(swa_layers.size());
  c.page_size = page_size;
  c.num_pages = pages;
  c.swa_num_pages = swa_pages;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.format = KvFormat::fp8_e4m3fn;
  c.layer_is_swa = std::move(swa_layers);
  c.window = window;
  c.k_scale.assign(c.layer_is_swa.size(), 1.0f);
  c.v_scale.assign(c.layer_is_swa.size(), 1.0f);
  return c;
}

std::unique_ptr<KvPool> make_pool(Backend& be, const KvPoolConfig& c) {
  auto pool = KvPool::create(be, c);
  INFO(pool.status().ToString());
  REQUIRE(pool.ok());
  return *std::move(pool);
}

int64_t live_swa_pages(const KvPool& pool, SeqId id) {
  int64_t n = 0;
  for (int32_t p : pool.page_table(id, PoolKind::swa)) n += p >= 0 ? 1 : 0;
  return n;
}

using test::aborts;

// The test's own account of the pool: which pages each sequence owns, checked against
// the pool after every operation. Page ids come from the pool; everything else (how
// many, which may change, which must be -1, whether a reserve fits) is computed here.
class Shadow {
 public:
  Shadow(const KvPool& pool, const KvPoolConfig& c) : pool_(pool), c_(c), has_swa_(pool.has_swa()) {}

  int64_t full_free() const { return c_.num_pages - int64_t(full_owned_.size()); }
  int64_t swa_free() const { return has_swa_ ? c_.swa_num_pages - int64_t(swa_owned_.size()) : 0; }
  int64_t full_pages(SeqId id) const { return int64_t(seqs_.at(id).full.size()); }

  void added(SeqId id) { seqs_[id] = {}; }

  // Whether reserve(id, new_len) must succeed, from the shadow's own counts.
  bool reserve_fits(SeqId id, int32_t new_len) const {
    const Seq& s = seqs_.at(id);
    if (new_len <= s.len) return true;
    const int64_t target = ceil_div(new_len, c_.page_size);
    int64_t need_swa = 0;
    for (int64_t i = s.len / c_.page_size; i < target; ++i) {
      need_swa += (size_t(i) >= s.swa.size() || s.swa[size_t(i)] < 0) ? 1 : 0;
    }
    return target - int64_t(s.full.size()) <= full_free() && (!has_swa_ || need_swa <= swa_free());
  }

  void reserved(SeqId id, int32_t new_len) {
    Seq& s = seqs_.at(id);
    if (new_len <= s.len) return;
    const auto& full = pool_.page_table(id, PoolKind::full);
    const auto& swa = pool_.page_table(id, PoolKind::swa);
    REQUIRE(int64_t(full.size()) == ceil_div(new_len, c_.page_size));
    for (size_t i = 0; i < full.size(); ++i) {
      if (i < s.full.size()) {
        REQUIRE(full[i] == s.full[i]);  // pages never move
      } else {
        REQUIRE(full_owned_.insert(full[i]).second);  // new page owned by no one before
      }
    }
    if (has_swa_) {
      REQUIRE(swa.size() == full.size());
      const size_t first_new = size_t(s.len / c_.page_size);
      for (size_t i = 0; i < swa.size(); ++i) {
        const int32_t old = i < s.swa.size() ? s.swa[i] : -1;
        if (old >= 0 || i < first_new) {
          REQUIRE(swa[i] == old);  // live pages stay, trimmed ones stay freed
        } else {
          REQUIRE(swa[i] >= 0);
          REQUIRE(swa_owned_.insert(swa[i]).second);
        }
      }
    } else {
      REQUIRE(swa.empty());
    }
    s.full = full, s.swa = swa, s.len = new_len;
  }

  void trimmed(SeqId id) {
    Seq& s = seqs_.at(id);
    for (size_t i = 0; i < s.swa.size(); ++i) {
      if (s.swa[i] >= 0 && int64_t(i + 1) * c_.page_size <= int64_t(s.len) - c_.window + 1) {
        REQUIRE(swa_owned_.erase(s.swa[i]) == 1);
        s.swa[i] = -1;
      }
    }
  }

  void released(SeqId id) {
    const Seq& s = seqs_.at(id);
    for (int32_t p : s.full) REQUIRE(full_owned_.erase(p) == 1);
    for (int32_t p : s.swa) REQUIRE((p < 0 || swa_owned_.erase(p) == 1));
    seqs_.erase(id);
  }

  // Compares everything the pool exposes with the shadow.
  void check() const {
    const absl::Status inv = pool_.check_invariants();
    INFO(inv.ToString());
    REQUIRE(inv.ok());
    REQUIRE(pool_.num_sequences() == seqs_.size());
    const PoolUsage fu = pool_.usage(PoolKind::full), su = pool_.usage(PoolKind::swa);
    REQUIRE(fu.total_pages == c_.num_pages);
    REQUIRE(fu.used_pages + fu.free_pages == fu.total_pages);
    REQUIRE(fu.used_pages == int64_t(full_owned_.size()));
    REQUIRE(su.total_pages == (has_swa_ ? c_.swa_num_pages : 0));
    REQUIRE(su.used_pages + su.free_pages == su.total_pages);
    REQUIRE(su.used_pages == int64_t(swa_owned_.size()));
    const std::vector<int64_t>& table = pool_.host_swa_table();
    int64_t mapped_entries = 0, wrong_entries = 0;
    for (const auto& [id, s] : seqs_) {
      REQUIRE(pool_.reserved_len(id) == s.len);
      REQUIRE(pool_.page_table(id, PoolKind::full) == s.full);
      REQUIRE(pool_.page_table(id, PoolKind::swa) == s.swa);
      for (size_t i = 0; has_swa_ && i < s.full.size(); ++i) {
        for (int64_t o = 0; o < c_.page_size; ++o) {
          const int64_t want = s.swa[i] >= 0 ? int64_t(s.swa[i]) * c_.page_size + o : -1;
          wrong_entries += table[size_t(int64_t(s.full[i]) * c_.page_size + o)] != want;
          mapped_entries += want >= 0 ? 1 : 0;
        }
      }
    }
    REQUIRE(wrong_entries == 0);
    // No stale mappings anywhere else in the table.
    const int64_t table_mapped = std::count_if(table.begin(), table.end(), [](int64_t e) { return e >= 0; });
    REQUIRE(table_mapped == mapped_entries);
    REQUIRE(mapped_entries == int64_t(swa_owned_.size()) * c_.page_size);
  }

 private:
  struct Seq {
    int32_t len = 0;
    std::vector<int32_t> full, swa;
  };
  const KvPool& pool_;
  KvPoolConfig c_;
  bool has_swa_;
  std::map<SeqId, Seq> seqs_;
  std::set<int32_t> full_owned_, swa_owned_;
};

// Drives a pool like a scheduler under pressure: admissions, prefill chunks and decode
// steps, window trims, finishes and cancellations, bogus ids, and frequent exhaustion.
void run_randomized(const KvPoolConfig& c, uint64_t seed, int ops) {
  HostTestBackend be;
  {
    auto pool = make_pool(be, c);
    Shadow shadow(*pool, c);
    std::mt19937_64 rng(seed);
    auto uniform = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    std::vector<SeqId> live, dead;
    SeqId next_id = 1;
    int64_t exhausted = 0, grown = 0, released = 0, trims = 0;
    auto pick = [&]() { return live[size_t(uniform(0, int64_t(live.size()) - 1))]; };
    for (int op = 0; op < ops; ++op) {
      const int64_t r = uniform(0, 99);
      if (live.empty() || (r < 10 && live.size() < 12)) {
        const SeqId id = next_id++;
        REQUIRE(pool->add_sequence(id).ok());
        shadow.added(id);
        live.push_back(id);
      } else if (r < 60) {
        // A decode step half the time, else a prefill chunk of 1..100 tokens.
        const SeqId id = pick();
        const int32_t len = pool->reserved_len(id);
        const int32_t new_len = len + int32_t(uniform(0, 1) ? 1 : uniform(1, 100));
        const PagesNeeded need = pool->pages_needed(id, new_len);
        const bool fits = shadow.reserve_fits(id, new_len);
        const absl::Status st = pool->reserve(id, new_len);
        INFO("reserve seq " << id << " " << len << " -> " << new_len << ": " << st.ToString());
        REQUIRE(st.ok() == fits);
        if (st.ok()) {
          const int64_t full_before = shadow.full_pages(id);
          shadow.reserved(id, new_len);
          REQUIRE(need.full == int64_t(pool->page_table(id, PoolKind::full).size()) - full_before);
          ++grown;
        } else {
          REQUIRE(st.code() == absl::StatusCode::kResourceExhausted);
          REQUIRE(std::string(st.message()).find("needs") != std::string::npos);
          REQUIRE((need.full > shadow.full_free() || need.swa > shadow.swa_free()));
          ++exhausted;
        }
      } else if (r < 75) {
        const SeqId id = pick();
        pool->trim_window(id);
        shadow.trimmed(id);
        ++trims;
      } else if (r < 88) {
        // Finished or cancelled mid-prefill: both are a release.
        const SeqId id = pick();
        REQUIRE(pool->release(id).ok());
        shadow.released(id);
        live.erase(std::find(live.begin(), live.end(), id));
        dead.push_back(id);
        ++released;
      } else if (r < 93) {
        // A release of an id that is gone or never was: NOT_FOUND, and nothing changes.
        const SeqId id = (!dead.empty() && uniform(0, 1)) ? dead[size_t(uniform(0, int64_t(dead.size()) - 1))]
                                                          : SeqId(1'000'000 + uniform(0, 1000));
        REQUIRE(pool->release(id).code() == absl::StatusCode::kNotFound);
        REQUIRE(pool->reserve(id, 10).code() == absl::StatusCode::kNotFound);
        pool->trim_window(id);  // a no-op
      } else if (r < 96) {
        REQUIRE(pool->add_sequence(pick()).code() == absl::StatusCode::kAlreadyExists);
      } else if (r < 98) {
        const SeqId id = pick();
        REQUIRE(pool->reserve(id, int32_t(uniform(0, pool->reserved_len(id)))).ok());  // shrinking: a no-op
      } else {
        REQUIRE(pool->sync_swa_table().ok());
        const SwaSlotTable t = pool->swa_table();
        REQUIRE(t.size == int64_t(pool->host_swa_table().size()));
        if (t.size > 0) {
          REQUIRE(std::memcmp(t.full_to_swa, pool->host_swa_table().data(), size_t(t.size) * 8) == 0);
        }
      }
      shadow.check();
    }
    CAPTURE(exhausted, grown, released, trims);
    CHECK(exhausted > ops / 50);  // the pools really ran dry, often
    CHECK(grown > ops / 5);
    for (SeqId id : live) {
      REQUIRE(pool->release(id).ok());
      shadow.released(id);
    }
    shadow.check();
    CHECK(pool->usage(PoolKind::full).free_pages == c.num_pages);
    CHECK(pool->usage(PoolKind::swa).used_pages == 0);
    const auto& table = pool->host_swa_table();
    CHECK(std::count(table.begin(), table.end(), int64_t(-1)) == int64_t(table.size()));
  }
  CHECK(be.live_allocs == 0);  // every buffer went back to the backend
}

}  // namespace

TEST_CASE("kv pool: randomized allocate/extend/free/abort never leaks or double-owns pages", "[kv_pool]") {
  run_randomized(make_cfg({false, false, false}, 16, 24, 0, 0), 0x5eed0001, 6000);
}

TEST_CASE("kv pool swa: randomized allocate/extend/trim/free never leaks or double-owns pages",
          "[kv_pool][swa]") {
  // Hybrid layer patterns; windows smaller than, equal to and larger than a page.
  run_randomized(make_cfg({false, true, true, false}, 8, 96, 40, 24), 0x5eed0002, 6000);
  run_randomized(make_cfg({true, false}, 16, 64, 24, 16), 0x5eed0003, 5000);
  run_randomized(make_cfg({true, true, false}, 16, 64, 20, 5), 0x5eed0004, 5000);
  run_randomized(make_cfg({false, true}, 4, 200, 30, 1), 0x5eed0005, 5000);
}

TEST_CASE("kv pool swa: pages out of the window are freed as a sequence grows", "[kv_pool][swa]") {
  for (const auto& [ps, window, chunk] :
       {std::tuple{16, 64, 1}, std::tuple{16, 40, 37}, std::tuple{8, 3, 100}, std::tuple{16, 16, 16},
        std::tuple{4, 50, 7}}) {
    CAPTURE(ps, window, chunk);
    HostTestBackend be;
    // The SWA pool holds far fewer tokens than the sequence grows to: only freeing
    // pages lets it go on.
    const int64_t swa_pages = ceil_div(window + chunk, ps) + 1;
    const KvPoolConfig c = make_cfg({true, false, true}, ps, ceil_div(5000, ps) + 1, swa_pages, window);
    auto pool = make_pool(be, c);
    REQUIRE(pool->add_sequence(7).ok());
    // Prefill in chunks and decode: reserve, (the step runs), trim.
    while (pool->reserved_len(7) + chunk <= 5000) {
      const int32_t len = pool->reserved_len(7) + chunk;
      INFO("len " << len);
      REQUIRE(pool->reserve(7, len).ok());
      CHECK(live_swa_pages(*pool, 7) <= ceil_div(window + chunk, ps) + 1);
      pool->trim_window(7);
      CHECK(live_swa_pages(*pool, 7) <= ceil_div(window, ps) + 1);
      const auto& swa = pool->page_table(7, PoolKind::swa);
      const auto& full = pool->page_table(7, PoolKind::full);
      for (size_t i = 0; i < swa.size(); ++i) {
        // Freed exactly when every position of the page is before len - window + 1.
        const bool dead = int64_t(i + 1) * ps <= len - window + 1;
        REQUIRE((swa[i] == -1) == dead);
        REQUIRE(pool->host_swa_table()[size_t(int64_t(full[i]) * ps)] == (dead ? -1 : int64_t(swa[i]) * ps));
      }
      REQUIRE(pool->check_invariants().ok());
    }
    CHECK(pool->usage(PoolKind::swa).used_pages == live_swa_pages(*pool, 7));
    REQUIRE(pool->release(7).ok());
    CHECK(pool->usage(PoolKind::swa).used_pages == 0);
  }
}

TEST_CASE("kv pool: page policy counts and bounds the pages of a growing sequence", "[kv_pool][swa]") {
  for (const auto& [ps, window, chunk] :
       {std::tuple{16, 64, 1}, std::tuple{16, 40, 37}, std::tuple{8, 3, 100}}) {
    CAPTURE(ps, window, chunk);
    HostTestBackend be;
    KvPoolConfig c = make_cfg({true, false}, ps, ceil_div(3000, ps) + 1, 1, window);
    c.max_step_tokens = chunk;
    // An SWA pool of exactly the bound serves one sequence of any length.
    c.swa_num_pages = KvPool::max_swa_pages_held(c);
    CHECK(c.swa_num_pages == ceil_div(window + chunk, ps) + 1);
    CHECK(KvPool::max_swa_pages_held(c, 1) == 2);
    auto pool = make_pool(be, c);
    const int32_t target = 3000 - chunk;
    const PagesNeeded unknown = pool->pages_to_hold(7, target);
    CHECK(unknown.full == ceil_div(target, ps));
    CHECK(unknown.swa == c.swa_num_pages);
    REQUIRE(pool->add_sequence(7).ok());
    const PagesNeeded to_reach = pool->pages_to_reach(7, target);
    CHECK(to_reach.full == ceil_div(target, ps));
    CHECK(to_reach.swa == std::min(ceil_div(target, ps), c.swa_num_pages));
    while (pool->reserved_len(7) + chunk <= target) {
      const int32_t len = pool->reserved_len(7) + chunk;
      const PagesNeeded need = pool->pages_needed(7, len);
      const int64_t full_used = pool->usage(PoolKind::full).used_pages;
      const int64_t swa_used = pool->usage(PoolKind::swa).used_pages;
      REQUIRE(pool->reserve(7, len).ok());
      CHECK(pool->usage(PoolKind::full).used_pages - full_used == need.full);
      CHECK(pool->usage(PoolKind::swa).used_pages - swa_used == need.swa);
      const PagesNeeded held = pool->pages_held(7);
      CHECK(held.full == ceil_div(len, ps));
      CHECK(held.swa == live_swa_pages(*pool, 7));
      CHECK(held.swa <= KvPool::max_swa_pages_held(c, len));
      CHECK(pool->pages_to_hold(7, len).full == 0);
      pool->trim_window(7);
    }
  }
}

TEST_CASE("kv pool: reserve is all-or-nothing when the pool is exhausted", "[kv_pool]") {
  HostTestBackend be;
  SECTION("full pool") {
    auto pool = make_pool(be, make_cfg({false, false}, 16, 10, 0, 0));
    REQUIRE(pool->add_sequence(1).ok());
    REQUIRE(pool->add_sequence(2).ok());
    REQUIRE(pool->reserve(1, 100).ok());  // 7 pages
    const std::vector<int32_t> before = pool->page_table(2, PoolKind::full);
    REQUIRE(pool->pages_needed(2, 64).full == 4);
    const absl::Status st = pool->reserve(2, 64);
    CHECK(st.code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(std::string(st.message()), Catch::Matchers::ContainsSubstring("needs 4 full pages, 3 free"));
    CHECK(pool->reserved_len(2) == 0);
    CHECK(pool->page_table(2, PoolKind::full) == before);
    CHECK(pool->usage(PoolKind::full).used_pages == 7);
    REQUIRE(pool->reserve(2, 48).ok());  // exactly the 3 left
    CHECK(pool->usage(PoolKind::full).free_pages == 0);
    CHECK(pool->reserve(1, 112).ok());  // still within its last page
    CHECK(pool->reserve(1, 113).code() == absl::StatusCode::kResourceExhausted);
    CHECK(pool->reserved_len(1) == 112);
    REQUIRE(pool->release(1).ok());
    CHECK(pool->reserve(2, 160).ok());
    CHECK(pool->check_invariants().ok());
  }
  SECTION("SWA pool runs out first: the full pages are not taken either") {
    auto pool = make_pool(be, make_cfg({true, false}, 16, 100, 4, 32));
    REQUIRE(pool->add_sequence(1).ok());
    REQUIRE(pool->reserve(1, 48).ok());  // 3 full, 3 SWA pages
    const absl::Status st = pool->reserve(1, 80);
    CHECK(st.code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(std::string(st.message()), Catch::Matchers::ContainsSubstring("2 SWA pages, 1 free"));
    CHECK(pool->usage(PoolKind::full).used_pages == 3);
    CHECK(pool->usage(PoolKind::swa).used_pages == 3);
    CHECK(pool->page_table(1, PoolKind::full).size() == 3);
    CHECK(pool->reserved_len(1) == 48);
    // Trimming frees the out-of-window page (positions 0..15 < 48 - 32 + 1), and then it fits.
    pool->trim_window(1);
    CHECK(pool->usage(PoolKind::swa).used_pages == 2);
    const PagesNeeded need = pool->pages_needed(1, 80);
    CHECK(need.full == 2);
    CHECK(need.swa == 2);
    CHECK(pool->reserve(1, 80).ok());
    CHECK(pool->page_table(1, PoolKind::swa).front() == -1);
    CHECK(pool->check_invariants().ok());
  }
}

TEST_CASE("kv pool: slot mapping and full_to_swa table agree", "[kv_pool][swa]") {
  HostTestBackend be;
  const int32_t ps = 8;
  auto pool = make_pool(be, make_cfg({false, true}, ps, 64, 32, 12));
  const SwaSlotTable t = pool->swa_table();
  REQUIRE(t.size == 64 * ps);
  for (SeqId id : {10, 11, 12}) REQUIRE(pool->add_sequence(id).ok());
  // Interleaved growth, so sequences' pages are not contiguous.
  for (int round = 0; round < 6; ++round) {
    for (SeqId id : {10, 11, 12})
      REQUIRE(pool->reserve(id, pool->reserved_len(id) + int32_t(3 + id % 5 + round)).ok());
  }
  pool->trim_window(11);
  REQUIRE(pool->sync_swa_table().ok());
  std::set<int64_t> full_slots, swa_slots;
  const int64_t swa_slots_total = pool->layer_view(1).num_slots();
  for (SeqId id : {10, 11, 12}) {
    const auto& full = pool->page_table(id, PoolKind::full);
    const auto& swa = pool->page_table(id, PoolKind::swa);
    for (int32_t pos = 0; pos < pool->reserved_len(id); ++pos) {
      const int64_t s = pool->slot(id, pos);
      CHECK(s == int64_t(full[size_t(pos / ps)]) * ps + pos % ps);
      CHECK(full_slots.insert(s).second);  // no two tokens share a slot
      const int32_t sp = swa[size_t(pos / ps)];
      const int64_t want = sp >= 0 ? int64_t(sp) * ps + pos % ps : -1;
      CHECK(t.full_to_swa[s] == want);  // the device copy, synced
      CHECK(resolve_write_slot(s, t, swa_slots_total) == want);
      if (want >= 0) CHECK(swa_slots.insert(want).second);
    }
  }
  CHECK(resolve_write_slot(-1, t, swa_slots_total) == -1);  // padding is skipped before the lookup
  CHECK(resolve_write_slot(t.size, t, swa_slots_total) == -1);
  // A sync uploads only what changed: one new page is one page of entries.
  const int64_t copied = be.copied_to_device_bytes;
  REQUIRE(pool->sync_swa_table().ok());
  CHECK(be.copied_to_device_bytes == copied);
  const int32_t len = pool->reserved_len(10);
  REQUIRE(pool->reserve(10, int32_t(ceil_div(len, ps) * ps + 1)).ok());
  REQUIRE(pool->sync_swa_table().ok());
  CHECK(be.copied_to_device_bytes - copied == ps * int64_t(sizeof(int64_t)));
  // Releasing unmaps: the synced device table is all -1 again.
  for (SeqId id : {10, 11, 12}) REQUIRE(pool->release(id).ok());
  REQUIRE(pool->sync_swa_table().ok());
  CHECK(std::count(t.full_to_swa, t.full_to_swa + t.size, int64_t(-1)) == t.size);
}

TEST_CASE("kv pool: create allocates zeroed per-layer buffers, views and device scales", "[kv_pool]") {
  HostTestBackend be;
  KvPoolConfig c = make_cfg({false, true, false}, 16, 10, 4, 32);
  c.format = KvFormat::bf16;
  c.k_scale = {0.5f, 2.0f, 3.0f};
  c.v_scale = {0.25f, 4.0f, 5.0f};
  auto pool = make_pool(be, c);
  const int64_t page_bytes = 16 * 2 * 8 * 2;  // page_size * heads * head_dim * bf16
  CHECK(pool->page_bytes_per_layer() == 2 * page_bytes);
  for (int32_t l = 0; l < 3; ++l) {
    const PagedKvView v = pool->layer_view(l);
    CAPTURE(l);
    test::check_fresh_view(v, {l == 1 ? 4 : 10, 16, 2, 8, KvFormat::bf16}, page_bytes);
    CHECK(pool->layer_is_swa(l) == (l == 1));
    CHECK(*v.k_scale == c.k_scale[size_t(l)]);
    CHECK(*v.v_scale == c.v_scale[size_t(l)]);
  }
  CHECK(std::count(be.alloc_sizes.begin(), be.alloc_sizes.end(), size_t(10 * page_bytes)) == 4);
  CHECK(std::count(be.alloc_sizes.begin(), be.alloc_sizes.end(), size_t(4 * page_bytes)) == 2);
  CHECK(std::count(be.alloc_sizes.begin(), be.alloc_sizes.end(), size_t(10 * 16 * 8)) == 1);  // SWA table
  REQUIRE(pool->set_scales(1, 0.125f, 8.0f).ok());
  CHECK(*pool->layer_view(1).k_scale == 0.125f);
  CHECK(*pool->layer_view(1).v_scale == 8.0f);
  // The reciprocals beside them, as the CPU reference computes them (fp32 division).
  CHECK(*pool->layer_view(1).k_inv_scale == 8.0f);
  CHECK(*pool->layer_view(1).v_inv_scale == 0.125f);
  CHECK(*pool->layer_view(0).v_inv_scale == 1.0f / 0.25f);
  volatile float third = 3.0f;  // not folded: the division at run time, as the pool's
  REQUIRE(pool->set_scales(2, third, 0.3f).ok());
  CHECK(*pool->layer_view(2).k_inv_scale == 1.0f / third);
  CHECK(pool->config().k_scale[1] == 0.125f);
  CHECK(*pool->layer_view(0).v_scale == 0.25f);  // neighbours untouched
  CHECK(pool->set_scales(1, 0.0f, 1.0f).code() == absl::StatusCode::kInvalidArgument);
  CHECK(pool->set_scales(1, 1.0f, std::numeric_limits<float>::quiet_NaN()).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(pool->set_scales(3, 1.0f, 1.0f).code() == absl::StatusCode::kInvalidArgument);
  CHECK(*pool->layer_view(1).k_scale == 0.125f);

  // Without SWA layers there is no SWA pool and no table.
  auto plain = make_pool(be, make_cfg({false}, 16, 10, 0, 0));
  CHECK_FALSE(plain->has_swa());
  CHECK(plain->swa_table().full_to_swa == nullptr);
  CHECK(plain->usage(PoolKind::swa).total_pages == 0);
  CHECK(plain->sync_swa_table().ok());
}

TEST_CASE("kv pool: config errors", "[kv_pool]") {
  HostTestBackend be;
  const KvPoolConfig good = make_cfg({false, true}, 16, 10, 4, 32);
  REQUIRE(KvPool::create(be, good).ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<std::function<void(KvPoolConfig&)>, const char*>> cases = {
      {[](KvPoolConfig& c) { c.num_layers = 0; }, "num_layers"},
      {[](KvPoolConfig& c) { c.page_size = 0; }, "page_size"},
      {[](KvPoolConfig& c) { c.num_pages = -1; }, "num_pages"},
      {[](KvPoolConfig& c) { c.num_pages = int64_t(1) << 40; }, "num_pages"},
      {[](KvPoolConfig& c) { c.num_kv_heads = 0; }, "num_kv_heads"},
      {[](KvPoolConfig& c) { c.head_dim = -8; }, "head_dim"},
      {[](KvPoolConfig& c) { c.layer_is_swa.push_back(false); }, "layer_is_swa"},
      {[](KvPoolConfig& c) { c.k_scale.pop_back(); }, "k_scale"},
      {[](KvPoolConfig& c) { c.v_scale.push_back(1.0f); }, "v_scale"},
      {[=](KvPoolConfig& c) { c.k_scale[1] = nan; }, "k_scale[1]"},
      {[](KvPoolConfig& c) { c.v_scale[0] = 0.0f; }, "v_scale[0]"},
      {[](KvPoolConfig& c) { c.v_scale[0] = -1.0f; }, "v_scale[0]"},
      {[](KvPoolConfig& c) { c.k_scale[0] = std::numeric_limits<float>::infinity(); }, "k_scale[0]"},
      {[](KvPoolConfig& c) { c.window = 0; }, "window"},
      {[](KvPoolConfig& c) { c.swa_num_pages = 0; }, "swa_num_pages"},
      {[](KvPoolConfig& c) { c.head_dim = 1 << 30, c.num_kv_heads = 1 << 30; }, "out of range"},
      {[](KvPoolConfig& c) { c.num_pages = 2'000'000'000, c.head_dim = 1 << 20; }, "out of range"},
  };
  for (const auto& [mutate, what] : cases) {
    KvPoolConfig c = good;
    mutate(c);
    const auto pool = KvPool::create(be, c);
    CAPTURE(what, pool.status().ToString());
    CHECK(pool.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(pool.status().message()), Catch::Matchers::ContainsSubstring(what));
  }
  // Window and SWA pool size are irrelevant without SWA layers.
  KvPoolConfig no_swa = good;
  no_swa.layer_is_swa = {false, false};
  no_swa.window = 0;
  no_swa.swa_num_pages = 0;
  CHECK(KvPool::create(be, no_swa).ok());
  // A failed device allocation is returned, and what was allocated is given back.
  for (int64_t n = 0; n < 6; ++n) {
    be.fail_alloc_after = be.allocs_done + n;
    CHECK(KvPool::create(be, good).status().code() == absl::StatusCode::kResourceExhausted);
  }
  be.fail_alloc_after = -1;
  CHECK(be.live_allocs == 0);
}

TEST_CASE("kv pool: sequence ops on unknown or duplicate ids", "[kv_pool]") {
  HostTestBackend be;
  auto pool = make_pool(be, make_cfg({true}, 16, 10, 4, 8));
  REQUIRE(pool->add_sequence(5).ok());
  CHECK(pool->add_sequence(5).code() == absl::StatusCode::kAlreadyExists);
  CHECK(pool->release(6).code() == absl::StatusCode::kNotFound);
  CHECK(pool->reserve(6, 4).code() == absl::StatusCode::kNotFound);
  pool->trim_window(6);
  CHECK(pool->reserved_len(6) == 0);
  CHECK(pool->page_table(6, PoolKind::full).empty());
  CHECK(pool->pages_needed(6, 17).full == 2);  // an unknown id counts as empty (admission)
  CHECK(pool->pages_needed(6, 17).swa == 2);
  REQUIRE(pool->reserve(5, 20).ok());
  CHECK(pool->reserve(5, 3).ok());
  CHECK(pool->reserved_len(5) == 20);
  REQUIRE(pool->release(5).ok());
  CHECK(pool->release(5).code() == absl::StatusCode::kNotFound);
  CHECK(pool->num_sequences() == 0);
  CHECK(pool->check_invariants().ok());
}

TEST_CASE("kv pool: page allocator is all-or-nothing and aborts on double free or bad page", "[kv_pool]") {
  PageAllocator a(4);
  std::vector<int32_t> out = {99};
  CHECK_FALSE(a.allocate(5, out));
  CHECK(out == std::vector<int32_t>{99});  // untouched
  CHECK(a.allocate(3, out));
  CHECK(out == std::vector<int32_t>{99, 0, 1, 2});
  CHECK(a.num_used() == 3);
  a.free(1);
  CHECK_FALSE(a.is_used(1));
  std::vector<int32_t> again;
  CHECK(a.allocate(2, again));
  CHECK(a.num_free() == 0);
  CHECK(aborts([&] { a.free(-1); }));
  CHECK(aborts([&] { a.free(4); }));
  CHECK(aborts([&] {
    a.free(0);
    a.free(0);
  }));
  HostTestBackend be;
  auto pool = make_pool(be, make_cfg({false}, 16, 4, 0, 0));
  REQUIRE(pool->add_sequence(1).ok());
  REQUIRE(pool->reserve(1, 5).ok());
  CHECK(pool->slot(1, 4) == 4);
  CHECK(aborts([&] { (void)pool->slot(1, 5); }));  // past the reserved length
  CHECK(aborts([&] { (void)pool->slot(2, 0); }));
}
