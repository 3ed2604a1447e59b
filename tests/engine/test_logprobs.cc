// Logprobs through the engine: the sampled token's and the prompt tokens', against the
// CPU reference (cpu::logprobs_row) on the logits the step returns or a teacher-forced
// step computes; chunked prompts, the chunked lm_head of many prompt rows, graph
// padding, and bad requests.
#include <cmath>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/cpu/ops/sampling.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using json = nlohmann::json;

namespace {

LogprobOut reference(const float* logits, int32_t vocab, int32_t target, int32_t top_n) {
  LogprobOut o;
  cpu::logprobs_row(logits, vocab, target, top_n, o);
  return o;
}

void check_same(const TokenLogprob& got, const LogprobOut& want) {
  CHECK(got.token == want.token);
  CHECK(got.logprob == want.logprob);
  REQUIRE(int32_t(got.top.size()) == want.top_n);
  for (int32_t j = 0; j < want.top_n; ++j) {
    CHECK(got.top[size_t(j)].first == want.top_ids[j]);
    CHECK(got.top[size_t(j)].second == want.top_logprobs[j]);
  }
}

// The logprob of prompt[i + 1] given prompt[0..i], from a sequence of its own.
LogprobOut teacher_forced(Engine& e, SeqId id, const std::vector<int32_t>& prompt, int32_t i, int32_t top_n) {
  std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + i + 1);
  REQUIRE(e.add_sequence(id, prefix, SamplingParams{}).ok());
  StepItem it{id, i + 1, false, true};
  auto r = e.step({it});
  REQUIRE(r.ok());
  REQUIRE((*r)[0].status.ok());
  const LogprobOut o = reference(e.last_logits().data() + size_t((*r)[0].logits_row) * size_t(e.spec().vocab),
                                 e.spec().vocab, prompt[size_t(i) + 1], top_n);
  REQUIRE(e.release(id).ok());
  return o;
}

}  // namespace

TEST_CASE("engine logprobs: the sampled token's logprob and top-n are its logits row's log-softmax",
          "[engine][logprobs]") {
  auto e = make_engine();
  const int32_t vocab = e->spec().vocab;
  for (const SamplingParams& sp : {SamplingParams{}, SamplingParams::sampled(0.8f, 0, 0.9f, 3)}) {
    CAPTURE(sp.temperature);
    const SeqId id = sp.temperature == 0.0f ? 1 : 2;
    REQUIRE(e->add_sequence(id, prompt_of(20, 4, vocab), sp).ok());
    int32_t pending = 20;
    for (int step = 0; step < 8; ++step) {
      StepItem it{id, pending, true, true};
      it.logprobs = true;
      it.top_logprobs = step % 2 ? 5 : kMaxTopLogprobs;
      auto r = e->step({it});
      REQUIRE(r.ok());
      const StepResult& res = (*r)[0];
      REQUIRE(res.status.ok());
      REQUIRE(res.logprob.has_value());
      REQUIRE(res.prompt_logprobs.empty());
      const float* row = e->last_logits().data() + size_t(res.logits_row) * size_t(vocab);
      check_same(*res.logprob, reference(row, vocab, *res.token, it.top_logprobs));
      CHECK(res.logprob->token == *res.token);
      if (sp.temperature == 0.0f) CHECK(res.logprob->top[0].first == *res.token);
      pending = 1;
    }
    REQUIRE(e->release(id).ok());
  }
  // Without the flag, nothing.
  REQUIRE(e->add_sequence(3, prompt_of(5, 1, vocab), SamplingParams{}).ok());
  auto r = e->step({StepItem{3, 5, true}});
  REQUIRE(r.ok());
  CHECK(!(*r)[0].logprob.has_value());
  CHECK((*r)[0].prompt_logprobs.empty());
  REQUIRE(e->release(3).ok());
}

