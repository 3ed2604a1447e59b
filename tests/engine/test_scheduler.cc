// Continuous batching: outputs equal direct engine stepping, preemption loses nothing,
// aborts and finishes free their pages.
#include <map>

#include "src/runtime/scheduler.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::map<SeqId, std::vector<int32_t>> run_all(Scheduler& s, int max_steps = 100000) {
  std::map<SeqId, std::vector<int32_t>> out;
  for (int i = 0; i < max_steps && s.has_work(); ++i) {
    auto ev = s.step();
    REQUIRE(ev.ok());
    for (const auto& e : *ev) {
      if (e.token) out[e.id].push_back(*e.token);
      CHECK(e.finish != FinishReason::error);
    }
  }
  REQUIRE_FALSE(s.has_work());
  return out;
}

GenerateRequest request(SeqId id, int32_t len, int32_t max_new, int32_t vocab) {
  GenerateRequest r;
  r.id = id;
  r.prompt = prompt_of(len, int32_t(id), vocab);
  r.max_new_tokens = max_new;
  return r;
}

}  // namespace

TEST_CASE("scheduler: continuous batching with chunked prefill equals one-at-a-time greedy decoding",
          "[scheduler][prefill]") {
  auto ref = make_engine();
  auto e = make_engine({{"max_batch_tokens", 48}, {"max_running_seqs", 5}});
  const int32_t vocab = e->spec().vocab;
  Scheduler s(*e);
  std::map<SeqId, std::vector<int32_t>> want;
  for (SeqId id = 0; id < 12; ++id) {
    const auto r = request(id, 10 + int32_t(id) * 9, 12, vocab);
    want[id] = greedy(*ref, 100, r.prompt, 12);
    REQUIRE(s.submit(r).ok());
  }
  CHECK(run_all(s) == want);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
  CHECK(e->num_sequences() == 0);
}

TEST_CASE("scheduler: preemption under pool pressure recomputes and loses no tokens", "[scheduler][pool]") {
  auto ref = make_engine();
  // 10 pages of 16 tokens for 6 sequences that each grow to ~70 tokens: must preempt. With
  // the prefix cache a readmitted sequence takes back the pages it computed that were not
  // evicted meanwhile; the tokens are the same either way.
  for (const char* cache : {"on", "off"}) {
    CAPTURE(cache);
    auto e = make_engine({{"num_pages", 10}, {"page_size", 16}, {"max_batch_tokens", 64}, {"prefix_cache", cache}});
    const int32_t vocab = e->spec().vocab;
    Scheduler s(*e);
    std::map<SeqId, std::vector<int32_t>> want;
    for (SeqId id = 0; id < 6; ++id) {
      const auto r = request(id, 20 + int32_t(id), 50, vocab);
      want[id] = greedy(*ref, 100, r.prompt, 50);
      REQUIRE(s.submit(r).ok());
    }
    CHECK(run_all(s) == want);
    CHECK(s.num_preemptions() > 0);
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
    CHECK((e->pool().cache_stats().hit_tokens > 0) == (std::string(cache) == "on"));
    REQUIRE(e->pool().check_invariants().ok());
  }
}

TEST_CASE("scheduler: pages are reserved and preemption decided before the step runs", "[scheduler][pool]") {
  // Under the same pool pressure, no item reaches the engine without its pages: the
  // engine never reports an exhausted pool to the scheduler.
  auto e = make_engine({{"num_pages", 10}, {"page_size", 16}, {"max_batch_tokens", 64}});
  const int32_t vocab = e->spec().vocab;
  Scheduler s(*e);
  int64_t results = 0, exhausted = 0;
  s.set_result_hook([&](std::vector<StepResult>& rs) {
    for (const StepResult& r : rs) {
      ++results;
      exhausted += r.status.code() == absl::StatusCode::kResourceExhausted ? 1 : 0;
    }
  });
  for (SeqId id = 0; id < 6; ++id) REQUIRE(s.submit(request(id, 20 + int32_t(id), 50, vocab)).ok());
  const auto out = run_all(s);
  CHECK(s.num_preemptions() > 0);
  CHECK(results > 0);
  CHECK(exhausted == 0);
  REQUIRE(out.size() == 6);
  for (const auto& [id, toks] : out) CHECK(toks.size() == 50);
}

TEST_CASE("scheduler: seeded sampling is reproducible, with and without preemption",
          "[scheduler][sampling]") {
  // The CPU backend is batch-invariant: a recomputed prefill gives the bits of the decode
  // steps it replaces, so the samples are the same with and without preemption, and the
  // same schedule reproduces them.
  const int32_t vocab = 1024;
  auto run = [&](int64_t pages) {
    auto e = make_engine({{"num_pages", pages}, {"page_size", 16}});
    Scheduler s(*e);
    for (SeqId id = 0; id < 4; ++id) {
      auto r = request(id, 30, 40, vocab);
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 50;
      r.sampling.top_p = 0.9f;
      r.sampling.seed = 1000 + id;
      REQUIRE(s.submit(r).ok());
    }
    auto out = run_all(s);
    CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
    return std::make_pair(out, s.num_preemptions());
  };
  const auto [big1, p0] = run(512);
  const auto [big2, p1] = run(512);
  const auto [small1, p2] = run(8);
  const auto [small2, p3] = run(8);
  CHECK(p0 == 0);
  CHECK(p2 > 0);
  CHECK(p2 == p3);
  CHECK(big1 == big2);
  CHECK(small1 == small2);
  CHECK(small1 == big1);
  for (const auto* out : {&big1, &small1}) {
    REQUIRE(out->size() == 4);
    for (const auto& [id, toks] : *out) CHECK(toks.size() == 40);
  }
  // Different seeds give different streams.
  CHECK(big1.at(0) != big1.at(1));
}

