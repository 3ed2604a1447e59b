// Retries of router calls (the rule in proto/kvfuse/v1/decode.proto, "Retries"): a
// request sent again returns the first answer — tokens, seq_len, finish_reason and
// logprobs — and changes nothing a second time; stop rules count from expected_len.
#include <tuple>

#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::vector<int32_t> ids_of(const v1::DecodeResult& r) { return {r.token_ids().begin(), r.token_ids().end()}; }

// The first greedy token from index `from` on that has not come before it: a stop token
// that ends the sequence exactly there. Returns its index.
size_t first_new_token(const std::vector<int32_t>& greedy, size_t from) {
  for (size_t j = from; j < greedy.size(); ++j) {
    if (std::find(greedy.begin(), greedy.begin() + long(j), greedy[j]) == greedy.begin() + long(j)) return j;
  }
  FAIL("no token in the greedy output is new from index " << from);
  return 0;
}

v1::DecodeRequest decode_request(uint64_t id, uint32_t expected_len, uint32_t steps) {
  v1::DecodeRequest req;
  req.set_steps(steps);
  auto* s = req.add_sequences();
  s->set_id(id);
  s->set_expected_len(expected_len);
  return req;
}

void check_same(const v1::DecodeResult& a, const v1::DecodeResult& b) {
  CHECK(a.status().code() == b.status().code());
  CHECK(ids_of(a) == ids_of(b));
  CHECK(a.seq_len() == b.seq_len());
  CHECK(a.finish_reason() == b.finish_reason());
  REQUIRE(a.logprobs_size() == b.logprobs_size());
  for (int i = 0; i < a.logprobs_size(); ++i) {
    CHECK(a.logprobs(i).SerializeAsString() == b.logprobs(i).SerializeAsString());
  }
}

}  // namespace

