// The engine on the GPU against the engine on the CPU, tiny model. Skips (and says so)
// in a build without a GPU backend or on a machine without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kernels/cpu/ops/sampling.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_agreement.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

const char* const kSkipped = "GPU engine tests skipped: this build has no GPU backend or no GPU is visible";

// The GPU backend, or null (and a warning) where there is none.
std::unique_ptr<Backend> gpu_backend_or_skip() {
  auto backend = make_backend(Device::auto_);
  REQUIRE(backend.ok());
  if ((*backend)->device() == Device::cpu) {
    WARN(kSkipped);
    return nullptr;
  }
  return std::move(*backend);
}

std::unique_ptr<Engine> gpu_engine_or_skip(json overrides) {
  overrides["device"] = "auto";
  nlohmann::json j = {
      {"model", "tiny"}, {"num_pages", 512}, {"max_seq_len", 1024}, {"max_batch_tokens", 1024}};
  for (const auto& [k, v] : overrides.items()) j[k] = v;
  auto cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  auto e = Engine::create(*cfg);
  REQUIRE(e.ok());
  if ((*e)->backend().device() == Device::cpu) {
    WARN(kSkipped);
    return nullptr;
  }
  return std::move(*e);
}

}  // namespace

// Tolerance. The GPU runs the same bf16-storage / fp32-arithmetic contract with other
// summation orders (cuBLASLt vs OpenBLAS, parallel reductions), so bf16 roundings flip
// here and there and carry through 4 layers: the same mechanism as unified vs split on
// the CPU, where logits move by up to 0.06 (std 3). With an FP8 cache a flipped K/V
// element can also move one FP8 step. Bounds: max |dlogit| < 0.25 (8% of the std, an
// order of magnitude below a wrong scale, mask or format), teacher-forced top-1
// agreement >= 95%; free-running greedy agreement is printed.
TEST_CASE("gpu engine: tiny model logits and greedy tokens match the CPU engine", "[gpu][engine]") {
  for (const char* dtype : {"bf16", "fp8_e4m3", "fp8_e5m2"}) {
    for (const char* write : {"fused", "unfused", "fused_rope"}) {
      for (const char* attn : {"unified", "split"}) {
        CAPTURE(dtype, write, attn);
        const json cfg = {{"kv_cache_dtype", dtype}, {"kv_write", write}, {"attention", attn}};
        auto gpu = gpu_engine_or_skip(cfg);
        if (!gpu) return;
        json cpu_cfg = cfg;
        cpu_cfg["device"] = "cpu";
        cpu_cfg["max_batch_tokens"] = 1024;  // the 700-token prompt in one step
        auto cpu = make_engine(cpu_cfg);
        const auto prompt = prompt_of(700, 11, cpu->spec().vocab);  // > one split partition
        const EngineAgreement a = engine_agreement(*cpu, *gpu, prompt, 64);
        std::printf(
            "gpu engine %s %s %s: max |dlogit| %.4f, teacher-forced top-1 %d/%zu, greedy prefix %d/64\n",
            dtype, write, attn, a.max_dlogit, a.top1, a.positions, a.prefix);
        CHECK(a.max_dlogit < 0.25f);
        CHECK(a.top1 >= int(0.95 * double(a.positions)));
      }
    }
  }
}

// fused_rope too: its kernel rotates with rope_kernel's expressions and converts with the
// fused write's, so on one device its q and cache bits are those of the two kernels
// (tests/gpu/test_kv_write_rope_gpu.cu checks the kernels alone).
TEST_CASE("gpu engine: fused and unfused writes leave byte-identical caches - fused_rope the same tokens",
          "[gpu][engine][kv_write]") {
  for (const char* dtype : {"bf16", "fp8_e4m3", "fp8_e5m2"}) {
    for (const char* other : {"unfused", "fused_rope"}) {
      CAPTURE(dtype, other);
      json a = {{"kv_cache_dtype", dtype}, {"kv_write", "fused"},  {"k_scale", 0.75},
                {"v_scale", 1.5},          {"sliding_window", 24}, {"swa_layers", "alternate"}};
      json b = a;
      b["kv_write"] = other;
      auto ea = gpu_engine_or_skip(a);
      if (!ea) return;
      auto eb = gpu_engine_or_skip(b);
      const auto prompt = prompt_of(90, 4, ea->spec().vocab);
      CHECK(greedy(*ea, 1, prompt, 24) == greedy(*eb, 1, prompt, 24));
      REQUIRE(ea->add_sequence(5, prompt, SamplingParams{}).ok());
      REQUIRE(eb->add_sequence(5, prompt, SamplingParams{}).ok());
      REQUIRE(ea->step({StepItem{5, 90, true}}).ok());
      REQUIRE(eb->step({StepItem{5, 90, true}}).ok());
      // fused_rope rotates K in its own kernel, which rounds one bf16 ulp apart from the
      // rope kernel now and then (tests/gpu/test_kv_write_rope_gpu.cu): its K cache may
      // differ in a few codes; unfused writes the same bytes.
      if (std::string(other) == "unfused") CHECK((cache_bytes(*ea) == cache_bytes(*eb)));
    }
  }
}

