// End-to-end checks of the engine on the tiny model: the A/B write paths, the two
// attention paths, SWA plumbing, chunked prefill, errors and page accounting.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

// Runs three sequences through a prefill and `steps` greedy decode steps in one batch.
std::vector<std::vector<int32_t>> run_batch(Engine& e, int steps) {
  const int32_t vocab = e.spec().vocab;
  const std::vector<int32_t> lens = {37, 5, 64};
  std::vector<std::vector<int32_t>> out(lens.size());
  std::vector<StepItem> items;
  for (size_t i = 0; i < lens.size(); ++i) {
    REQUIRE(e.add_sequence(SeqId(i), prompt_of(lens[i], int32_t(i), vocab), SamplingParams{}).ok());
    items.push_back({SeqId(i), lens[i], true});
  }
  for (int s = 0; s < steps; ++s) {
    auto r = e.step(items);
    REQUIRE(r.ok());
    for (size_t i = 0; i < items.size(); ++i) {
      REQUIRE((*r)[i].status.ok());
      out[i].push_back(*(*r)[i].token);
      items[i].num_tokens = 1;
    }
  }
  return out;
}

// Two engines of the tiny model that differ only in kv_write (path_a, path_b), for every
// KV dtype with and without SWA layers: the same tokens over 24 decode steps and
// byte-identical caches. Calls check(a, b) on each pair for the caller's own checks.
void check_write_paths_agree(const char* path_a, const char* path_b,
                             const std::function<void(Engine&, Engine&)>& check) {
  for (const char* dtype : {"bf16", "fp8_e4m3", "fp8_e5m2"}) {
    for (bool hybrid : {false, true}) {
      CAPTURE(dtype, hybrid, path_a, path_b);
      json common = {{"kv_cache_dtype", dtype}, {"k_scale", 0.75}, {"v_scale", 1.5}};
      if (hybrid) {
        common["sliding_window"] = 24;
        common["swa_layers"] = "alternate";
      }
      json a = common, b = common;
      a["kv_write"] = path_a;
      b["kv_write"] = path_b;
      auto ea = make_engine(a);
      auto eb = make_engine(b);
      const auto ta = run_batch(*ea, 24);
      const auto tb = run_batch(*eb, 24);
      CHECK(mismatch(ta, tb) == "");
      const auto ca = cache_bytes(*ea);
      const auto cb = cache_bytes(*eb);
      REQUIRE(ca.size() == cb.size());
      CHECK(std::count_if(ca.begin(), ca.end(), [](uint8_t x) { return x != 0; }) >
            1000);  // something was written
      CHECK(mismatch(ca, cb) == "");
      check(*ea, *eb);
    }
  }
}

}  // namespace

TEST_CASE("engine fused/unfused writes: byte-identical KV caches after 24 decode steps",
          "[engine][kv_write]") {
  check_write_paths_agree("fused", "unfused", [](Engine&, Engine&) {});
}

TEST_CASE("engine fused_rope write: the fused write's tokens and KV bytes, RoPE in the write's kernel",
          "[engine][kv_write]") {
  // On the CPU the path is rope_neox then kv_write_fused in one op with the same code
  // (kernels/cpu/ops/rope_rows.h): the queries, the cache and so every token are the same bits.
  check_write_paths_agree("fused", "fused_rope", [](Engine& ea, Engine& eb) {
    CHECK(eb.config().kv_write == KvWritePath::fused_rope);
    // Logits too, teacher-forced over the same continuation (prefill and decode rows).
    const auto prompt = prompt_of(70, 9, ea.spec().vocab);
    const auto tokens = greedy(ea, 7, prompt, 12);
    const auto la = teacher_forced_logits(ea, 8, prompt, tokens);
    const auto lb = teacher_forced_logits(eb, 8, prompt, tokens);
    CHECK(mismatch(la, lb) == "");
  });
}

