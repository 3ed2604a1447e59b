// Helpers shared by the engine-level tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>
#include "tests/util/catch.h"

#include "src/runtime/engine.h"
#include "tests/util/reference_processors.h"

namespace kvfuse::testing {

// The config of the engine tests: the default tiny model on the CPU with the given keys on top.
inline Config make_config(const nlohmann::json& overrides = nlohmann::json::object()) {
  nlohmann::json j = {{"model", "tiny"}, {"device", "cpu"}, {"num_pages", 512}, {"max_seq_len", 1024}};
  for (const auto& [k, v] : overrides.items()) j[k] = v;
  auto cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  return *cfg;
}

// An engine on make_config(overrides).
inline std::unique_ptr<Engine> make_engine(const nlohmann::json& overrides = nlohmann::json::object()) {
  auto e = Engine::create(make_config(overrides));
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  return std::move(*e);
}

// "" when a == b, else what differs: the sizes, or how many elements differ and the
// first of them (index and both values). Compare large vectors with
// CHECK(mismatch(a, b) == ""), never CHECK(a == b): on a failure Catch2 prints every
// element of both, and its console reporter wraps that text at 80 columns in time that
// grows faster than the text. For the megabytes of cache_bytes a failed comparison took
// minutes, and a wrong KV write ran into ctest's timeout instead of failing.
template <class T>
std::string mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) {
    return "sizes differ: " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  }
  size_t count = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i]) && count++ == 0) first = i;
  }
  if (count == 0) return "";
  std::ostringstream out;
  out << count << " of " << a.size() << " elements differ, the first at " << first << ": " << +a[first]
      << " vs " << +b[first];
  return out.str();
}

// The same for rows (logits rows, tokens per sequence): how many rows differ, and the first one's mismatch.
template <class T>
std::string mismatch(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) {
    return "row counts differ: " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  }
  size_t count = 0;
  std::string first;
  for (size_t r = 0; r < a.size(); ++r) {
    std::string m = mismatch(a[r], b[r]);
    if (!m.empty() && count++ == 0) first = "row " + std::to_string(r) + ": " + m;
  }
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(a.size()) + " rows differ, the first " + first;
}

// Every byte of every layer's K and V buffers.
inline std::vector<uint8_t> cache_bytes(Engine& e) {
  std::vector<uint8_t> out;
  const KvPool& pool = e.pool();
  for (int32_t l = 0; l < e.spec().num_layers; ++l) {
    const PagedKvView v = pool.layer_view(l);
    const size_t bytes = size_t(v.num_slots() * v.row_elems()) * size_t(kv_format_bytes(v.format));
    const size_t at = out.size();
    out.resize(at + 2 * bytes);
    REQUIRE(e.backend().copy_to_host(out.data() + at, v.k, bytes).ok());
    REQUIRE(e.backend().copy_to_host(out.data() + at + bytes, v.v, bytes).ok());
  }
  return out;
}

// Tensor parallelism: the best token of a logits row, and its lead over the second.
inline int32_t top_token(const std::vector<float>& row) {
  return int32_t(std::max_element(row.begin(), row.end()) - row.begin());
}
inline float top_margin(const std::vector<float>& row) {
  std::vector<float> v = row;
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  return v[0] - v[1];
}

// Layer `l`'s K (or V) bytes in one rank's storage of the pool.
inline std::vector<uint8_t> storage_bytes(Engine& e, int32_t l, int32_t rank, bool v_side) {
  const PagedKvView view = e.pool().layer_view(l, rank);
  const size_t bytes = size_t(view.num_slots() * view.row_elems()) * size_t(kv_format_bytes(view.format));
  std::vector<uint8_t> out(bytes);
  REQUIRE(e.rank_backend(rank).copy_to_host(out.data(), v_side ? view.v : view.k, bytes).ok());
  return out;
}

inline std::vector<int32_t> prompt_of(int32_t len, int32_t salt, int32_t vocab) {
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int32_t i = 0; i < len; ++i)
    p[size_t(i)] = int32_t((uint32_t(i) * 2654435761u + uint32_t(salt) * 40503u) % uint32_t(vocab));
  return p;
}

// Greedy generation of `n` tokens for one sequence, prefilling the prompt in one step.
inline std::vector<int32_t> greedy(Engine& e, SeqId id, const std::vector<int32_t>& prompt, int n) {
  REQUIRE(e.add_sequence(id, prompt, SamplingParams{}).ok());
  std::vector<int32_t> out;
  int32_t pending = int32_t(prompt.size());
  for (int i = 0; i < n; ++i) {
    auto r = e.step({StepItem{id, pending, true}});
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    out.push_back(*(*r)[0].token);
    pending = 1;
  }
  REQUIRE(e.release(id).ok());
  return out;
}

// Feeds `tokens` one at a time after a prompt prefill and returns the logits after
// each fed position: rows [prompt_len-1, prompt_len, ..., prompt_len+tokens.size()-1].
inline std::vector<std::vector<float>> teacher_forced_logits(Engine& e, SeqId id,
                                                             const std::vector<int32_t>& prompt,
                                                             const std::vector<int32_t>& tokens) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), tokens.begin(), tokens.end());
  REQUIRE(e.add_sequence(id, all, SamplingParams{}).ok());
  const int32_t vocab = e.spec().vocab;
  std::vector<std::vector<float>> rows;
  int32_t n = int32_t(prompt.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto r = e.step({StepItem{id, n, false, true}});
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    const float* lg = e.last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab);
    rows.emplace_back(lg, lg + vocab);
    n = 1;
  }
  REQUIRE(e.release(id).ok());
  return rows;
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return a.size() == b.size() ? m : INFINITY;
}

