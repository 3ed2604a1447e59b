// The sharded engine on the CPU backend: tensor_parallel 2 and 4 against 1 on the tiny
// model and on a hybrid of window and full layers. Ranks are threads of one process with a
// CPU communicator (src/parallel/cpu_communicator.h), so every commit tests the sharding.
//
// What is equal and what is close. Column-parallel projections compute each output from
// the whole input, as tp 1 does, and the CPU GEMM computes every output element the same
// way whatever the matrix width: so layer 0's K and V, which come from the same embedding
// through the same norm, are stored in exactly the bytes of tp 1's matching heads. From
// the first row-parallel projection (O) on, each rank rounds its partial sum to bf16 and
// the all-reduce sums those, where tp 1 rounds one sum once: activations differ in the last
// bf16 bits and logits by a little. The logits bound, 0.25, is the one the GPU engine
// meets against the CPU engine (tests/gpu/test_gpu_engine.cc) for the same kind of difference:
// the same math, summed in another order. Greedy tokens are compared where the tp 1 logits
// of the position leave a margin above twice the bound between the best and the second
// token; a closer call may go either way in any other summation order too.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "tests/util/catch.h"

#include <atomic>
#include <chrono>

#include "kernels/common/bf16.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/loading/calibration.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/forwarding_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr float kLogitBound = 0.25f;
// FP8 weights with activations quantized per token: a row-parallel rank (O, down)
// quantizes its own slice of the row with its own scale, where tp 1 takes one scale over
// the whole row (vLLM's ranks do the same), so the activations feeding those projections
// differ by FP8 rounding, not only by bf16 summation order. Measured on tiny-fp8 at tp 2
// and 4: at most 0.58 (2026-12-05).
constexpr float kLogitBoundFp8Weights = 0.75f;

nlohmann::json hybrid_keys() { return {{"sliding_window", 24}, {"swa_layers", "alternate"}}; }

nlohmann::json with(nlohmann::json j, const nlohmann::json& more) {
  for (const auto& [k, v] : more.items()) j[k] = v;
  return j;
}