// Graphs. A replayed step must equal the same padded batch run eagerly bit for bit
// (same kernels, same shapes, same GEMM algorithms: any difference is a capture bug, e.g.
// a stale pointer or a host value baked into the graph). Against the unpadded eager
// step (graphs off) the GEMMs run with fewer rows and cuBLASLt may pick other kernels, so
// that comparison takes the unified-vs-split tolerance: max |dlogit| < 0.1, equal greedy
// tokens wherever the top-2 margin exceeds twice that difference.
TEST_CASE("gpu engine: graph replay equals the padded eager step bit for bit", "[gpu][engine][graphs]") {
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    for (const char* write : {"fused", "unfused", "fused_rope"}) {
      for (const char* attention : {"unified", "split"}) {
        for (int window : {0, 40}) {
          CAPTURE(dtype, write, attention, window);
          json cfg = {{"kv_cache_dtype", dtype}, {"kv_write", write}, {"attention", attention}};
          if (window) {
            cfg["sliding_window"] = window;
            cfg["swa_layers"] = "alternate";
          }
          auto e = gpu_engine_or_skip(cfg);
          if (!e) return;
          ForwardOptions replay;
          replay.kv_write = std::string(write) == "fused"     ? KvWritePath::fused
                            : std::string(write) == "unfused" ? KvWritePath::unfused
                                                              : KvWritePath::fused_rope;
          replay.attention = std::string(attention) == "split" ? AttentionPath::split : AttentionPath::unified;
          ForwardOptions padded = replay, eager = replay;
          padded.graph_replay = false;
          eager.graphs = false;
          const auto g = run_bucket_schedule(*e, replay, 500, 8, 1000);
          const GraphStats st = e->graph_stats();
          const auto p = run_bucket_schedule(*e, padded, 500, 8, 2000);
          const auto u = run_bucket_schedule(*e, eager, 500, 8, 3000);
          std::printf("graphs %s %s %s window %d: %lld captures, %lld replays, %lld invalidated\n", dtype, write,
                      attention, window, (long long)st.captures, (long long)st.replays,
                      (long long)st.invalidated);
          CHECK(g.graph_steps == 24);
          CHECK(st.captures >= 3);  // buckets 4 and 8, contexts 512 and 1024
          CHECK(st.replays >= 24 - st.captures);
          CHECK(p.graph_steps == 0);
          CHECK(u.graph_steps == 0);
          CHECK(g.tokens == p.tokens);
          REQUIRE(g.logits.size() == p.logits.size());
          CHECK(std::memcmp(g.logits.data(), p.logits.data(), g.logits.size() * sizeof(float)) == 0);

          const float worst = max_abs_diff(g.logits, u.logits);
          INFO("max |logit difference| graph vs unpadded eager: " << worst);
          CHECK(worst < 0.1f);
          const size_t vocab = size_t(e->spec().vocab);
          for (size_t r = 0; r < g.tokens.size(); ++r) {
            std::vector<float> row(g.logits.begin() + int64_t(r * vocab), g.logits.begin() + int64_t((r + 1) * vocab));
            std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
            if (row[0] - row[1] > 2 * worst) CHECK(g.tokens[r] == u.tokens[r]);
          }
          CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
        }
      }
    }
  }
}