TEST_CASE("scheduler: abort, stop tokens and request errors", "[scheduler][errors]") {
  auto e = make_engine({{"num_pages", 16}});
  const int32_t vocab = e->spec().vocab;
  Scheduler s(*e, SchedulerLimits{3});
  CHECK(s.submit(request(1, 0, 4, vocab)).code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.submit(request(1, 4, 0, vocab)).code() == absl::StatusCode::kInvalidArgument);
  auto bad = request(1, 4, 4, vocab);
  bad.prompt[2] = vocab;
  CHECK(s.submit(bad).code() == absl::StatusCode::kInvalidArgument);
  bad = request(1, 4, 4, vocab);
  bad.sampling.temperature = -1;
  CHECK(s.submit(bad).code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.submit(request(1, 16 * 16 + 5, 4, vocab)).code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.submit(request(1, 5000, 4, vocab)).code() == absl::StatusCode::kInvalidArgument);  // > max_seq_len

  REQUIRE(s.submit(request(1, 40, 100, vocab)).ok());
  CHECK(s.submit(request(1, 4, 4, vocab)).code() == absl::StatusCode::kAlreadyExists);
  REQUIRE(s.submit(request(2, 8, 100, vocab)).ok());
  REQUIRE(s.submit(request(3, 8, 100, vocab)).ok());
  CHECK(s.submit(request(4, 8, 100, vocab)).code() == absl::StatusCode::kResourceExhausted);  // queue of 3
  REQUIRE(s.step().ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages > 0);
  CHECK(s.abort(1).ok());
  CHECK(s.abort(1).code() == absl::StatusCode::kNotFound);
  CHECK(s.abort(2).ok());
  CHECK(s.abort(3).ok());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);

  // A stop token ends the request on the step that produces it.
  auto ref = make_engine();
  const auto r = request(5, 12, 20, vocab);
  const auto toks = greedy(*ref, 100, r.prompt, 20);
  auto stopping = r;
  stopping.stop_token_ids = {toks[6]};
  REQUIRE(s.submit(stopping).ok());
  std::vector<int32_t> got;
  FinishReason reason = FinishReason::none;
  while (s.has_work()) {
    auto ev = s.step();
    REQUIRE(ev.ok());
    for (const auto& x : *ev) {
      if (x.token) got.push_back(*x.token);
      if (x.finish != FinishReason::none) reason = x.finish;
    }
  }
  const auto first = std::find(toks.begin(), toks.end(), toks[6]);
  CHECK(got == std::vector<int32_t>(toks.begin(), first + 1));
  CHECK(reason == FinishReason::stop);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("scheduler: stop rules: stop ids and EOS after min_new_tokens, then max_new_tokens", "[scheduler]") {
  const std::vector<int32_t> eos = {7, 9};
  StopRules r;
  r.stop_token_ids = {5};
  CHECK(stop_reason(r, eos, 5, 1) == FinishReason::stop);
  CHECK(stop_reason(r, eos, 9, 1) == FinishReason::stop);  // EOS stops by default
  CHECK(stop_reason(r, eos, 6, 100) == FinishReason::none);  // no limit
  r.ignore_eos = true;
  CHECK(stop_reason(r, eos, 9, 1) == FinishReason::none);
  CHECK(stop_reason(r, eos, 5, 1) == FinishReason::stop);  // stop ids still stop
  r.min_new_tokens = 3;
  CHECK(stop_reason(r, eos, 5, 2) == FinishReason::none);
  CHECK(stop_reason(r, eos, 5, 3) == FinishReason::stop);
  r.max_new_tokens = 4;
  CHECK(stop_reason(r, eos, 6, 3) == FinishReason::none);
  CHECK(stop_reason(r, eos, 6, 4) == FinishReason::length);
  CHECK(stop_reason(r, eos, 5, 4) == FinishReason::stop);  // a stop token on the last one says stop
}