// Tensor-parallel comparisons: the same work on any engine, teacher-forced logits over a
// fixed continuation (so the positions compared are the same whatever each engine would
// pick), then a free greedy run.
struct Run {
  std::vector<std::vector<float>> logits;  // teacher-forced rows
  std::vector<int32_t> greedy;             // free-running greedy tokens
};
inline Run run_model(Engine& e) {
  const int32_t vocab = e.spec().vocab;
  Run out;
  const auto prompt = prompt_of(40, 3, vocab);
  const auto forced = prompt_of(30, 11, vocab);
  out.logits = teacher_forced_logits(e, 1, prompt, forced);
  out.greedy = greedy(e, 2, prompt_of(33, 5, vocab), 24);
  return out;
}

// A decode schedule that moves between graph buckets: 3 sequences decode `steps` steps,
// 2 more join (batch 5), then 2 leave (batch 3 again). Prompts of `prompt_len` tokens,
// prefilled one sequence per step; every decode step asks for logits. `sampling` (seed
// offset by the sequence's rank) for every sequence. Returns every decode step's tokens
// and logits rows, in order.
struct ScheduleRun {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
  int64_t graph_steps = 0;  // decode steps whose forward pass ran as a graph
};
inline ScheduleRun run_bucket_schedule(Engine& e, const ForwardOptions& opts, int32_t prompt_len, int steps,
                                       SeqId first = 1000, const SamplingParams& sampling = SamplingParams{}) {
  ScheduleRun out;
  const int32_t vocab = e.spec().vocab;
  std::vector<SeqId> live;
  auto join = [&](SeqId id) {
    const auto prompt = prompt_of(prompt_len, int32_t(id - first), vocab);  // same prompts for any `first`
    SamplingParams sp = sampling;
    sp.seed += uint64_t(id - first);  // a stream per sequence, the same for any `first`
    REQUIRE(e.add_sequence(id, prompt, sp).ok());
    auto r = e.step({StepItem{id, prompt_len, true, false}}, opts);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    live.push_back(id);
  };
  auto decode = [&](int n) {
    for (int i = 0; i < n; ++i) {
      std::vector<StepItem> items;
      for (SeqId id : live) items.push_back(StepItem{id, 1, true, true});
      auto r = e.step(items, opts);
      INFO(r.status().ToString());
      REQUIRE(r.ok());
      out.graph_steps += e.last_timings().graph ? 1 : 0;
      for (const StepResult& x : *r) {
        REQUIRE(x.status.ok());
        REQUIRE(x.logits_row >= 0);
        out.tokens.push_back(*x.token);
        const float* lg = e.last_logits().data() + size_t(x.logits_row) * size_t(vocab);
        out.logits.insert(out.logits.end(), lg, lg + vocab);
      }
    }
  };
  for (SeqId id = first; id < first + 3; ++id) join(id);
  decode(steps);
  join(first + 3);
  join(first + 4);
  decode(steps);
  for (SeqId id : {first + 1, first + 3}) {
    REQUIRE(e.release(id).ok());
    live.erase(std::find(live.begin(), live.end(), id));
  }
  decode(steps);
  for (SeqId id : live) REQUIRE(e.release(id).ok());
  return out;
}

// Sampling parameters with every logit processor and min-p, greedy and sampled, for the
// engines' tests against the reference (sampled_tokens_match_reference).
inline std::vector<SamplingParams> processor_cases(int32_t vocab) {
  std::vector<SamplingParams> out;
  SamplingParams a;  // greedy, repetition penalty
  a.repetition_penalty = 1.3f;
  out.push_back(a);
  SamplingParams b;  // greedy, frequency and presence penalties, logit bias
  b.frequency_penalty = 0.8f;
  b.presence_penalty = 0.5f;
  b.logit_bias = {{3, 5.0f}, {10, 2.5f}, {vocab - 1, -30.0f}};
  out.push_back(b);
  SamplingParams c = SamplingParams::sampled(0.9f, 0, 1.0f, 13);  // min-p, repetition, bias
  c.min_p = 0.1f;
  c.repetition_penalty = 1.2f;
  c.logit_bias = {{5, 3.0f}};
  out.push_back(c);
  SamplingParams d = SamplingParams::sampled(1.1f, 40, 0.9f, 17);  // every one at once
  d.min_p = 0.05f;
  d.repetition_penalty = 0.9f;
  d.frequency_penalty = -0.5f;
  d.presence_penalty = 1.0f;
  d.logit_bias = {{2, -4.0f}, {vocab / 2, 6.0f}};
  out.push_back(d);
  return out;
}

// Decodes `steps` tokens of one sequence with seeded sampling, asking for logits too,
// and counts the steps whose token equals sample_token on the returned logits with a
// copy of the sequence's stream: the engine's (device) sampler against the reference.
inline std::pair<int, int> sampled_tokens_match_reference(Engine& e, const SamplingParams& sp, int steps,
                                                          SeqId id = 77) {
  const int32_t vocab = e.spec().vocab;
  const auto prompt = prompt_of(40, 5, vocab);
  REQUIRE(e.add_sequence(id, prompt, sp).ok());
  Rng ref(sp.seed);
  int32_t pending = int32_t(prompt.size());
  int equal = 0;
  std::vector<int32_t> output;
  for (int i = 0; i < steps; ++i) {
    auto r = e.step({StepItem{id, pending, true, true}});
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    // The logits a step returns are the raw ones: the processors apply here.
    const float* lg = e.last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab);
    const std::vector<float> processed = reference_processed(lg, vocab, sp, prompt, output);
    equal += sample_token(processed.data(), vocab, sp, ref) == *(*r)[0].token ? 1 : 0;
    output.push_back(*(*r)[0].token);
    pending = 1;
  }
  REQUIRE(e.release(id).ok());
  return {equal, steps};
}

}  // namespace kvfuse::testing