TEST_CASE("engine unified/split attention: teacher-forced logits agree within 0.1", "[engine][attention]") {
  // Both paths compute attention in fp32 and round the output to bf16 once; their
  // summation orders differ, so an output element can land on the neighbouring bf16
  // value (relative 2^-8). Across 4 layers and a bf16 residual stream those flips reach
  // the logits: measured up to 0.06 on logits with a std of about 3 (2%). 0.1 bounds
  // that with margin while still catching a wrong mask, scale or merge (errors of order
  // the logits themselves). The greedy token must agree wherever the top-2 margin
  // exceeds twice the measured difference.
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    for (int window : {0, 19}) {
      CAPTURE(dtype, window);
      json common = {{"kv_cache_dtype", dtype}};
      if (window) {
        common["sliding_window"] = window;
        common["swa_layers"] = "all";
      }
      json a = common, b = common;
      a["attention"] = "unified";
      b["attention"] = "split";
      auto ea = make_engine(a);
      auto eb = make_engine(b);
      const auto prompt = prompt_of(300, 7, ea->spec().vocab);  // > one split partition
      const auto tokens = greedy(*ea, 1, prompt, 40);
      const auto la = teacher_forced_logits(*ea, 2, prompt, tokens);
      const auto lb = teacher_forced_logits(*eb, 2, prompt, tokens);
      REQUIRE(la.size() == lb.size());
      float worst = 0;
      for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, max_abs_diff(la[i], lb[i]));
      INFO("max |logit difference| unified vs split: " << worst);
      CHECK(worst < 0.1f);
      for (size_t i = 0; i < la.size(); ++i) {
        std::vector<float> sorted = la[i];
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
        if (sorted[0] - sorted[1] > 2 * worst)
          CHECK(argmax(la[i].data(), int32_t(la[i].size())) == argmax(lb[i].data(), int32_t(lb[i].size())));
      }
    }
  }
}

TEST_CASE("engine swa: a window longer than the sequence equals full attention bit for bit",
          "[engine][swa]") {
  // Same math, different pool: checks the SWA pool, the full_to_swa table and the
  // SWA block tables end to end.
  auto full = make_engine({{"swa_layers", "none"}});
  auto swa = make_engine({{"sliding_window", 4096}, {"swa_layers", "all"}});
  const auto prompt = prompt_of(50, 3, full->spec().vocab);
  const auto tokens = greedy(*full, 1, prompt, 20);
  CHECK(greedy(*swa, 1, prompt, 20) == tokens);
  const auto la = teacher_forced_logits(*full, 2, prompt, tokens);
  const auto lb = teacher_forced_logits(*swa, 2, prompt, tokens);
  CHECK(mismatch(la, lb) == "");
}