TEST_CASE("gpu engine: seeded sampling and the logit processors on the device, in and out of graphs",
          "[gpu][engine][sampling]") {
  // The device sampler against sample_token on the same (device) logits with the same
  // draws: equal unless the CPU's and the GPU's exp straddle a 2^-40 weight step at a
  // boundary (kernels/ops/sampling.h), so at most one miss is allowed. Then a sampling
  // schedule through graphs equals its padded eager run token for token.
  json cfg = {{"kv_cache_dtype", "fp8_e4m3"}};
  auto e = gpu_engine_or_skip(cfg);
  if (!e) return;
  for (const SamplingParams& sp : {SamplingParams::sampled(0.8f, 0, 1.0f, 3), SamplingParams::sampled(1.2f, 20, 0.9f, 4),
                                   SamplingParams::sampled(0.5f, 0, 0.5f, 5)}) {
    CAPTURE(sp.temperature, sp.top_k, sp.top_p);
    const auto [equal, n] = sampled_tokens_match_reference(*e, sp, 24);
    std::printf("gpu engine sampling T=%.1f top_k=%d top_p=%.2f: %d of %d tokens equal to the reference\n",
                double(sp.temperature), sp.top_k, double(sp.top_p), equal, n);
    CHECK(equal >= n - 1);
  }
  // The logit processors and min-p (greedy and sampled): the device applies them before
  // its picks, and the logits a step returns are the raw ones the reference processes.
  for (const SamplingParams& sp : processor_cases(e->spec().vocab)) {
    CAPTURE(sp.temperature, sp.min_p, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty);
    const auto [equal, n] = sampled_tokens_match_reference(*e, sp, 24);
    std::printf("gpu engine processors T=%.1f min_p=%.2f rep=%.1f freq=%.1f pres=%.1f bias=%zu: %d of %d\n",
                double(sp.temperature), double(sp.min_p), double(sp.repetition_penalty),
                double(sp.frequency_penalty), double(sp.presence_penalty), sp.logit_bias.size(), equal, n);
    CHECK(equal >= n - 1);
  }
  ForwardOptions replay;
  ForwardOptions padded = replay;
  padded.graph_replay = false;
  const SamplingParams sp = SamplingParams::sampled(0.9f, 50, 0.95f, 21);
  const auto g = run_bucket_schedule(*e, replay, 500, 8, 1000, sp);
  const auto p = run_bucket_schedule(*e, padded, 500, 8, 2000, sp);
  CHECK(g.graph_steps == 24);
  CHECK(g.tokens == p.tokens);
  CHECK(g.logits == p.logits);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("gpu engine: warming captures every decode bucket, and requests then replay", "[gpu][engine][graphs]") {
  auto e = gpu_engine_or_skip({{"max_running_seqs", 16}});
  if (!e) return;
  auto warmed = e->warm_up_decode_graphs();
  REQUIRE(warmed.ok());
  CHECK(*warmed == 5);  // buckets 1, 2, 4, 8, 16
  const int64_t captures = e->graph_stats().captures;
  CHECK(captures == 5);
  CHECK(e->num_sequences() == 0);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  // Three short sequences: their decode steps (bucket 4, context bucket 512) replay the
  // graph captured at warm-up.
  const int32_t vocab = e->spec().vocab;
  std::vector<StepItem> items;
  for (SeqId id = 1; id <= 3; ++id) {
    REQUIRE(e->add_sequence(id, prompt_of(20, int32_t(id), vocab), SamplingParams{}).ok());
    auto r = e->step({StepItem{id, 20, true}});
    REQUIRE(r.ok());
    items.push_back(StepItem{id, 1, true});
  }
  const int64_t replays = e->graph_stats().replays;
  for (int i = 0; i < 4; ++i) {
    auto r = e->step(items);
    REQUIRE(r.ok());
    CHECK(e->last_timings().graph);
  }
  CHECK(e->graph_stats().captures == captures);
  CHECK(e->graph_stats().replays == replays + 4);
  for (SeqId id = 1; id <= 3; ++id) REQUIRE(e->release(id).ok());
}

TEST_CASE("gpu engine: a head_dim the kernels are not built for is refused at startup, named",
          "[gpu][engine][dispatch]") {
  auto backend = gpu_backend_or_skip();
  if (!backend) return;
  TempDir dir;
  ModelSpec spec = mini_spec();
  spec.head_dim = 96;  // the GPU kernels have 64, 128 and 256
  export_synthetic(dir.path(), spec, 5);
  auto cfg = config_from_json({{"model_path", dir.path()}, {"device", "auto"}, {"num_pages", 64},
                               {"max_seq_len", 256}, {"kv_cache_dtype", "fp8_e4m3"}});
  REQUIRE(cfg.ok());
  auto e = Engine::create(*cfg, std::move(backend));
  REQUIRE_FALSE(e.ok());
  INFO(e.status().ToString());
  CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(e.status().message()), Catch::Matchers::ContainsSubstring("head_dim 96"));
  CHECK_THAT(std::string(e.status().message()), Catch::Matchers::ContainsSubstring("64, 128, 256"));
}

