// Logprobs over gRPC: Prefill's sampled and prompt tokens', Decode's per step, Generate's
// per streamed token, against the engine's own values in-process; bad parameters are
// INVALID_ARGUMENT naming the field and leave the server serving with no page held.
// Generate's logit processors and min-p give the in-process engine's tokens.
#include <cmath>
#include <functional>

#include "kernels/cpu/ops/sampling.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::vector<int32_t> ids(const google::protobuf::RepeatedField<int32_t>& r) { return {r.begin(), r.end()}; }

// The engine's logprobs for `prompt` and its first sampled token, in-process.
StepResult engine_logprobs(const std::vector<int32_t>& prompt, int32_t top_n) {
  auto e = Engine::create(test_config());
  REQUIRE(e.ok());
  REQUIRE((*e)->add_sequence(1, prompt, SamplingParams{}).ok());
  StepItem it{1, int32_t(prompt.size()), true};
  it.logprobs = true;
  it.prompt_logprobs = true;
  it.top_logprobs = top_n;
  auto r = (*e)->step({it});
  REQUIRE(r.ok());
  REQUIRE((*r)[0].status.ok());
  return (*r)[0];
}

void check_close(const v1::TokenLogprob& got, const TokenLogprob& want) {
  CHECK(got.token_id() == want.token);
  CHECK(std::abs(got.logprob() - want.logprob) <= 1e-4f);
  REQUIRE(size_t(got.top_size()) == want.top.size());
  for (int j = 0; j < got.top_size(); ++j) {
    CHECK(got.top(j).token_id() == want.top[size_t(j)].first);
    CHECK(std::abs(got.top(j).logprob() - want.top[size_t(j)].second) <= 1e-4f);
  }
}

void check_shape(const v1::TokenLogprob& t, int32_t token, int top_n, bool greedy) {
  CHECK(t.token_id() == token);
  CHECK(t.logprob() <= 0.0f);
  REQUIRE(t.top_size() == top_n);
  for (int j = 1; j < top_n; ++j) CHECK(t.top(j).logprob() <= t.top(j - 1).logprob());
  if (greedy && top_n > 0) {
    CHECK(t.top(0).token_id() == token);
    CHECK(t.top(0).logprob() == t.logprob());
  }
}

}  // namespace