TEST_CASE("scheduler: logprobs survive chunked prefill and preemption: each prompt token's once, each token's with it",
          "[scheduler][logprobs]") {
  // Prompts of 50-75 tokens in chunks of at most 8, 10 pages of 16 for 6 growing
  // sequences: prefills are chunked and requests are preempted, two of them mid-prefill
  // (recomputed from the start: without dropping what their first attempt gathered, their
  // prompt logprobs would come twice). Every request still gets its prompt logprobs exactly once, with its first
  // token, and a logprob with every token; the values are an unpressured engine's.
  auto ref = make_engine();
  auto e = make_engine({{"num_pages", 10}, {"page_size", 16}, {"max_batch_tokens", 8}});
  const int32_t vocab = e->spec().vocab;
  Scheduler s(*e);
  std::map<SeqId, GenerateRequest> reqs;
  for (SeqId id = 0; id < 6; ++id) {
    GenerateRequest r = request(id, 50 + 5 * int32_t(id), 60, vocab);
    r.logprobs.enabled = true;
    r.logprobs.prompt = true;
    r.logprobs.top_n = 2;
    reqs[id] = r;
    REQUIRE(s.submit(r).ok());
  }
  std::map<SeqId, std::vector<TokenLogprob>> prompt_lp, token_lp;
  std::map<SeqId, std::vector<int32_t>> tokens;
  std::map<SeqId, int> prompt_events;
  for (int i = 0; i < 100000 && s.has_work(); ++i) {
    auto ev = s.step();
    REQUIRE(ev.ok());
    for (const auto& x : *ev) {
      CHECK(x.finish != FinishReason::error);
      if (!x.prompt_logprobs.empty()) {
        ++prompt_events[x.id];
        CHECK(tokens[x.id].empty());  // with the first token
        prompt_lp[x.id] = x.prompt_logprobs;
      }
      if (x.token) {
        tokens[x.id].push_back(*x.token);
        REQUIRE(x.logprob.has_value());
        CHECK(x.logprob->token == *x.token);
        CHECK(x.logprob->top.size() == 2);
        token_lp[x.id].push_back(*x.logprob);
      }
    }
  }
  CHECK(s.num_preemptions() > 0);
  for (const auto& [id, r] : reqs) {
    CAPTURE(id);
    CHECK(prompt_events[id] == 1);
    REQUIRE(prompt_lp[id].size() == r.prompt.size() - 1);
    CHECK(tokens[id].size() == 60);
    // The reference: the whole prompt in one step, then greedy decoding, on its own.
    REQUIRE(ref->add_sequence(1000 + id, r.prompt, SamplingParams{}).ok());
    StepItem it{1000 + id, int32_t(r.prompt.size()), true};
    it.logprobs = it.prompt_logprobs = true;
    it.top_logprobs = 2;
    for (size_t k = 0; k < tokens[id].size(); ++k) {
      auto res = ref->step({it});
      REQUIRE(res.ok());
      const StepResult& sr = (*res)[0];
      if (k == 0) {
        for (size_t j = 0; j < sr.prompt_logprobs.size(); ++j) {
          CHECK(prompt_lp[id][j].token == r.prompt[j + 1]);
          CHECK(std::abs(prompt_lp[id][j].logprob - sr.prompt_logprobs[j].logprob) <= 1e-3f);
        }
      }
      CHECK(*sr.token == tokens[id][k]);
      CHECK(std::abs(sr.logprob->logprob - token_lp[id][k].logprob) <= 1e-3f);
      it.num_tokens = 1;
      it.prompt_logprobs = false;
    }
    REQUIRE(ref->release(1000 + id).ok());
  }
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}

TEST_CASE("scheduler: a prompt filling the pool is refused at submit - its first sampled token needs a slot",
          "[scheduler][pool][errors]") {
  // 2 pages of 16 tokens. A 32-token prompt fills them, but the token sampled after its
  // prefill is written at position 32 by the next step, and no page is left for it: the
  // request can never finish, so submit refuses it instead of failing it at its first
  // decode. Only a prompt whose length is a multiple of the page size needs the page.
  auto ref = make_engine();
  auto e = make_engine({{"num_pages", 2}, {"page_size", 16}});
  const int32_t vocab = e->spec().vocab;
  Scheduler s(*e);
  const absl::Status full = s.submit(request(1, 32, 4, vocab));
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(full.message()),
             Catch::Matchers::ContainsSubstring("needs more KV pages than the pool holds"));
  CHECK_FALSE(s.has_work());
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);

  // One token shorter, it fits: 31 prompt tokens and the first sampled one fill the two
  // pages, and the second sampled token is never written.
  const GenerateRequest fits = request(2, 31, 2, vocab);
  const auto want = greedy(*ref, 100, fits.prompt, 2);
  REQUIRE(s.submit(fits).ok());
  std::vector<int32_t> got;
  FinishReason reason = FinishReason::none;
  for (int i = 0; i < 10 && s.has_work(); ++i) {
    auto ev = s.step();
    REQUIRE(ev.ok());
    for (const auto& x : *ev) {
      INFO("request " << x.id << ": " << x.status.ToString());
      CHECK(x.id == 2);
      CHECK(x.status.ok());
      if (x.token) got.push_back(*x.token);
      if (x.finish != FinishReason::none) reason = x.finish;
    }
  }
  CHECK_FALSE(s.has_work());
  CHECK(got == want);
  CHECK(reason == FinishReason::length);
  CHECK(s.num_preemptions() == 0);
  CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
}
