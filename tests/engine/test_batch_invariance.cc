// The CPU backend's batch-invariance promise, end to end on the tiny model: the bits
// computed for a sequence depend only on its own tokens and the weights — not on the
// batch size, its row in the batch, padding rows, how its prompt was chunked, or a
// recomputation after preemption. Logits are compared bit for bit, tokens exactly.
//
// CI runs these under every GEMM kernel the machine has (KVFUSE_CPU_GEMM) and under
// several OPENBLAS_CORETYPE values (.ci/run), so no CPU can make them flaky.
#include <cstring>
#include <string>
#include <vector>

#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

using json = nlohmann::json;

constexpr int kSteps = 10;  // decode steps per run
constexpr int32_t kPromptLen = 37;

struct Variant {
  const char* dtype;
  const char* attention;
  int window;  // 0: no SWA; else a window on alternate layers
};
constexpr Variant kVariants[] = {
    {"fp8_e4m3", "unified", 0}, {"bf16", "split", 0}, {"fp8_e4m3", "unified", 20}, {"fp8_e5m2", "split", 20}};

std::unique_ptr<Engine> engine_for(const Variant& v) {
  json cfg = {{"kv_cache_dtype", v.dtype}, {"attention", v.attention}, {"max_batch_tokens", 1024}};
  if (v.window) {
    cfg["sliding_window"] = v.window;
    cfg["swa_layers"] = "alternate";
  }
  return make_engine(cfg);
}

ForwardOptions options(const Variant& v, bool padded) {
  ForwardOptions o;
  o.attention = std::string(v.attention) == "split" ? AttentionPath::split : AttentionPath::unified;
  o.graphs = padded;       // decode steps padded to their graph bucket...
  o.graph_replay = false;  // ...and run eagerly (the CPU has no graphs)
  return o;
}

// The target sequence's tokens and per-step logits.
struct Trace {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // kSteps + 1 rows: after the prefill, then after each decode
};

// Runs `batch` sequences together: all prefilled in one step (each with its own prompt
// length), then kSteps greedy decode steps. Sequence `target` gets the target prompt.
Trace run_batch(Engine& e, const ForwardOptions& opts, int batch, int target) {
  const int32_t vocab = e.spec().vocab;
  std::vector<StepItem> items;
  for (int i = 0; i < batch; ++i) {
    const SeqId id = SeqId(500 + i);
    const auto prompt = i == target ? prompt_of(kPromptLen, 1, vocab) : prompt_of(5 + 11 * i, 100 + i, vocab);
    REQUIRE(e.add_sequence(id, prompt, SamplingParams{}).ok());
    items.push_back(StepItem{id, int32_t(prompt.size()), true, i == target});
  }
  Trace t;
  for (int step = 0; step <= kSteps; ++step) {
    auto r = e.step(items, opts);
    REQUIRE(r.ok());
    for (const StepResult& x : *r) {
      REQUIRE(x.status.ok());
      if (x.id != SeqId(500 + target)) continue;
      t.tokens.push_back(*x.token);
      const float* lg = e.last_logits().data() + size_t(x.logits_row) * size_t(vocab);
      t.logits.insert(t.logits.end(), lg, lg + vocab);
    }
    for (StepItem& it : items) it.num_tokens = 1;
  }
  for (int i = 0; i < batch; ++i) REQUIRE(e.release(SeqId(500 + i)).ok());
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("batch invariance: a prompt alone and in batches of 2 to 9 at every row gives identical logits",
          "[engine][invariance]") {
  for (const Variant& v : kVariants) {
    CAPTURE(v.dtype, v.attention, v.window);
    auto e = engine_for(v);
    const Trace alone = run_batch(*e, options(v, false), 1, 0);
    REQUIRE(alone.tokens.size() == size_t(kSteps + 1));
    int runs = 0, differing = 0;
    for (int batch = 2; batch <= 9; ++batch)
      for (int row = 0; row < batch; ++row)
        for (bool padded : {false, true}) {
          const Trace t = run_batch(*e, options(v, padded), batch, row);
          ++runs;
          const bool same = t.tokens == alone.tokens && same_bits(t.logits, alone.logits);
          if (!same) {
            ++differing;
            UNSCOPED_INFO("batch " << batch << " row " << row << " padded " << padded << ": max |dlogit| "
                                   << max_abs_diff(t.logits, alone.logits));
          }
        }
    CHECK(runs == 88);
    CHECK(differing == 0);
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  }
}

TEST_CASE(
    "batch invariance: recomputing a sequence (prefill of prompt plus generated tokens) continues with "
    "identical logits",
    "[engine][invariance]") {
  // What preemption by recomputation does: the sequence's pages are dropped and its
  // prompt plus every generated token is prefilled again, in one step or in chunks,
  // where the original computed them one decode step at a time.
  for (const Variant& v : kVariants) {
    CAPTURE(v.dtype, v.attention, v.window);
    auto e = engine_for(v);
    const int32_t vocab = e->spec().vocab;
    const ForwardOptions opts = options(v, false);
    const Trace orig = run_batch(*e, opts, 1, 0);
    const auto prompt = prompt_of(kPromptLen, 1, vocab);
    for (int upto : {1, 4, kSteps}) {  // generated tokens kept before the recompute
      for (int32_t chunk : {7, 1024}) {
        CAPTURE(upto, chunk);
        std::vector<int32_t> all = prompt;
        all.insert(all.end(), orig.tokens.begin(), orig.tokens.begin() + upto);
        REQUIRE(e->add_sequence(9, all, SamplingParams{}).ok());
        std::vector<float> last;
        int32_t token = -1;
        for (int32_t done = 0; done < int32_t(all.size());) {
          const int32_t n = std::min<int32_t>(chunk, int32_t(all.size()) - done);
          const bool final = done + n == int32_t(all.size());
          auto r = e->step({StepItem{9, n, final, final}}, opts);
          REQUIRE(r.ok());
          REQUIRE((*r)[0].status.ok());
          done += n;
          if (final) {
            token = *(*r)[0].token;
            const float* lg = e->last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab);
            last.assign(lg, lg + vocab);
          }
        }
        // The recompute's last row is the position the original decoded at step `upto`.
        const std::vector<float> want(orig.logits.begin() + int64_t(upto) * vocab,
                                      orig.logits.begin() + int64_t(upto + 1) * vocab);
        INFO("max |dlogit| " << max_abs_diff(last, want));
        CHECK(same_bits(last, want));
        CHECK(token == orig.tokens[size_t(upto)]);
        REQUIRE(e->release(9).ok());
      }
    }
  }
}