TEST_CASE("engine prompt logprobs: whole or in chunks, each is the teacher-forced logprob of the next token",
          "[engine][logprobs]") {
  // max_running_seqs 4: the logits buffer holds 4 rows, so the 39 prompt rows of one
  // step go through the lm_head in 10 chunks.
  for (const char* dtype : {"bf16", "fp8_e4m3"}) {
    CAPTURE(dtype);
    auto e = make_engine({{"kv_cache_dtype", dtype}, {"max_running_seqs", 4}});
    const int32_t vocab = e->spec().vocab;
    const std::vector<int32_t> prompt = prompt_of(40, 9, vocab);
    const int32_t top = 3;

    REQUIRE(e->add_sequence(1, prompt, SamplingParams{}).ok());
    StepItem whole{1, 40, true};
    whole.logprobs = true;
    whole.prompt_logprobs = true;
    whole.top_logprobs = top;
    auto r = e->step({whole});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    const std::vector<TokenLogprob> one = (*r)[0].prompt_logprobs;
    REQUIRE(one.size() == 39);  // the first token has no predecessor; the sampled one is logprob
    REQUIRE((*r)[0].logprob.has_value());
    for (size_t i = 0; i < one.size(); ++i) {
      CHECK(one[i].token == prompt[i + 1]);
      CHECK(one[i].logprob <= 0.0f);
      CHECK(one[i].top.size() == size_t(top));
    }

    // In 7-token chunks: the last row of each chunk predicts the next chunk's first token.
    REQUIRE(e->add_sequence(2, prompt, SamplingParams{}).ok());
    std::vector<TokenLogprob> chunked;
    for (int32_t done = 0; done < 40;) {
      const int32_t n = std::min(7, 40 - done);
      StepItem it{2, n, done + n == 40};
      it.prompt_logprobs = true;
      it.top_logprobs = top;
      auto rc = e->step({it});
      REQUIRE(rc.ok());
      REQUIRE((*rc)[0].status.ok());
      for (const auto& t : (*rc)[0].prompt_logprobs) chunked.push_back(t);
      done += n;
    }
    REQUIRE(chunked.size() == one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      CAPTURE(i);
      CHECK(chunked[i].token == one[i].token);
      CHECK(std::abs(chunked[i].logprob - one[i].logprob) <= 1e-3f);
    }

    // Teacher forcing, one sequence per prefix.
    for (int32_t i : {0, 5, 17, 38}) {
      CAPTURE(i);
      const LogprobOut want = teacher_forced(*e, 100 + SeqId(i), prompt, i, top);
      CHECK(one[size_t(i)].token == want.token);
      CHECK(std::abs(one[size_t(i)].logprob - want.logprob) <= 1e-3f);
      CHECK(one[size_t(i)].top[0].first == want.top_ids[0]);
    }
    REQUIRE(e->release(1).ok());
    REQUIRE(e->release(2).ok());
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  }
}

TEST_CASE("engine logprobs: a decode padded to its graph bucket gives the unpadded logprobs", "[engine][logprobs][graphs]") {
  auto e = make_engine();
  const int32_t vocab = e->spec().vocab;
  auto run = [&](const ForwardOptions& opts, SeqId base) {
    std::vector<TokenLogprob> out;
    for (SeqId s = 0; s < 3; ++s) REQUIRE(e->add_sequence(base + s, prompt_of(12 + int32_t(s), int32_t(s), vocab), SamplingParams{}).ok());
    std::vector<int32_t> pending = {12, 13, 14};
    for (int step = 0; step < 5; ++step) {
      std::vector<StepItem> items;
      for (SeqId s = 0; s < 3; ++s) {
        StepItem it{base + s, pending[size_t(s)], true};
        it.logprobs = s != 1;  // one row of the bucket asks nothing
        it.top_logprobs = 4;
        items.push_back(it);
      }
      auto r = e->step(items, opts);
      REQUIRE(r.ok());
      for (const StepResult& res : *r) {
        REQUIRE(res.status.ok());
        CHECK(res.logprob.has_value() == (res.id != base + 1));
        if (res.logprob) out.push_back(*res.logprob);
      }
      pending = {1, 1, 1};
    }
    for (SeqId s = 0; s < 3; ++s) REQUIRE(e->release(base + s).ok());
    return out;
  };
  ForwardOptions eager;
  eager.graphs = false;
  ForwardOptions padded;
  padded.graphs = true;
  padded.graph_replay = false;
  const auto a = run(eager, 10);
  const int64_t before = e->graph_stats().padded_eager;
  const auto b = run(padded, 20);
  CHECK(e->graph_stats().padded_eager - before == 4);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].token == b[i].token);
    CHECK(a[i].logprob == b[i].logprob);
    CHECK(a[i].top == b[i].top);
  }
}

TEST_CASE("engine logprobs: bad requests are rejected and leave no pages", "[engine][logprobs][errors]") {
  auto e = make_engine();
  REQUIRE(e->add_sequence(1, prompt_of(6, 2, e->spec().vocab), SamplingParams{}).ok());
  StepItem too_many{1, 6, true};
  too_many.logprobs = true;
  too_many.top_logprobs = kMaxTopLogprobs + 1;
  auto r = e->step({too_many});
  REQUIRE(!r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(r.status().message()).find("top logprobs") != std::string::npos);
  StepItem negative{1, 6, true};
  negative.top_logprobs = -1;
  CHECK(e->step({negative}).status().code() == absl::StatusCode::kInvalidArgument);
  StepItem unsampled{1, 6, false};
  unsampled.logprobs = true;
  r = e->step({unsampled});
  REQUIRE(!r.ok());
  CHECK(std::string(r.status().message()).find("does not sample") != std::string::npos);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  REQUIRE(e->release(1).ok());
}