TEST_CASE("server: logprobs on Prefill, Decode and Generate are the engine's", "[server][logprobs]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(5, 24);
  const StepResult want = engine_logprobs(prompt, 3);

  // Prefill: the sampled token's and the prompt's (every token but the first).
  v1::PrefillRequest pre;
  auto* lp = add_prefill(pre, 500, prompt)->mutable_logprobs();
  lp->set_enabled(true);
  lp->set_top_n(3);
  lp->set_prompt(true);
  add_prefill(pre, 501, prompt);  // asks for none
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  REQUIRE(pr.results(0).status().code() == v1::SequenceStatus::OK);
  const v1::PrefillResult& r0 = pr.results(0);
  check_shape(r0.logprob(), r0.token_id(), 3, true);
  check_close(r0.logprob(), *want.logprob);
  REQUIRE(r0.prompt_logprobs_size() == 23);
  for (int i = 0; i < 23; ++i) {
    CAPTURE(i);
    CHECK(r0.prompt_logprobs(i).token_id() == prompt[size_t(i) + 1]);
    check_close(r0.prompt_logprobs(i), want.prompt_logprobs[size_t(i)]);
  }
  CHECK(!pr.results(1).has_logprob());
  CHECK(pr.results(1).prompt_logprobs_size() == 0);

  // Decode: one per step; the other sequence still none.
  v1::DecodeRequest dec;
  dec.set_steps(6);
  for (uint64_t id : {500, 501}) {
    auto* s = dec.add_sequences();
    s->set_id(id);
    s->set_expected_len(uint32_t(prompt.size()) + 1);
  }
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  REQUIRE(dr.results(0).status().code() == v1::SequenceStatus::OK);
  REQUIRE(dr.results(0).token_ids_size() == 6);
  REQUIRE(dr.results(0).logprobs_size() == 6);
  for (int i = 0; i < 6; ++i) check_shape(dr.results(0).logprobs(i), dr.results(0).token_ids(i), 3, true);
  CHECK(dr.results(1).logprobs_size() == 0);
  CHECK(ids(dr.results(1).token_ids()) == ids(dr.results(0).token_ids()));  // the same prompt, greedy

  // A replay returns the earlier attempt's tokens with their logprobs: the first answer.
  v1::DecodeResponse again;
  REQUIRE(t.decode(dec, &again).ok());
  CHECK(again.SerializeAsString() == dr.SerializeAsString());

  // Decode replaces the parameters: top_n 1, then off.
  v1::DecodeRequest more;
  more.set_steps(2);
  auto* ms = more.add_sequences();
  ms->set_id(500);
  ms->mutable_logprobs()->set_enabled(true);
  ms->mutable_logprobs()->set_top_n(1);
  v1::DecodeResponse mr;
  REQUIRE(t.decode(more, &mr).ok());
  REQUIRE(mr.results(0).logprobs_size() == 2);
  check_shape(mr.results(0).logprobs(1), mr.results(0).token_ids(1), 1, true);
  ms->mutable_logprobs()->set_enabled(false);
  REQUIRE(t.decode(more, &mr).ok());
  CHECK(mr.results(0).logprobs_size() == 0);
  REQUIRE(t.release({500, 501}).ok());

  // Generate: one per token, the prompt's on the first message with a token.
  v1::GenerateRequest g = generate_request(prompt, 5);
  g.mutable_logprobs()->set_enabled(true);
  g.mutable_logprobs()->set_top_n(3);
  g.mutable_logprobs()->set_prompt(true);
  const StreamResult s = generate(*t.stub, g);
  REQUIRE(s.status.ok());
  REQUIRE(s.tokens.size() == 5);
  REQUIRE(s.logprobs.size() == 5);
  check_close(s.logprobs[0], *want.logprob);
  for (size_t i = 0; i < 5; ++i) check_shape(s.logprobs[i], s.tokens[i], 3, true);
  CHECK(s.prompt_logprobs_message == 0);
  REQUIRE(s.prompt_logprobs.size() == 23);
  for (size_t i = 0; i < 23; ++i) check_close(s.prompt_logprobs[i], want.prompt_logprobs[i]);
  // Without the parameters, none.
  const StreamResult plain = generate(*t.stub, generate_request(prompt, 3));
  CHECK(plain.logprobs.empty());
  CHECK(plain.prompt_logprobs.empty());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: logprobs top_n above 20 is INVALID_ARGUMENT naming the field - the server serves on",
          "[server][logprobs][errors]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(6, 8);
  {
    v1::PrefillRequest bad;
    add_prefill(bad, 600, prompt)->mutable_logprobs()->set_top_n(21);
    v1::PrefillResponse br;
    const grpc::Status st = t.prefill(bad, &br);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("logprobs.top_n 21 exceeds the limit of 20"));
  }
  v1::PrefillRequest ok;
  add_prefill(ok, 601, prompt);
  v1::PrefillResponse okr;
  REQUIRE(t.prefill(ok, &okr).ok());
  {
    v1::DecodeRequest bad;
    auto* s = bad.add_sequences();
    s->set_id(601);
    s->mutable_logprobs()->set_top_n(1000);
    v1::DecodeResponse br;
    const grpc::Status st = t.decode(bad, &br);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("logprobs.top_n 1000"));
  }
  {
    v1::GenerateRequest g = generate_request(prompt, 4);
    g.mutable_logprobs()->set_top_n(21);
    const StreamResult s = generate(*t.stub, g);
    CHECK(s.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.status.error_message(), Catch::Matchers::ContainsSubstring("logprobs.top_n 21"));
  }
  // Still serving: the sequence decodes, and nothing is left behind.
  v1::DecodeRequest dec;
  dec.add_sequences()->set_id(601);
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  CHECK(dr.results(0).status().code() == v1::SequenceStatus::OK);
  REQUIRE(t.release({601}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: Generate's logit processors and min_p shape the tokens as the engine's - logprobs stay raw",
          "[server][logprobs][sampling]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(7, 16);
  auto e = Engine::create(test_config());
  REQUIRE(e.ok());
  const int32_t vocab = (*e)->spec().vocab;
  // Every processor at once, sampled with min-p: the server's tokens are the in-process
  // engine's for the same parameters and seed.
  SamplingParams sp = SamplingParams::sampled(0.9f, 0, 0.95f, 23);
  sp.min_p = 0.05f;
  sp.repetition_penalty = 1.5f;
  sp.frequency_penalty = 0.7f;
  sp.presence_penalty = 0.4f;
  sp.logit_bias = {{3, 4.0f}, {11, -8.0f}};
  REQUIRE((*e)->add_sequence(1, prompt, sp).ok());
  std::vector<int32_t> want;
  int32_t pending = int32_t(prompt.size());
  for (int i = 0; i < 8; ++i) {
    auto r = (*e)->step({StepItem{1, pending, true}});
    REQUIRE(r.ok());
    want.push_back(*(*r)[0].token);
    pending = 1;
  }
  v1::GenerateRequest g = generate_request(prompt, 8);
  g.set_ignore_eos(true);
  v1::SamplingParams* p = g.mutable_sampling();
  p->set_temperature(0.9f);
  p->set_top_p(0.95f);
  p->set_seed(23);
  p->set_min_p(0.05f);
  p->set_repetition_penalty(1.5f);
  p->set_frequency_penalty(0.7f);
  p->set_presence_penalty(0.4f);
  (*p->mutable_logit_bias())[3] = 4.0f;
  (*p->mutable_logit_bias())[11] = -8.0f;
  const StreamResult s = generate(*t.stub, g);
  REQUIRE(s.status.ok());
  CHECK(s.tokens == want);

  // A +100 bias makes a token every greedy pick; its logprob is the raw distribution's.
  v1::GenerateRequest b = generate_request(prompt, 4);
  b.set_ignore_eos(true);
  (*b.mutable_sampling()->mutable_logit_bias())[9] = 100.0f;
  b.mutable_logprobs()->set_enabled(true);
  const StreamResult sb = generate(*t.stub, b);
  REQUIRE(sb.status.ok());
  CHECK(sb.tokens == std::vector<int32_t>(4, 9));
  REQUIRE((*e)->add_sequence(2, prompt, SamplingParams{}).ok());
  auto r = (*e)->step({StepItem{2, int32_t(prompt.size()), true, true}});
  REQUIRE(r.ok());
  LogprobOut raw;
  cpu::logprobs_row((*e)->last_logits().data() + size_t((*r)[0].logits_row) * size_t(vocab), vocab, 9, 0, raw);
  REQUIRE(sb.logprobs.size() == 4);
  CHECK(std::abs(sb.logprobs[0].logprob() - raw.logprob) <= 1e-4f);
  CHECK(sb.logprobs[0].logprob() < -0.01f);  // not the biased distribution's ~0

  // Bad values are INVALID_ARGUMENT naming the field; the server serves on.
  using Mut = std::function<void(v1::SamplingParams&)>;
  const std::vector<std::pair<const char*, Mut>> bad = {
      {"min_p", [](auto& q) { q.set_min_p(1.5f); }},
      {"repetition_penalty", [](auto& q) { q.set_repetition_penalty(0.0f); }},
      {"frequency_penalty", [](auto& q) { q.set_frequency_penalty(2.5f); }},
      {"presence_penalty", [](auto& q) { q.set_presence_penalty(NAN); }},
      {"logit_bias: token", [](auto& q) { (*q.mutable_logit_bias())[1 << 20] = 1.0f; }},
      {"logit_bias: the bias", [](auto& q) { (*q.mutable_logit_bias())[4] = 250.0f; }},
  };
  for (const auto& [field, mutate] : bad) {
    INFO(field);
    v1::GenerateRequest q = generate_request(prompt, 4);
    mutate(*q.mutable_sampling());
    const StreamResult sq = generate(*t.stub, q);
    CHECK(sq.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(sq.status.error_message(), Catch::Matchers::ContainsSubstring(field));
    CHECK(sq.messages == 0);
  }
  CHECK(generate(*t.stub, generate_request(prompt, 2)).status.ok());
  CHECK(t.wait_all_pages_free());
}