// Two runs of run_model: the same greedy tokens and the same logits, bit for bit.
void check_same_bits(const Run& ra, const Run& rb) {
  CHECK(ra.greedy == rb.greedy);
  REQUIRE(ra.logits.size() == rb.logits.size());
  for (size_t i = 0; i < ra.logits.size(); ++i) {
    CHECK(std::memcmp(ra.logits[i].data(), rb.logits[i].data(), ra.logits[i].size() * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("tensor parallel (cpu): a rank that fails mid-step aborts the group - nobody waits forever",
          "[tp][engine][errors]") {
  nlohmann::json j = {{"model", "tiny"}, {"device", "cpu"}, {"num_pages", 64}, {"tensor_parallel", 2},
                      {"tp_rendezvous_timeout_s", 600}};
  auto cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  auto owned = std::make_unique<FailingAttentionBackend>();
  FailingAttentionBackend* rank0 = owned.get();
  auto e = Engine::create(*cfg, std::move(owned));
  REQUIRE(e.ok());
  Engine& eng = **e;
  REQUIRE(eng.add_sequence(1, prompt_of(20, 1, 1024), SamplingParams{}).ok());
  REQUIRE(eng.step({StepItem{1, 20, true}}).ok());
  // Rank 0 fails in layer 0's attention, after the ranks passed no collective yet this
  // step; rank 1 reaches the O projection's all-reduce and must not wait there for ever
  // (the group's timeout here is ten minutes: the abort is what ends the wait).
  rank0->fail = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto failed = eng.step({StepItem{1, 1, true}});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 60);
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.status().code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(failed.status().message()), ContainsSubstring("injected device failure"));
  // The group is gone: later steps say so instead of running a rank alone.
  rank0->fail = false;
  auto later = eng.step({StepItem{1, 1, true}});
  REQUIRE_FALSE(later.ok());
  CHECK_THAT(std::string(later.status().message()), ContainsSubstring("aborted"));
  // Pages are still accounted for and freed.
  REQUIRE(eng.release(1).ok());
  CHECK(eng.pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("tensor parallel (cpu): tp 2 and 4 against tp 1, tiny and hybrid, fp8 and bf16 KV, bf16 and FP8 weights",
          "[tp][engine]") {
  for (const int model : {0, 1, 2}) {  // tiny, tiny with alternating window layers, tiny-fp8
    const bool hybrid = model == 1;
    for (const char* dtype : {"fp8_e4m3", "bf16"}) {
      nlohmann::json base = {{"kv_cache_dtype", dtype}};
      if (hybrid) base = with(base, hybrid_keys());
      if (model == 2) base["model"] = "tiny-fp8";
      auto ref_engine = make_engine(base);
      const Run ref = run_model(*ref_engine);
      for (const int tp : {2, 4}) {
        DYNAMIC_SECTION((model == 0 ? "tiny " : model == 1 ? "hybrid " : "tiny-fp8 ") << dtype << " tp " << tp) {
          auto e = make_engine(with(base, {{"tensor_parallel", tp}}));
          REQUIRE(e->num_ranks() == tp);
          const Run got = run_model(*e);
          REQUIRE(got.logits.size() == ref.logits.size());
          float worst = 0;
          int compared = 0;
          const float bound = model == 2 ? kLogitBoundFp8Weights : kLogitBound;
          for (size_t i = 0; i < ref.logits.size(); ++i) worst = std::max(worst, max_abs_diff(ref.logits[i], got.logits[i]));
          // Where the best token leads by more than twice the largest logit difference, no
          // summation order can change the choice.
          for (size_t i = 0; i < ref.logits.size(); ++i) {
            if (top_margin(ref.logits[i]) > 2 * std::max(worst, kLogitBound)) {
              ++compared;
              CHECK(top_token(got.logits[i]) == top_token(ref.logits[i]));
            }
          }
          INFO("max |dlogit| " << worst << " over " << ref.logits.size() << " positions; " << compared
                               << " with a clear greedy choice");
          CHECK(worst < bound);
          // Not vacuous: most positions (a quarter with FP8 weights, whose wider differences
          // leave fewer clear choices: 10 to 15 of 30 measured).
          CHECK(compared >= int(ref.logits.size()) / (model == 2 ? 4 : 2));  // the comparison is not vacuous
          // Nothing held after the sequences are released.
          CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
          REQUIRE(e->pool().check_invariants().ok());
        }
      }
    }
  }
}

TEST_CASE("tensor parallel (cpu): a run is bit for bit reproducible (rank-ordered all-reduce)", "[tp][engine]") {
  const nlohmann::json keys = with(hybrid_keys(), {{"tensor_parallel", 2}});
  auto a = make_engine(keys);
  auto b = make_engine(keys);
  const Run ra = run_model(*a);
  const Run rb = run_model(*b);
  check_same_bits(ra, rb);
}

TEST_CASE("tensor parallel (cpu): tp_allreduce push (GPU peer memory only) all-reduces here, the same bits",
          "[tp][engine]") {
  // The CPU ranks' communicator offers no pushed calls, so the model all-reduces after every
  // row-parallel projection as with auto; the CPU backend's linear_push is never reached.
  const nlohmann::json keys = with(hybrid_keys(), {{"tensor_parallel", 2}});
  auto a = make_engine(keys);
  auto b = make_engine(with(keys, {{"tp_allreduce", "push"}}));
  CHECK(b->config().tp_allreduce == TpAllReduce::push);
  const Run ra = run_model(*a);
  const Run rb = run_model(*b);
  check_same_bits(ra, rb);
  // And the backend says so if asked.
  const auto cpu = make_cpu_backend();
  LinearWeight w;
  bf16_t x[8] = {}, out[8] = {};
  const absl::Status st = cpu->linear_push(x, 1, w, out, PushTargets{});
  CHECK(st.code() == absl::StatusCode::kUnimplemented);
}

TEST_CASE("tensor parallel (cpu): fused_rope writes equal fused writes bit for bit on every rank",
          "[tp][engine][kv_write]") {
  // Each rank rotates its own query and KV heads inside its write (Backend::kv_write_rope):
  // the same bits as its rope followed by the fused write, so nothing may move.
  const nlohmann::json keys =
      with(hybrid_keys(), {{"tensor_parallel", 2}, {"k_scale", 0.75}, {"v_scale", 1.5}});
  auto a = make_engine(with(keys, {{"kv_write", "fused"}}));
  auto b = make_engine(with(keys, {{"kv_write", "fused_rope"}}));
  const Run ra = run_model(*a);
  const Run rb = run_model(*b);
  check_same_bits(ra, rb);
  // The pages of the released sequences still hold what they were written.
  for (int32_t rank = 0; rank < 2; ++rank) {
    for (int32_t l = 0; l < a->spec().num_layers; ++l) {
      CAPTURE(rank, l);
      CHECK((storage_bytes(*a, l, rank, false) == storage_bytes(*b, l, rank, false)));
      CHECK((storage_bytes(*a, l, rank, true) == storage_bytes(*b, l, rank, true)));
    }
  }
}

TEST_CASE("tensor parallel (cpu): each rank's layer-0 pages hold exactly tp 1's bytes of its KV heads",
          "[tp][engine][kv]") {
  for (const int tp : {2, 4}) {
    DYNAMIC_SECTION("tp " << tp) {
      auto one = make_engine({{"kv_cache_dtype", "fp8_e4m3"}});
      auto many = make_engine({{"kv_cache_dtype", "fp8_e4m3"}, {"tensor_parallel", tp}});
      // The same sequences on both: the same pages (one allocator), the same slots.
      for (Engine* e : {one.get(), many.get()}) {
        const int32_t vocab = e->spec().vocab;
        REQUIRE(e->add_sequence(7, prompt_of(45, 2, vocab), SamplingParams{}).ok());
        REQUIRE(e->add_sequence(8, prompt_of(20, 9, vocab), SamplingParams{}).ok());
        auto r = e->step({StepItem{7, 45, true}, StepItem{8, 20, true}});
        REQUIRE(r.ok());
        for (int i = 0; i < 3; ++i) REQUIRE(e->step({StepItem{7, 1, true}, StepItem{8, 1, true}}).ok());
      }
      const ModelSpec& s = one->spec();
      const int32_t kv_heads = s.num_kv_heads;
      const int32_t per_rank = std::max(1, kv_heads / tp);
      const int32_t replicas = tp / (kv_heads / per_rank);
      const size_t head_bytes = size_t(s.head_dim);  // fp8: one byte per element
      for (const bool v_side : {false, true}) {
        const std::vector<uint8_t> whole = storage_bytes(*one, 0, 0, v_side);
        const size_t slots = whole.size() / (size_t(kv_heads) * head_bytes);
        for (int32_t r = 0; r < tp; ++r) {
          const std::vector<uint8_t> mine = storage_bytes(*many, 0, r, v_side);
          REQUIRE(mine.size() == slots * size_t(per_rank) * head_bytes);
          const int32_t first_head = r / replicas * per_rank;
          size_t mismatched = 0;
          for (size_t slot = 0; slot < slots; ++slot) {
            const uint8_t* want = whole.data() + (slot * size_t(kv_heads) + size_t(first_head)) * head_bytes;
            const uint8_t* got = mine.data() + slot * size_t(per_rank) * head_bytes;
            mismatched += std::memcmp(want, got, size_t(per_rank) * head_bytes) != 0;
          }
          INFO((v_side ? "V" : "K") << " rank " << r << ": " << mismatched << " of " << slots << " slots differ");
          CHECK(mismatched == 0);
        }
      }
      // The written slots are not all zero: the comparison saw data.
      const std::vector<uint8_t> k0 = storage_bytes(*many, 0, 0, false);
      CHECK(std::count(k0.begin(), k0.end(), uint8_t{0}) < std::ptrdiff_t(k0.size()));
    }
  }
}

TEST_CASE("tensor parallel (cpu): pages are shared by all ranks and nothing leaks", "[tp][engine][pool]") {
  // A pool of 8 pages of 16 tokens: a 100-token prompt does not fit, and fails alone.
  auto e = make_engine({{"tensor_parallel", 2}, {"num_pages", 8}, {"page_size", 16}, {"max_seq_len", 256}});
  const int32_t vocab = e->spec().vocab;
  REQUIRE(e->add_sequence(1, prompt_of(30, 1, vocab), SamplingParams{}).ok());
  REQUIRE(e->add_sequence(2, prompt_of(200, 2, vocab), SamplingParams{}).ok());
  auto r = e->step({StepItem{1, 30, true}, StepItem{2, 200, true}});
  REQUIRE(r.ok());
  CHECK((*r)[0].status.ok());
  CHECK((*r)[1].status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 2);
  // Bad input is refused before any rank runs, and the group goes on serving.
  CHECK(e->step({StepItem{1, 5, true}}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(e->append_tokens(1, {vocab}).code() == absl::StatusCode::kInvalidArgument);
  auto next = e->step({StepItem{1, 1, true}});
  REQUIRE(next.ok());
  CHECK((*next)[0].status.ok());
  REQUIRE(e->release(1).ok());
  REQUIRE(e->release(2).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  REQUIRE(e->pool().check_invariants().ok());
}

TEST_CASE("tensor parallel (cpu): calibration reads every rank's heads", "[tp][calibration]") {
  auto one = make_engine({{"kv_cache_dtype", "bf16"}});
  auto two = make_engine({{"kv_cache_dtype", "bf16"}, {"tensor_parallel", 2}});
  const std::vector<std::vector<int32_t>> prompts = {prompt_of(60, 1, 1024), prompt_of(35, 2, 1024)};
  auto a1 = measure_kv_amax(*one, prompts);
  auto a2 = measure_kv_amax(*two, prompts);
  REQUIRE(a1.ok());
  REQUIRE(a2.ok());
  // Layer 0's K/V are the same bytes (see above), so the same maxima, whichever rank holds
  // the head they come from; deeper layers within the all-reduce's rounding.
  CHECK(a2->k[0] == a1->k[0]);
  CHECK(a2->v[0] == a1->v[0]);
  for (size_t l = 1; l < a1->k.size(); ++l) {
    CHECK(std::fabs(a2->k[l] - a1->k[l]) <= 0.02f * a1->k[l]);
    CHECK(std::fabs(a2->v[l] - a1->v[l]) <= 0.02f * a1->v[l]);
  }
}

TEST_CASE("tensor parallel (cpu): logprobs, prompt logprobs in chunks, and the prefix cache", "[tp][engine][logprobs]") {
  // Prompt logprobs go through the lm_head in chunks of max_running_seqs rows, each chunk
  // gathered across ranks; a second sequence takes the first one's cached prefix pages. Bound:
  // the logits' 0.25, doubled for the log-sum-exp (as the GPU engine's test states it).
  const nlohmann::json keys = {{"max_running_seqs", 4}, {"prefix_cache", "on"}};
  auto one = make_engine(keys);
  auto two = make_engine(with(keys, {{"tensor_parallel", 2}}));
  const std::vector<int32_t> prompt = prompt_of(37, 4, 1024);
  // The prompt and two more tokens (sized up front: no reallocation for a compiler to misread).
  std::vector<int32_t> longer(prompt.size() + 2);
  std::copy(prompt.begin(), prompt.end(), longer.begin());
  longer[prompt.size()] = 5;
  longer[prompt.size() + 1] = 9;
  struct Got {
    std::vector<TokenLogprob> prompt_lp;
    std::optional<TokenLogprob> token_lp;
    int32_t cached = 0;
  };
  auto run = [&](Engine& e) {
    std::vector<Got> out;
    for (const auto& [id, p] : {std::pair<SeqId, const std::vector<int32_t>*>{1, &prompt}, {2, &longer}}) {
      REQUIRE(e.add_sequence(id, *p, SamplingParams{}, nullptr, /*reuse_prefix=*/true).ok());
      Got g;
      g.cached = e.sequence(id)->num_cached;
      StepItem it{id, e.sequence(id)->num_pending(), true};
      it.logprobs = true;
      it.prompt_logprobs = id == 1;  // prompt logprobs do not combine with the prefix cache
      it.top_logprobs = 3;
      auto r = e.step({it});
      REQUIRE(r.ok());
      REQUIRE((*r)[0].status.ok());
      g.prompt_lp = (*r)[0].prompt_logprobs;
      g.token_lp = (*r)[0].logprob;
      out.push_back(std::move(g));
    }
    return out;
  };
  const auto a = run(*one);
  const auto b = run(*two);
  REQUIRE(a.size() == 2);
  REQUIRE(b.size() == 2);
  CHECK(b[1].cached == a[1].cached);  // the same pages shared at tp 2
  CHECK(b[1].cached == 32);           // two pages of 16 of the first sequence's prompt
  REQUIRE(a[0].prompt_lp.size() == prompt.size() - 1);
  REQUIRE(b[0].prompt_lp.size() == a[0].prompt_lp.size());
  float worst = 0;
  for (size_t i = 0; i < a[0].prompt_lp.size(); ++i) {
    CHECK(b[0].prompt_lp[i].token == a[0].prompt_lp[i].token);
    worst = std::max(worst, std::fabs(b[0].prompt_lp[i].logprob - a[0].prompt_lp[i].logprob));
    REQUIRE(b[0].prompt_lp[i].top.size() == 3);
  }
  for (size_t s = 0; s < 2; ++s) {
    REQUIRE(a[s].token_lp.has_value());
    REQUIRE(b[s].token_lp.has_value());
    worst = std::max(worst, std::fabs(b[s].token_lp->logprob - a[s].token_lp->logprob));
  }
  INFO("max |dlogprob| " << worst);
  CHECK(worst < 2 * 0.25f);
  for (SeqId id : {SeqId(1), SeqId(2)}) REQUIRE(two->release(id).ok());
  CHECK(two->pool().usage(PoolKind::full).used_pages == 0);
}

// Config::tp_rank_alone (kvfuse-bench-engine --tp-rank-alone): rank 0 of a group on one
// device with no peers, to time a rank's own work on a machine of one GPU. Its shard is
// the group's rank 0's: layer 0's pages, written before any collective, hold the group's
// rank-0 bytes. Steps run (the tokens mean nothing without the all-reduces, but lie in the
// vocabulary), pages come back, and it is refused where it has no meaning.
TEST_CASE("tensor parallel (cpu): rank 0 alone computes the group's rank-0 shard", "[tp][engine][kv]") {
  auto alone_engine = [](const nlohmann::json& keys) -> absl::StatusOr<std::unique_ptr<Engine>> {
    Config cfg = make_config(keys);
    cfg.tp_rank_alone = true;
    return Engine::create(cfg);
  };
  for (const int tp : {2, 4}) {
    DYNAMIC_SECTION("tp " << tp) {
      const nlohmann::json keys = {{"kv_cache_dtype", "fp8_e4m3"}, {"tensor_parallel", tp}};
      auto group = make_engine(keys);
      auto made = alone_engine(keys);
      INFO(made.status().ToString());
      REQUIRE(made.ok());
      Engine& alone = **made;
      CHECK(alone.rank_alone());
      CHECK(alone.num_ranks() == tp);
      CHECK(alone.num_local_ranks() == 1);
      CHECK_THAT(alone.collectives_path(), ContainsSubstring("rank 0 of " + std::to_string(tp) + " alone"));
      CHECK(alone.collectives_ms(1, 1).status().code() == absl::StatusCode::kFailedPrecondition);
      const int32_t vocab = alone.spec().vocab;
      for (Engine* e : {group.get(), &alone}) {
        REQUIRE(e->add_sequence(7, prompt_of(45, 2, vocab), SamplingParams{}).ok());
        REQUIRE(e->add_sequence(8, prompt_of(20, 9, vocab), SamplingParams{}).ok());
        auto r = e->step({StepItem{7, 45, true}, StepItem{8, 20, true}});
        REQUIRE(r.ok());
      }
      for (const bool v_side : {false, true}) {
        const std::vector<uint8_t> want = storage_bytes(*group, 0, 0, v_side);
        const std::vector<uint8_t> got = storage_bytes(alone, 0, 0, v_side);
        CHECK(std::count(got.begin(), got.end(), uint8_t{0}) < std::ptrdiff_t(got.size()));
        CHECK((got == want));
      }
      for (int i = 0; i < 4; ++i) {
        auto r = alone.step({StepItem{7, 1, true}, StepItem{8, 1, true}});
        REQUIRE(r.ok());
        for (const StepResult& x : *r) {
          REQUIRE(x.status.ok());
          REQUIRE(x.token.has_value());
          CHECK((*x.token >= 0 && *x.token < vocab));
        }
      }
      REQUIRE(alone.release(7).ok());
      REQUIRE(alone.release(8).ok());
      CHECK(alone.pool().usage(PoolKind::full).used_pages == 0);
      REQUIRE(alone.pool().check_invariants().ok());
    }
  }
  SECTION("refused at tensor_parallel 1 and across processes") {
    auto one = alone_engine({});
    CHECK(one.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(one.status().message()), ContainsSubstring("needs tensor_parallel >= 2"));
    auto spread = alone_engine({{"tensor_parallel", 2}, {"tp_rendezvous", "127.0.0.1:1"}});
    CHECK(spread.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(spread.status().message()), ContainsSubstring("tp_rendezvous must be empty"));
  }
}

// Config::tp_share_gpu (tests/gpu/test_gpu_tp.cc on a machine of one GPU) runs a group's ranks
// on one GPU; where it has no meaning it is refused with a message naming it: on the CPU
// backend, at tensor_parallel 1, with NCCL asked for (which refuses ranks sharing a GPU).
TEST_CASE("tensor parallel (cpu): tp_share_gpu is refused where it has no meaning", "[tp][engine]") {
  for (const nlohmann::json& keys :
       {nlohmann::json{{"tensor_parallel", 2}}, nlohmann::json{{"tensor_parallel", 1}},
        nlohmann::json{{"tensor_parallel", 2}, {"tp_allreduce", "nccl"}}}) {
    CAPTURE(keys.dump());
    Config cfg = make_config(keys);
    cfg.tp_share_gpu = true;
    auto e = Engine::create(cfg);
    CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(e.status().message()), ContainsSubstring("tp_share_gpu"));
  }
}

TEST_CASE("tensor parallel (cpu): the logit processors and min-p run on rank 0's gathered logits",
          "[tp][engine][sampling]") {
  auto e = make_engine({{"tensor_parallel", 2}});
  for (const SamplingParams& sp : processor_cases(e->spec().vocab)) {
    CAPTURE(sp.temperature, sp.min_p, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty);
    const auto [equal, n] = sampled_tokens_match_reference(*e, sp, 12);
    CHECK(equal == n);
  }
}