TEST_CASE("engine swa: hybrid model frees out-of-window pages while decoding 300 tokens", "[engine][swa]") {
  const int window = 32, ps = 16;
  auto e = make_engine({{"sliding_window", window}, {"swa_layers", "alternate"}, {"page_size", ps}});
  REQUIRE(e->pool().has_swa());
  const auto prompt = prompt_of(100, 1, e->spec().vocab);
  REQUIRE(e->add_sequence(9, prompt, SamplingParams{}).ok());
  int32_t n = int32_t(prompt.size());
  int64_t max_swa_used = 0;
  for (int i = 0; i < 300; ++i) {
    auto r = e->step({StepItem{9, n, true}});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    n = 1;
    max_swa_used = std::max(max_swa_used, e->pool().usage(PoolKind::swa).used_pages);
    REQUIRE(e->pool().check_invariants().ok());
  }
  // Window plus the prefill chunk, in pages, plus one partly filled page.
  CHECK(max_swa_used <= (window + 100) / ps + 2);
  CHECK(e->pool().usage(PoolKind::swa).used_pages <= window / ps + 2);
  CHECK(e->pool().usage(PoolKind::full).used_pages == (400 + ps - 1) / ps);
  REQUIRE(e->release(9).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  CHECK(e->pool().usage(PoolKind::swa).used_pages == 0);
}

TEST_CASE("engine chunked prefill: 7-token chunks give the same tokens as one prefill", "[engine][prefill]") {
  auto e = make_engine();
  const auto prompt = prompt_of(61, 5, e->spec().vocab);
  const auto ref = greedy(*e, 1, prompt, 16);
  REQUIRE(e->add_sequence(2, prompt, SamplingParams{}).ok());
  for (int32_t done = 0; done < 61;) {
    const int32_t n = std::min(7, 61 - done);
    auto r = e->step({StepItem{2, n, done + n == 61}});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    done += n;
    if (done == 61) CHECK(*(*r)[0].token == ref[0]);
  }
  std::vector<int32_t> got = {e->sequence(2)->tokens.back()};
  for (int i = 1; i < 16; ++i) {
    auto r = e->step({StepItem{2, 1, true}});
    REQUIRE(r.ok());
    got.push_back(*(*r)[0].token);
  }
  CHECK(got == ref);
}

TEST_CASE("engine errors: bad steps are rejected and leave every page free", "[engine][errors]") {
  auto e = make_engine({{"num_pages", 8}, {"page_size", 16}, {"max_batch_tokens", 128}});
  const int32_t vocab = e->spec().vocab;
  CHECK(e->add_sequence(1, {}, SamplingParams{}).code() == absl::StatusCode::kInvalidArgument);
  CHECK(e->add_sequence(1, {0, vocab}, SamplingParams{}).code() == absl::StatusCode::kInvalidArgument);
  CHECK(e->add_sequence(1, {0, -1}, SamplingParams{}).code() == absl::StatusCode::kInvalidArgument);
  SamplingParams bad;
  bad.top_p = 0.0f;
  CHECK(e->add_sequence(1, {1}, bad).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(e->add_sequence(1, prompt_of(100, 1, vocab), SamplingParams{}).ok());
  CHECK(e->add_sequence(1, {1}, SamplingParams{}).code() == absl::StatusCode::kAlreadyExists);
  CHECK(e->step({}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(e->step({StepItem{7, 1, true}}).status().code() == absl::StatusCode::kNotFound);
  CHECK(e->step({StepItem{1, 101, true}}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(e->step({StepItem{1, 50, true}}).status().code() ==
        absl::StatusCode::kInvalidArgument);  // samples early
  CHECK(e->step({StepItem{1, 100, true}, StepItem{1, 100, true}}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);  // rejected steps reserve nothing

  // Pool exhaustion fails one sequence and runs the other: 8 pages of 16 tokens.
  REQUIRE(e->add_sequence(2, prompt_of(100, 2, vocab), SamplingParams{}).ok());
  auto r = e->step({StepItem{1, 100, true}});
  REQUIRE(r.ok());
  REQUIRE((*r)[0].status.ok());
  auto r2 = e->step({StepItem{1, 1, true}, StepItem{2, 100, true}});
  REQUIRE(r2.ok());
  CHECK((*r2)[0].status.ok());
  CHECK((*r2)[0].token.has_value());
  CHECK((*r2)[1].status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_FALSE((*r2)[1].token.has_value());
  CHECK(e->sequence(2)->num_computed == 0);
  CHECK(e->release(3).code() == absl::StatusCode::kNotFound);
  REQUIRE(e->release(1).ok());
  REQUIRE(e->release(2).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  CHECK(e->pool().usage(PoolKind::full).free_pages == 8);
}

TEST_CASE("engine begin/end: a plan in two halves, and nothing else while a step is in flight",
          "[engine][errors]") {
  auto a = make_engine();
  auto b = make_engine();
  const int32_t vocab = a->spec().vocab;
  for (Engine* e : {a.get(), b.get()}) {
    REQUIRE(e->add_sequence(1, prompt_of(20, 1, vocab), SamplingParams{}).ok());
    REQUIRE(e->add_sequence(2, prompt_of(9, 2, vocab), SamplingParams{}).ok());
  }
  CHECK(a->end().status().code() == absl::StatusCode::kFailedPrecondition);
  std::vector<StepItem> items{StepItem{1, 20, true}, StepItem{2, 9, true}};
  for (int s = 0; s < 6; ++s) {
    INFO("step " << s);
    auto whole = a->step(items);
    REQUIRE(whole.ok());
    const StepPlan plan{items, b->forward_options()};
    // A plan's pages are the planner's to reserve: without them it is refused, and
    // nothing is in flight.
    CHECK(b->begin(plan).code() == absl::StatusCode::kFailedPrecondition);
    CHECK_FALSE(b->step_in_flight());
    for (const StepItem& it : items) REQUIRE(b->sequences().reserve(it.id, it.num_tokens).ok());
    REQUIRE(b->begin(plan).ok());
    REQUIRE(b->step_in_flight());
    // Everything that would change what the device is using is refused until end().
    CHECK(b->begin(plan).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(b->step(items).status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(b->release(1).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(b->append_tokens(1, {3}).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(b->add_sequence(9, {1, 2}, SamplingParams{}).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(b->assume_computed(2, 1).code() == absl::StatusCode::kFailedPrecondition);
    auto halves = b->end();
    REQUIRE(halves.ok());
    CHECK_FALSE(b->step_in_flight());
    REQUIRE(halves->results.size() == whole->size());
    for (size_t i = 0; i < whole->size(); ++i) {
      CHECK(halves->results[i].status.ok());
      CHECK(halves->results[i].token == (*whole)[i].token);
    }
    CHECK(halves->timings.num_seqs == 2);
    CHECK(b->sequence(1)->tokens == a->sequence(1)->tokens);
    items = {StepItem{1, 1, true}, StepItem{2, 1, true}};
  }
  // A rejected plan leaves nothing in flight.
  CHECK(b->begin(StepPlan{{StepItem{7, 1, true}}, b->forward_options()}).code() == absl::StatusCode::kNotFound);
  CHECK_FALSE(b->step_in_flight());
  CHECK(b->end().status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(b->release(1).ok());
  REQUIRE(b->release(2).ok());
  CHECK(b->pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("engine config: per-layer scales reach the pool, bad counts and oversized presets fail",
          "[engine][config]") {
  const std::vector<float> ks = {0.5f, 1.0f, 2.0f, 4.0f};
  auto e = make_engine({{"k_scale", ks}, {"v_scale", 3.0}});
  for (int32_t l = 0; l < 4; ++l) {
    float k = 0, v = 0;
    REQUIRE(e->backend().copy_to_host(&k, e->pool().layer_view(l).k_scale, 4).ok());
    REQUIRE(e->backend().copy_to_host(&v, e->pool().layer_view(l).v_scale, 4).ok());
    CHECK(k == ks[size_t(l)]);
    CHECK(v == 3.0f);
  }
  CHECK(greedy(*e, 1, prompt_of(10, 1, e->spec().vocab), 4).size() == 4);

  auto bad = config_from_json({{"model", "tiny"}, {"k_scale", {1.0, 2.0}}});
  REQUIRE(bad.ok());
  auto be = Engine::create(*bad);
  REQUIRE_FALSE(be.ok());
  CHECK(be.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(be.status().message()).find("k_scale") != std::string::npos);

  // 8B parameters in bf16 need 15 GiB: with less memory the engine must refuse with a
  // message rather than fail an allocation. Checked against stated amounts of free memory,
  // so the test means the same on every machine.
  auto big = model_preset("llama3-8b");
  REQUIRE(big.ok());
  const absl::Status refused = check_cpu_weight_memory(*big, 12.0);
  CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(refused.message()).find("15.0 GiB") != std::string::npos);
  CHECK(check_cpu_weight_memory(*big, 64.0).ok());
  CHECK(check_cpu_weight_memory(*big, -1.0).ok());  // unknown
}

TEST_CASE("engine assume_computed: a synthetic context holds a window plus a chunk in the SWA pool",
          "[engine][swa][bench]") {
  auto e = make_engine({{"sliding_window", 32},
                        {"swa_layers", "alternate"},
                        {"max_batch_tokens", 64},
                        {"num_pages", 128},
                        {"swa_num_pages", 8},
                        {"max_seq_len", 2048}});
  const auto prompt = prompt_of(1500, 2, e->spec().vocab);
  REQUIRE(e->add_sequence(1, prompt, SamplingParams{}).ok());
  CHECK(e->assume_computed(1, 1500).code() == absl::StatusCode::kInvalidArgument);  // the last token must run
  REQUIRE(e->assume_computed(1, 1499).ok());
  CHECK(e->sequence(1)->num_computed == 1499);
  CHECK(e->pool().usage(PoolKind::swa).used_pages <= 32 / 16 + 2);
  auto r = e->step({StepItem{1, 1, true}});
  REQUIRE(r.ok());
  CHECK((*r)[0].status.ok());
  REQUIRE(e->pool().check_invariants().ok());
}

TEST_CASE("engine graph padding: decode padded to its bucket gives the unpadded tokens and logits",
          "[engine][graphs]") {
  // The CPU has no graphs, but the padding a replay uses runs here eagerly
  // (graph_replay off): sequences padded to the batch bucket (3 -> 4, 5 -> 8) with slot
  // -1 and no query rows, keys to the context bucket (contexts cross 512 -> 1024), block
  // tables re-strided. Padding rows must change nothing: no KV written, no sequence's
  // attention touched. The CPU backend is batch-invariant (kernels/cpu/gemm/gemm.h), so
  // tokens and logits must be identical bit for bit.
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    for (const char* attention : {"unified", "split"}) {
      for (int window : {0, 40}) {
        CAPTURE(dtype, attention, window);
        json cfg = {{"kv_cache_dtype", dtype}, {"attention", attention}, {"max_batch_tokens", 512}};
        if (window) {
          cfg["sliding_window"] = window;
          cfg["swa_layers"] = "alternate";
        }
        auto e = make_engine(cfg);
        ForwardOptions eager;
        eager.graphs = false;
        eager.attention = std::string(attention) == "split" ? AttentionPath::split : AttentionPath::unified;
        ForwardOptions padded = eager;
        padded.graphs = true;
        padded.graph_replay = false;
        const auto a = run_bucket_schedule(*e, eager, 500, 8, 1000);
        const int64_t before = e->graph_stats().padded_eager;
        const auto b = run_bucket_schedule(*e, padded, 500, 8, 2000);
        CHECK(e->graph_stats().padded_eager - before == 24);
        CHECK(b.graph_steps == 0);
        CHECK(a.tokens == b.tokens);
        REQUIRE(a.logits.size() == b.logits.size());
        INFO("max |logit difference| padded vs unpadded: " << max_abs_diff(a.logits, b.logits));
        CHECK(std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)) == 0);
        CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
      }
    }
  }
}

TEST_CASE("engine sampling: seeded tokens are the reference sampler's on the step's logits",
          "[engine][sampling]") {
  // The engine draws one uniform per sampled token from the sequence's stream and the
  // backend samples on its side (the CPU backend: the reference itself); the same draws
  // through sample_token on the returned logits must give the same tokens. Also: the
  // same seed twice gives the same tokens, another seed other tokens.
  auto e = make_engine();
  for (const SamplingParams& sp : {SamplingParams::sampled(0.8f, 0, 1.0f, 3), SamplingParams::sampled(1.2f, 20, 0.9f, 4),
                                   SamplingParams::sampled(0.5f, 0, 0.5f, 5)}) {
    CAPTURE(sp.temperature, sp.top_k, sp.top_p);
    const auto [equal, n] = sampled_tokens_match_reference(*e, sp, 24);
    CHECK(equal == n);
  }
  const SamplingParams sp = SamplingParams::sampled(1.0f, 0, 0.95f, 9);
  auto gen = [&](SeqId id, uint64_t seed) {
    SamplingParams s = sp;
    s.seed = seed;
    REQUIRE(e->add_sequence(id, prompt_of(30, 1, e->spec().vocab), s).ok());
    std::vector<int32_t> out;
    int32_t pending = 30;
    for (int i = 0; i < 16; ++i) {
      auto r = e->step({StepItem{id, pending, true}});
      REQUIRE(r.ok());
      out.push_back(*(*r)[0].token);
      pending = 1;
    }
    REQUIRE(e->release(id).ok());
    return out;
  };
  CHECK(gen(1, 9) == gen(2, 9));
  CHECK(gen(3, 9) != gen(4, 10));
}

TEST_CASE("engine graphs: warming the decode buckets is a no-op without graphs", "[engine][graphs]") {
  auto e = make_engine();
  auto warmed = e->warm_up_decode_graphs();
  REQUIRE(warmed.ok());
  CHECK(*warmed == 0);  // the CPU backend has no graphs
  CHECK(e->num_sequences() == 0);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("engine load progress: 0 as loading begins, then each layer in order, at tp 1 and tp 2",
          "[engine][progress]") {
  for (int tp : {1, 2}) {
    INFO("tensor_parallel " << tp);
    auto cfg = config_from_json({{"model", "tiny"}, {"tensor_parallel", tp}});
    REQUIRE(cfg.ok());
    std::vector<LoadProgress> seen;
    auto e = Engine::create(*cfg, [&](const LoadProgress& p) { seen.push_back(p); });
    REQUIRE(e.ok());
    const int32_t layers = (*e)->spec().num_layers;
    REQUIRE(seen.size() == size_t(layers) + 1);
    for (size_t i = 0; i < seen.size(); ++i) {
      CHECK(seen[i].layers_done == int32_t(i));
      CHECK(seen[i].layers == layers);
      CHECK(seen[i].elapsed_s >= (i == 0 ? 0.0 : seen[i - 1].elapsed_s));
    }
  }
}

TEST_CASE("engine load progress: load_progress_every passes on the first, the last and one per interval",
          "[engine][progress]") {
  std::vector<int32_t> passed;
  auto sink = [&](const LoadProgress& p) { passed.push_back(p.layers_done); };
  auto feed = [&](const LoadProgressFn& f, const std::vector<double>& at) {
    passed.clear();
    for (size_t i = 0; i < at.size(); ++i) f(LoadProgress{int32_t(i), int32_t(at.size()) - 1, at[i]});
    return passed;
  };
  using V = std::vector<int32_t>;
  // Layers at 0, 4, 9, 10, 21, 25 s: reports at most every 10 s after the last one.
  const std::vector<double> at = {0, 4, 9, 10, 21, 25};
  CHECK(feed(load_progress_every(10, sink), at) == V{0, 3, 4, 5});
  CHECK(feed(load_progress_every(0, sink), at) == V{0, 1, 2, 3, 4, 5});
  CHECK(feed(load_progress_every(1e9, sink), at) == V{0, 5});
  CHECK_FALSE(load_progress_every(10, nullptr));
}