TEST_CASE("server replay: a retried Decode with stop rules returns the first answer and steps nothing",
          "[server][replay]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(21, 16);
  const std::vector<int32_t> greedy = expected_tokens(test_config(), {prompt}, 12)[0];
  const size_t k = first_new_token(greedy, 3);
  const uint32_t len = uint32_t(prompt.size()) + 1;  // the prompt and its sampled token

  v1::PrefillRequest pre;
  for (uint64_t id : {1, 2, 3}) add_prefill(pre, id, prompt);
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  for (int i = 0; i < 3; ++i) REQUIRE(pr.results(i).seq_len() == len);

  // 1: a stop token; 2: max_new_tokens 4 (the prefill's token was sampled before the
  // rules of this call, so 4 new ones); 3: a stop token with logprobs.
  v1::DecodeRequest stop_tok = decode_request(1, len, 40);
  stop_tok.mutable_sequences(0)->mutable_stop()->add_stop_token_ids(greedy[k]);
  v1::DecodeRequest max_new = decode_request(2, len, 10);
  max_new.mutable_sequences(0)->mutable_stop()->set_max_new_tokens(4);
  v1::DecodeRequest with_lp = decode_request(3, len, 40);
  with_lp.mutable_sequences(0)->mutable_stop()->add_stop_token_ids(greedy[k]);
  with_lp.mutable_sequences(0)->mutable_logprobs()->set_enabled(true);
  with_lp.mutable_sequences(0)->mutable_logprobs()->set_top_n(3);

  for (const auto& [req, want_tokens, want_finish] :
       {std::tuple{&stop_tok, k, v1::FINISH_REASON_STOP}, std::tuple{&max_new, size_t(4), v1::FINISH_REASON_LENGTH},
        std::tuple{&with_lp, k, v1::FINISH_REASON_STOP}}) {
    v1::DecodeResponse first, retry;
    REQUIRE(t.decode(*req, &first).ok());
    const v1::DecodeResult& r = first.results(0);
    REQUIRE(r.status().code() == v1::SequenceStatus::OK);
    CHECK(ids_of(r) == std::vector<int32_t>(greedy.begin() + 1, greedy.begin() + 1 + long(want_tokens)));
    CHECK(r.finish_reason() == want_finish);
    CHECK(r.seq_len() == len + want_tokens);
    const auto used = t.used_pages();
    REQUIRE(t.decode(*req, &retry).ok());
    check_same(retry.results(0), r);
    CHECK(t.used_pages() == used);
  }
  // The logprobs of the replayed tokens are the first attempt's.
  {
    v1::DecodeResponse again;
    REQUIRE(t.decode(with_lp, &again).ok());
    CHECK(again.results(0).logprobs_size() == int(k));
    for (const auto& lp : again.results(0).logprobs()) CHECK(lp.top_size() == 3);
  }
  // The finished sequences decode no more without new rules.
  v1::DecodeRequest plain;
  plain.add_sequences()->set_id(1);
  v1::DecodeResponse pr1;
  REQUIRE(t.decode(plain, &pr1).ok());
  CHECK(code_of(pr1.results(0).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(t.release({1, 2, 3}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server replay: stop rules of a call with expected_len count the tokens an earlier attempt sampled",
          "[server][replay]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(22, 16);
  const std::vector<int32_t> greedy = expected_tokens(test_config(), {prompt}, 12)[0];
  const uint32_t len = uint32_t(prompt.size()) + 1;
  v1::PrefillRequest pre;
  add_prefill(pre, 5, prompt);
  add_prefill(pre, 6, prompt);
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());

  // An attempt that got 3 of its steps done (steps 3 stands for a call cut off by its
  // deadline there), then the retry: 6 tokens in all, not 3 + 6.
  v1::DecodeRequest part = decode_request(5, len, 3);
  part.mutable_sequences(0)->mutable_stop()->set_max_new_tokens(6);
  v1::DecodeResponse first;
  REQUIRE(t.decode(part, &first).ok());
  REQUIRE(first.results(0).token_ids_size() == 3);
  v1::DecodeRequest whole = decode_request(5, len, 10);
  whole.mutable_sequences(0)->mutable_stop()->set_max_new_tokens(6);
  v1::DecodeResponse retry;
  REQUIRE(t.decode(whole, &retry).ok());
  REQUIRE(retry.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(ids_of(retry.results(0)) == std::vector<int32_t>(greedy.begin() + 1, greedy.begin() + 7));
  CHECK(retry.results(0).finish_reason() == v1::FINISH_REASON_LENGTH);
  CHECK(retry.results(0).seq_len() == len + 6);
  v1::DecodeResponse again;
  REQUIRE(t.decode(whole, &again).ok());
  check_same(again.results(0), retry.results(0));

  // Rules under which the earlier tokens would have ended the sequence before its last
  // one: not a retry of the call that made them.
  v1::DecodeRequest three = decode_request(6, len, 3);
  v1::DecodeResponse d3;
  REQUIRE(t.decode(three, &d3).ok());
  REQUIRE(d3.results(0).token_ids_size() == 3);
  v1::DecodeRequest other = decode_request(6, len, 5);
  other.mutable_sequences(0)->mutable_stop()->add_stop_token_ids(greedy[1]);
  v1::DecodeResponse od;
  REQUIRE(t.decode(other, &od).ok());
  CHECK(code_of(od.results(0).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(od.results(0).status().message(), Catch::Matchers::ContainsSubstring("not a retry"));
  // ... and rules that end it exactly at its last one finish it, with no step.
  other.mutable_sequences(0)->mutable_stop()->clear_stop_token_ids();
  other.mutable_sequences(0)->mutable_stop()->set_max_new_tokens(3);
  REQUIRE(t.decode(other, &od).ok());
  REQUIRE(od.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(ids_of(od.results(0)) == ids_of(d3.results(0)));
  CHECK(od.results(0).finish_reason() == v1::FINISH_REASON_LENGTH);
  CHECK(od.results(0).seq_len() == len + 3);
  REQUIRE(t.release({5, 6}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server replay: a finished sequence answers a Decode with expected_len with its finish, OK",
          "[server][replay]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(23, 16);
  v1::PrefillRequest pre;
  add_prefill(pre, 7, prompt)->mutable_stop()->set_max_new_tokens(1);  // the prefill's token ends it
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  REQUIRE(pr.results(0).finish_reason() == v1::FINISH_REASON_LENGTH);
  const uint32_t len = pr.results(0).seq_len();

  v1::DecodeResponse dr;
  REQUIRE(t.decode(decode_request(7, len, 4), &dr).ok());
  CHECK(dr.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(dr.results(0).token_ids_size() == 0);
  CHECK(dr.results(0).finish_reason() == v1::FINISH_REASON_LENGTH);
  CHECK(dr.results(0).seq_len() == len);
  // Without expected_len it is the caller's mistake.
  v1::DecodeRequest plain;
  plain.add_sequences()->set_id(7);
  REQUIRE(t.decode(plain, &dr).ok());
  CHECK(code_of(dr.results(0).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  // New rules at expected_len make it live again; their retry answers the same.
  v1::DecodeRequest revive = decode_request(7, len, 2);
  revive.mutable_sequences(0)->mutable_stop()->set_max_new_tokens(5);
  v1::DecodeResponse first, retry;
  REQUIRE(t.decode(revive, &first).ok());
  CHECK(first.results(0).token_ids_size() == 2);
  CHECK(first.results(0).finish_reason() == v1::FINISH_REASON_UNSPECIFIED);
  REQUIRE(t.decode(revive, &retry).ok());
  check_same(retry.results(0), first.results(0));
  REQUIRE(t.release({7}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server replay: a retried extend keeps its finish reason and its token's logprob",
          "[server][replay]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(24, 16);
  const std::vector<int32_t> chunk = {5, 6, 7};
  v1::PrefillRequest pre;
  for (uint64_t id : {11, 12, 13, 14}) add_prefill(pre, id, prompt);
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  const uint32_t len = pr.results(0).seq_len();
  std::vector<int32_t> whole = prompt;
  whole.push_back(pr.results(0).token_id());
  whole.insert(whole.end(), chunk.begin(), chunk.end());
  const int32_t next = expected_tokens(test_config(), {whole}, 1)[0][0];

  // 11: the token sampled is a stop token; 12: max_new_tokens 1; 13: logprobs top 3;
  // 14: no rules.
  v1::PrefillRequest ext;
  add_prefill(ext, 11, chunk, true)->mutable_stop()->add_stop_token_ids(next);
  add_prefill(ext, 12, chunk, true)->mutable_stop()->set_max_new_tokens(1);
  auto* lp = add_prefill(ext, 13, chunk, true)->mutable_logprobs();
  lp->set_enabled(true);
  lp->set_top_n(3);
  add_prefill(ext, 14, chunk, true);
  for (int i = 0; i < 4; ++i) ext.mutable_sequences(i)->set_expected_len(len);
  v1::PrefillResponse first, retry;
  REQUIRE(t.prefill(ext, &first).ok());
  const v1::FinishReason want[] = {v1::FINISH_REASON_STOP, v1::FINISH_REASON_LENGTH,
                                   v1::FINISH_REASON_UNSPECIFIED, v1::FINISH_REASON_UNSPECIFIED};
  for (int i = 0; i < 4; ++i) {
    REQUIRE(first.results(i).status().code() == v1::SequenceStatus::OK);
    CHECK(first.results(i).token_id() == next);
    CHECK(first.results(i).finish_reason() == want[i]);
  }
  REQUIRE(first.results(2).has_logprob());
  CHECK(first.results(2).logprob().top_size() == 3);
  const auto used = t.used_pages();
  REQUIRE(t.prefill(ext, &retry).ok());
  for (int i = 0; i < 4; ++i) CHECK(retry.results(i).SerializeAsString() == first.results(i).SerializeAsString());
  CHECK(t.used_pages() == used);

  // The router goes on from the retry's answer: a finished sequence stays finished.
  v1::DecodeRequest dec = decode_request(11, len + uint32_t(chunk.size()) + 1, 2);
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  CHECK(dr.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(dr.results(0).finish_reason() == v1::FINISH_REASON_STOP);
  CHECK(dr.results(0).token_ids_size() == 0);
  REQUIRE(t.release({11, 12, 13, 14}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server replay: a new sequence's Prefill with expected_len 0 answers its retry as the first time",
          "[server][replay]") {
  auto t = TestServer::start({"prefix_reuse=on"});
  const std::vector<int32_t> prompt = test_prompt(25, 40);
  // 21 first, then 22, which shares 21's whole prompt pages.
  v1::PrefillRequest pre[2];
  add_prefill(pre[0], 21, prompt)->set_expected_len(0);
  add_prefill(pre[1], 22, prompt)->set_expected_len(0);
  pre[1].mutable_sequences(0)->mutable_logprobs()->set_enabled(true);
  v1::PrefillResponse first[2];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(t.prefill(pre[i], &first[i]).ok());
    REQUIRE(first[i].results(0).status().code() == v1::SequenceStatus::OK);
  }
  CHECK(first[1].results(0).cached_tokens() > 0);
  CHECK(first[1].results(0).has_logprob());
  const auto used = t.used_pages();
  for (int i = 0; i < 2; ++i) {
    v1::PrefillResponse retry;
    REQUIRE(t.prefill(pre[i], &retry).ok());
    CHECK(retry.results(0).SerializeAsString() == first[i].results(0).SerializeAsString());
  }
  CHECK(t.used_pages() == used);
  CHECK(t.load().num_router_sequences() == 2);

  // Another prompt under a live id: ALREADY_EXISTS, as without expected_len.
  v1::PrefillRequest other;
  add_prefill(other, 21, test_prompt(26, 40))->set_expected_len(0);
  v1::PrefillResponse or_;
  REQUIRE(t.prefill(other, &or_).ok());
  CHECK(code_of(or_.results(0).status()) == grpc::StatusCode::ALREADY_EXISTS);
  // A new sequence's length before the call is 0: any other expected_len is refused.
  other.mutable_sequences(0)->set_expected_len(3);
  const grpc::Status st = t.prefill(other, &or_);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("expected_len 3 of a new sequence"));
  REQUIRE(t.release({21, 22}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server replay: a retried Release or Abort changes nothing a second time", "[server][replay]") {
  auto t = TestServer::start();
  v1::PrefillRequest pre;
  add_prefill(pre, 31, test_prompt(27, 8));
  add_prefill(pre, 32, test_prompt(28, 8));
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  v1::ReleaseResponse r1, r2;
  REQUIRE(t.release({31}, &r1).ok());
  CHECK(r1.released_size() == 1);
  REQUIRE(t.release({31}, &r2).ok());
  CHECK(r2.released_size() == 0);
  CHECK(t.load().num_router_sequences() == 1);
  for (int attempt = 0; attempt < 2; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(10));
    v1::AbortRequest req;
    req.set_id(32);
    v1::AbortResponse resp;
    const grpc::Status st = t.stub->Abort(&ctx, req, &resp);
    CHECK(st.error_code() == (attempt == 0 ? grpc::StatusCode::OK : grpc::StatusCode::NOT_FOUND));
  }
  CHECK(t.load().num_router_sequences() == 0);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: Generate's min_tokens is checked against the default max_tokens too", "[server][errors]") {
  auto t = TestServer::start();
  v1::GenerateRequest req = generate_request(test_prompt(29, 8), 0);
  req.set_min_tokens(17);
  const StreamResult r = generate(*t.stub, req);
  CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(r.status.error_message(), Catch::Matchers::ContainsSubstring("min_tokens 17 exceeds the default max_tokens 16"));
  req.set_min_tokens(16);
  const StreamResult ok = generate(*t.stub, req);
  CHECK(ok.status.ok());
  CHECK(ok.tokens.size() == 16);
  CHECK(t.wait_all_pages_free());
}