TEST_CASE("gpu engine: logprobs are the device logits' log-softmax, in and out of graphs", "[gpu][engine][logprobs]") {
  // The decode steps replay graphs that end with the logprobs kernel; each step's
  // logprobs must be the CPU reference's on the logits the same step returns (1e-4, top
  // ids exact). Prompt logprobs (39 rows through a 4-row logits buffer) against the CPU
  // engine's: the engines' logits differ by up to 0.25 (the bound above), so 0.5 here.
  auto gpu = gpu_engine_or_skip({{"max_running_seqs", 4}});
  if (!gpu) return;
  auto cpu = make_engine({{"max_running_seqs", 4}});
  const int32_t vocab = gpu->spec().vocab;
  const auto prompt = prompt_of(40, 21, vocab);
  std::vector<TokenLogprob> prompt_lp[2];
  int engine_index = 0;
  for (Engine* e : {gpu.get(), cpu.get()}) {
    REQUIRE(e->add_sequence(1, prompt, SamplingParams{}).ok());
    int32_t pending = 40;
    for (int step = 0; step < 8; ++step) {
      StepItem it{1, pending, true, true};
      it.logprobs = true;
      it.prompt_logprobs = step == 0;
      it.top_logprobs = 5;
      auto r = e->step({it});
      REQUIRE(r.ok());
      const StepResult& res = (*r)[0];
      REQUIRE(res.status.ok());
      REQUIRE(res.logprob.has_value());
      if (step == 0) prompt_lp[engine_index] = res.prompt_logprobs;
      LogprobOut want;
      cpu::logprobs_row(e->last_logits().data() + size_t(res.logits_row) * size_t(vocab), vocab, *res.token, 5, want);
      CAPTURE(engine_index, step);
      CHECK(res.logprob->token == *res.token);
      CHECK(std::abs(res.logprob->logprob - want.logprob) <= 1e-4f);
      REQUIRE(res.logprob->top.size() == 5);
      for (int j = 0; j < 5; ++j) {
        CHECK(res.logprob->top[size_t(j)].first == want.top_ids[j]);
        CHECK(std::abs(res.logprob->top[size_t(j)].second - want.top_logprobs[j]) <= 1e-4f);
      }
      pending = 1;
    }
    REQUIRE(e->release(1).ok());
    ++engine_index;
  }
  CHECK(gpu->graph_stats().replays > 0);
  REQUIRE(prompt_lp[0].size() == 39);
  REQUIRE(prompt_lp[1].size() == 39);
  float worst = 0;
  for (size_t i = 0; i < 39; ++i) {
    CHECK(prompt_lp[0][i].token == prompt[i + 1]);
    CHECK(prompt_lp[1][i].token == prompt[i + 1]);
    worst = std::max(worst, std::fabs(prompt_lp[0][i].logprob - prompt_lp[1][i].logprob));
  }
  std::printf("gpu engine prompt logprobs: max |dlogprob| vs the CPU engine %.4f over 39 tokens\n", worst);
  CHECK(worst <= 0.5f);
}

