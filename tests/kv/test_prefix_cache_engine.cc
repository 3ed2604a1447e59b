// The prefix cache through the engine: a new sequence takes the cached pages its prompt
// begins with, whether the sequence that computed them lives on, has finished or was
// preempted. The CPU backend is batch- and chunk-invariant, so a sequence that takes cached
// pages gives the logits of one that computes everything, bit for bit.
#include <cstring>
#include "tests/util/catch.h"

#include "src/runtime/scheduler.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using json = nlohmann::json;

namespace {

// Greedy tokens and every step's logits of `n` steps, the prompt in one step.
std::pair<std::vector<int32_t>, std::vector<float>> run_logits(Engine& e, SeqId id, const std::vector<int32_t>& prompt,
                                                               int n) {
  REQUIRE(e.add_sequence(id, prompt, SamplingParams{}, nullptr, /*reuse_prefix=*/true).ok());
  std::vector<int32_t> toks;
  std::vector<float> logits;
  int32_t pending = e.sequence(id)->num_pending();
  for (int i = 0; i < n; ++i) {
    StepItem it{id, pending, true, true};
    auto r = e.step({it});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    toks.push_back(*(*r)[0].token);
    const float* row = e.last_logits().data() + size_t((*r)[0].logits_row) * size_t(e.spec().vocab);
    logits.insert(logits.end(), row, row + e.spec().vocab);
    pending = 1;
  }
  return {toks, logits};
}

}  // namespace

TEST_CASE("prefix cache: a sequence sharing a live prefix gives the recomputed logits bit for bit",
          "[engine][prefix]") {
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    CAPTURE(dtype);
    auto ref = make_engine({{"kv_cache_dtype", dtype}, {"prefix_cache", "off"}});
    auto e = make_engine({{"kv_cache_dtype", dtype}});
    const int32_t vocab = e->spec().vocab;
    const std::vector<int32_t> a = prompt_of(50, 3, vocab);
    std::vector<int32_t> b(a.begin(), a.begin() + 40);
    const std::vector<int32_t> tail = prompt_of(10, 8, vocab);
    b.insert(b.end(), tail.begin(), tail.end());

    run_logits(*e, 1, a, 4);  // the donor: 50 prompt tokens computed, 3 decoded
    const int64_t donor_pages = e->pool().usage(PoolKind::full).used_pages;
    const auto [bt, bl] = run_logits(*e, 2, b, 6);
    CHECK(e->sequence(2)->num_cached == 32);  // 40 common tokens: two whole pages of 16
    const auto [rt, rl] = run_logits(*ref, 2, b, 6);
    CHECK(bt == rt);
    REQUIRE(bl.size() == rl.size());
    CHECK(std::memcmp(bl.data(), rl.data(), bl.size() * sizeof(float)) == 0);
    // 56 tokens in 4 pages, 2 of them the donor's.
    CHECK(e->pool().usage(PoolKind::full).used_pages == donor_pages + 2);
    CHECK(e->pool().usage(PoolKind::full).shared_pages == 2);
    REQUIRE(e->pool().check_invariants().ok());

    // The donor leaves; the sharer decodes on, as the reference does.
    REQUIRE(e->release(1).ok());
    REQUIRE(e->pool().check_invariants().ok());
    for (int i = 0; i < 4; ++i) {
      auto x = e->step({StepItem{2, 1, true}});
      auto y = ref->step({StepItem{2, 1, true}});
      REQUIRE(x.ok());
      REQUIRE(y.ok());
      CHECK((*x)[0].token == (*y)[0].token);
    }
    // The same prompt again: all but the page holding its last token.
    const auto whole = e->sequence(2)->tokens;
    REQUIRE(e->add_sequence(3, std::vector<int32_t>(whole.begin(), whole.begin() + 48), SamplingParams{}, nullptr,
                            true)
                .ok());
    CHECK(e->sequence(3)->num_cached == 32);  // 47 at most, 32 page-aligned
    REQUIRE(e->add_sequence(4, whole, SamplingParams{}, nullptr, /*reuse_prefix=*/false).ok());
    CHECK(e->sequence(4)->num_cached == 0);
    for (SeqId id : {2, 3, 4}) REQUIRE(e->release(id).ok());
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
    CHECK(e->pool().usage(PoolKind::full).shared_pages == 0);
    REQUIRE(e->pool().check_invariants().ok());
  }
}

