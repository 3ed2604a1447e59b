// Prefix reuse: a new sequence shares the full pages of a live sequence's computed
// prompt prefix. The CPU backend is batch-invariant, so a sequence that shares gives the
// logits of one that computes everything, bit for bit.
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
  REQUIRE(e.add_sequence(id, prompt, SamplingParams{}).ok());
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

TEST_CASE("prefix reuse: a sequence sharing a live prefix gives the recomputed logits bit for bit",
          "[engine][prefix]") {
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    CAPTURE(dtype);
    auto ref = make_engine({{"kv_cache_dtype", dtype}});
    auto e = make_engine({{"kv_cache_dtype", dtype}, {"prefix_reuse", "on"}});
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
    REQUIRE(e->add_sequence(3, std::vector<int32_t>(whole.begin(), whole.begin() + 48), SamplingParams{}).ok());
    CHECK(e->sequence(3)->num_cached == 32);  // 47 at most, 32 page-aligned
    REQUIRE(e->add_sequence(4, whole, SamplingParams{}, nullptr, /*reuse_prefix=*/false).ok());
    CHECK(e->sequence(4)->num_cached == 0);
    for (SeqId id : {2, 3, 4}) REQUIRE(e->release(id).ok());
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
    CHECK(e->pool().usage(PoolKind::full).shared_pages == 0);
    REQUIRE(e->pool().check_invariants().ok());
  }
}

TEST_CASE("prefix reuse: off by default, never with SWA layers or prompt logprobs", "[engine][prefix]") {
  const std::vector<int32_t> p = prompt_of(40, 1, 1024);
  for (const json& cfg : {json{{"kv_cache_dtype", "bf16"}},
                          json{{"prefix_reuse", "on"}, {"sliding_window", 16}, {"swa_layers", "alternate"}}}) {
    auto e = make_engine(cfg);
    run_logits(*e, 1, p, 2);
    REQUIRE(e->add_sequence(2, p, SamplingParams{}).ok());
    CHECK(e->sequence(2)->num_cached == 0);
    CHECK(e->pool().usage(PoolKind::full).shared_pages == 0);
  }
  // Generate with prompt logprobs computes its prompt; without them it shares.
  auto e = make_engine({{"prefix_reuse", "on"}});
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