// The prefix cache on the GPU: a prompt whose first pages come from the cache (computed by
// an earlier, finished sequence) computes only the rest; its next-token logits stay within
// the engines' tolerance above (max |dlogit| < 0.25) of a run that computes the whole
// prompt: the two differ in the GEMMs' and attention's shapes (a 300-token prefill against
// a 12-token one over cached keys), hence in summation order, not in what is computed.
TEST_CASE("gpu engine: a cached prefix gives the recomputed logits within the tolerance", "[gpu][engine][prefix]") {
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    CAPTURE(dtype);
    auto cached = gpu_engine_or_skip({{"kv_cache_dtype", dtype}});
    if (!cached) return;
    auto whole = gpu_engine_or_skip({{"kv_cache_dtype", dtype}, {"prefix_cache", "off"}});
    const int32_t vocab = cached->spec().vocab;
    const auto prompt = prompt_of(300, 21, vocab);
    // One step over a sequence's pending tokens; its logits row.
    const auto logits_of = [&](Engine& e, SeqId id) {
      const int32_t pending = e.sequence(id)->num_pending();
      auto r = e.step({StepItem{id, pending, true, true}});
      REQUIRE(r.ok());
      REQUIRE((*r)[0].status.ok());
      const float* row = e.last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab);
      return std::vector<float>(row, row + vocab);
    };
    REQUIRE(cached->add_sequence(1, prompt, SamplingParams{}, nullptr, true).ok());
    (void)logits_of(*cached, 1);
    REQUIRE(cached->release(1).ok());
    REQUIRE(cached->add_sequence(2, prompt, SamplingParams{}, nullptr, true).ok());
    CHECK(cached->sequence(2)->num_cached == 288);  // whole pages of 16 of the 299 before the last
    const std::vector<float> a = logits_of(*cached, 2);
    REQUIRE(whole->add_sequence(2, prompt, SamplingParams{}, nullptr, true).ok());
    CHECK(whole->sequence(2)->num_cached == 0);
    const std::vector<float> b = logits_of(*whole, 2);
    float worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    std::printf("gpu engine prefix cache %s: max |dlogit| %.4f against recomputing\n", dtype, worst);
    CHECK(worst < 0.25f);
    REQUIRE(cached->release(2).ok());
    REQUIRE(cached->pool().check_invariants().ok());
  }
}

TEST_CASE("gpu engine: num_pages 0 sizes the pool from the GPU's free memory, and the split adds up",
          "[gpu][engine][memory]") {
  auto backend = gpu_backend_or_skip();
  if (!backend) return;
  auto mem = backend->device_memory();
  REQUIRE(mem.ok());
  // A headroom that leaves the pool about 1 GiB of what is free now.
  const int64_t mib = int64_t(1) << 20;
  const int64_t headroom_mib = mem->free_bytes / mib - 1024;
  REQUIRE(headroom_mib > 0);
  auto e = gpu_engine_or_skip({{"num_pages", 0}, {"memory_headroom_mib", headroom_mib}, {"max_running_seqs", 8}});
  if (!e) return;
  const MemorySplit before = e->memory();
  std::printf("gpu memory split after loading: %s\n", describe_memory(before).c_str());
  CHECK(before.pool_auto);
  CHECK(before.weight_bytes >= e->spec().weight_bytes());
  CHECK(before.kv_pool_bytes == kv_pool_bytes(e->pool().config()));
  CHECK(before.kv_pool_bytes > 512 * mib);
  CHECK(before.kv_pool_bytes < 1024 * mib);
  // What is left is the headroom, give or take the allocator's rounding of each buffer.
  CHECK(std::abs(before.device_free_bytes - (headroom_mib << 20)) < 64 * mib);
  auto warmed = e->warm_up_decode_graphs();
  REQUIRE(warmed.ok());
  const MemorySplit after = e->memory();
  std::printf("gpu memory split after the graph warm-up: %s\n", describe_memory(after).c_str());
  CHECK(after.workspace_bytes >= before.workspace_bytes);
  CHECK(after.graph_bytes < 1024 * mib);
  CHECK(after.device_free_bytes <= before.device_free_bytes);

  // A pool larger than the GPU is refused before loading, naming the numbers.
  auto cfg = config_from_json({{"model", "tiny"}, {"device", "auto"}, {"num_pages", 2147483647}, {"max_seq_len", 1024}});
  REQUIRE(cfg.ok());
  auto big = Engine::create(*cfg);
  REQUIRE(big.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(big.status().message()),
             Catch::Matchers::ContainsSubstring("num_pages 2147483647 needs a KV pool of") &&
                 Catch::Matchers::ContainsSubstring("memory_headroom_mib"));
}