TEST_CASE("prefix cache: a finished or preempted sequence's pages serve the next one, bit for bit",
          "[engine][prefix]") {
  auto ref = make_engine({{"prefix_cache", "off"}});
  auto e = make_engine();
  const int32_t vocab = e->spec().vocab;
  const std::vector<int32_t> p = prompt_of(45, 5, vocab);
  run_logits(*e, 1, p, 3);
  REQUIRE(e->release(1).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  CHECK(e->pool().cache_stats().cached_pages == 2);  // 47 computed tokens: 2 whole pages
  const auto [t, l] = run_logits(*e, 2, p, 5);
  CHECK(e->sequence(2)->num_cached == 32);
  const auto [rt, rl] = run_logits(*ref, 2, p, 5);
  CHECK(t == rt);
  REQUIRE(l.size() == rl.size());
  CHECK(std::memcmp(l.data(), rl.data(), l.size() * sizeof(float)) == 0);
  // Preempted: its pages go back to the pool, cached; readmitted, it computes only the rest.
  const int32_t computed = e->sequence(2)->num_computed;
  e->sequences().evict(2);
  REQUIRE(e->pool().check_invariants().ok());
  REQUIRE(e->sequences().admit(2, true).ok());
  CHECK(e->sequence(2)->num_cached == computed / 16 * 16);
  for (int i = 0; i < 3; ++i) {
    auto x = e->step({StepItem{2, e->sequence(2)->num_pending(), true}});
    auto y = ref->step({StepItem{2, 1, true}});
    REQUIRE(x.ok());
    REQUIRE(y.ok());
    CHECK((*x)[0].token == (*y)[0].token);
  }
  REQUIRE(e->release(2).ok());
  REQUIRE(e->pool().check_invariants().ok());
}

TEST_CASE("prefix cache: a pool full of cached pages still serves new prompts, evicting", "[engine][prefix]") {
  auto e = make_engine({{"num_pages", 12}});
  const int32_t vocab = e->spec().vocab;
  for (uint32_t i = 0; i < 8; ++i) {  // 8 prompts of 4 pages each through a pool of 12
    CAPTURE(i);
    run_logits(*e, 10 + i, prompt_of(60, 100 + i, vocab), 2);
    REQUIRE(e->release(10 + i).ok());
    REQUIRE(e->pool().check_invariants().ok());
  }
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  CHECK(e->pool().cache_stats().cached_pages <= 12);
  CHECK(e->pool().cache_stats().cached_pages > 0);
}

TEST_CASE("prefix cache: on by default, and off, with SWA layers or for prompt logprobs it takes nothing",
          "[engine][prefix]") {
  const std::vector<int32_t> p = prompt_of(40, 1, 1024);
  for (const json& cfg : {json{{"prefix_cache", "off"}}, json{{"prefix_reuse", "off"}},
                          json{{"sliding_window", 16}, {"swa_layers", "alternate"}}}) {
    CAPTURE(cfg.dump());
    auto e = make_engine(cfg);
    run_logits(*e, 1, p, 2);
    REQUIRE(e->add_sequence(2, p, SamplingParams{}, nullptr, true).ok());
    CHECK(e->sequence(2)->num_cached == 0);
    CHECK(e->pool().usage(PoolKind::full).shared_pages == 0);
  }
  // Generate with prompt logprobs computes its prompt; without them it takes the cache's pages.
  auto e = make_engine();
  run_logits(*e, 1, p, 2);
  Scheduler s(*e);
  for (bool prompt_lp : {true, false}) {
    GenerateRequest r;
    r.id = prompt_lp ? 10 : 11;
    r.prompt = p;
    r.max_new_tokens = 2;
    r.logprobs.prompt = prompt_lp;
    REQUIRE(s.submit(r).ok());
    int32_t cached = -1;
    size_t prompt_entries = 0;
    while (s.has_work()) {
      auto ev = s.step();
      REQUIRE(ev.ok());
      for (const auto& x : *ev) {
        if (x.token && cached < 0) {
          cached = x.cached_tokens;
          prompt_entries = x.prompt_logprobs.size();
        }
      }
    }
    CHECK(cached == (prompt_lp ? 0 : 32));
    CHECK(prompt_entries == (prompt_lp ? 39u : 0u));
  }
  REQUIRE(e->release(1).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}
