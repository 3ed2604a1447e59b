// smg's SGLang Generate against kvfuse.v1 Generate on the same server: the same tokens
// for the same prompt, seed and parameters (greedy and sampled, streamed and not), the
// chunks' shape, stop and EOS tokens, logprobs, the prefix cache's cached_tokens, Abort,
// request ids and retries; no KV page outlives its request.
#include <cstdio>
#include <future>
#include <map>

#include "absl/strings/str_cat.h"

#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/run_command.h"
#include "tests/util/sglang_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// The kvfuse.v1 request that `req` maps onto (docs/sglang.md#sampling-parameters).
v1::GenerateRequest v1_twin(const sgl::GenerateRequest& req, uint64_t seed) {
  const sgl::SamplingParams& p = req.sampling_params();
  std::vector<int32_t> prompt(req.tokenized().input_ids().begin(), req.tokenized().input_ids().end());
  v1::GenerateRequest g = generate_request(prompt, p.max_new_tokens());
  v1::SamplingParams* s = g.mutable_sampling();
  s->set_temperature(p.temperature());
  s->set_top_k(p.top_k() < 0 ? 0 : p.top_k());
  s->set_top_p(p.top_p());
  s->set_min_p(p.min_p());
  s->set_repetition_penalty(p.repetition_penalty());
  s->set_presence_penalty(p.presence_penalty());
  s->set_frequency_penalty(p.frequency_penalty());
  for (const auto& [k, v] : p.logit_bias()) (*s->mutable_logit_bias())[std::stoi(k)] = v;
  s->set_seed(seed);
  return g;
}

std::vector<int32_t> as_ints(const std::vector<uint32_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

}  // namespace

TEST_CASE("sglang: Generate gives kvfuse.v1 Generate's tokens, greedy and sampled, streamed or not",
          "[server][sglang]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  struct Case {
    const char* name;
    std::function<void(sgl::GenerateRequest&)> edit;
    uint64_t seed;
  };
  const std::vector<Case> cases = {
      {"greedy", [](sgl::GenerateRequest&) {}, 0},
      {"smg's defaults (temperature 1, no seed: 0)",
       [](sgl::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(1.0f); }, 0},
      {"sampled with a seed and every processor",
       [](sgl::GenerateRequest& r) {
         sgl::SamplingParams* p = r.mutable_sampling_params();
         p->set_temperature(0.8f);
         p->set_top_k(40);
         p->set_top_p(0.9f);
         p->set_min_p(0.05f);
         p->set_repetition_penalty(1.1f);
         p->set_presence_penalty(0.3f);
         p->set_frequency_penalty(0.2f);
         (*p->mutable_logit_bias())["5"] = 2.0f;
         set_seed(r, 7);
       },
       7},
  };
  int n = 0;
  for (const Case& c : cases) {
    for (bool stream : {true, false}) {
      INFO(c.name << (stream ? ", streamed" : ", one complete"));
      ++n;
      sgl::GenerateRequest req = sglang_request(absl::StrCat("same-", n), test_prompt(n, 21), 12, stream);
      c.edit(req);
      const StreamResult want = generate(*t.stub, v1_twin(req, c.seed));
      REQUIRE(want.status.ok());
      REQUIRE(want.tokens.size() == 12);
      const SglangResult got = sglang_generate(*stub, req);
      REQUIRE(got.status.ok());
      CHECK(got.output_ids() == want.tokens);
      CHECK(got.complete().finish_reason() == "length");
      CHECK(got.complete().matched_stop_case() == sgl::GenerateComplete::MATCHED_STOP_NOT_SET);
      CHECK(got.complete().prompt_tokens() == 21);
      CHECK(got.complete().completion_tokens() == 12);
      CHECK_FALSE(got.complete().has_output_logprobs());
      for (const std::string& id : got.request_ids) CHECK(id == req.request_id());
      if (stream) {
        CHECK(as_ints(got.chunk_tokens) == want.tokens);
        uint32_t seen = 0;
        for (const auto& ch : got.chunks) {
          seen += uint32_t(ch.token_ids_size());
          CHECK(ch.completion_tokens() == seen);  // cumulative
          CHECK(ch.prompt_tokens() == 21);
        }
      } else {
        CHECK(got.chunks.empty());
      }
    }
  }
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("sglang: stream_interval sends chunks of that many tokens, the rest in the last",
          "[server][sglang]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  sgl::GenerateRequest req = sglang_request("interval", test_prompt(3, 9), 10);
  req.mutable_sampling_params()->set_stream_interval(4);
  const SglangResult got = sglang_generate(*stub, req);
  REQUIRE(got.status.ok());
  std::vector<int> sizes;
  for (const auto& ch : got.chunks) sizes.push_back(ch.token_ids_size());
  CHECK(sizes == std::vector<int>{4, 4, 2});
  CHECK(got.chunks.back().completion_tokens() == 10);
  CHECK(as_ints(got.chunk_tokens) == got.output_ids());
}

TEST_CASE("sglang: a stop token ends the request, with matched_token_id, and min_new_tokens holds it off",
          "[server][sglang]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  const std::vector<int32_t> prompt = test_prompt(4, 15);
  const std::vector<int32_t> greedy = sglang_generate(*stub, sglang_request("free", prompt, 12)).output_ids();
  REQUIRE(greedy.size() == 12);
  size_t k = 0;  // the first token from index 2 on that has not come before it
  for (size_t j = 2; j < greedy.size() && k == 0; ++j) {
    if (std::find(greedy.begin(), greedy.begin() + long(j), greedy[j]) == greedy.begin() + long(j)) k = j;
  }
  REQUIRE(k != 0);
  sgl::GenerateRequest req = sglang_request("stop", prompt, 12);
  req.mutable_sampling_params()->add_stop_token_ids(uint32_t(greedy[k]));
  const SglangResult got = sglang_generate(*stub, req);
  REQUIRE(got.status.ok());
  CHECK(got.output_ids() == std::vector<int32_t>(greedy.begin(), greedy.begin() + long(k) + 1));
  CHECK(got.complete().finish_reason() == "stop");
  REQUIRE(got.complete().matched_stop_case() == sgl::GenerateComplete::kMatchedTokenId);
  CHECK(got.complete().matched_token_id() == uint32_t(greedy[k]));
  // min_new_tokens past k: the stop token does not end it there.
  req.set_request_id("stop-later");
  req.mutable_sampling_params()->set_min_new_tokens(uint32_t(k) + 2);
  const SglangResult later = sglang_generate(*stub, req);
  REQUIRE(later.status.ok());
  CHECK(later.output_ids().size() > k + 1);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("sglang: the checkpoint's EOS ends a request (matched_token_id) unless ignore_eos",
          "[server][sglang][checkpoint]") {
  TempDir dir;
  export_synthetic(dir.path(), mini_spec("llama"), 3);
  const std::vector<std::string> cfg = {"model_path=" + dir.path()};
  const std::vector<int32_t> prompt = prompt_of(12, 5, mini_spec().vocab);
  const std::vector<int32_t> greedy = expected_tokens(test_config(cfg), {prompt}, 9)[0];
  size_t k = 0;
  for (size_t j = 3; j < greedy.size() && k == 0; ++j) {
    if (std::find(greedy.begin(), greedy.begin() + long(j), greedy[j]) == greedy.begin() + long(j)) k = j;
  }
  REQUIRE(k != 0);
  write_file(dir / "generation_config.json", "{\"eos_token_id\": [" + std::to_string(greedy[k]) + "]}");
  auto t = TestServer::start(cfg);
  auto stub = sglang_stub(t);
  const SglangResult eos = sglang_generate(*stub, sglang_request("eos", prompt, 9, false));
  REQUIRE(eos.status.ok());
  CHECK(eos.output_ids() == std::vector<int32_t>(greedy.begin(), greedy.begin() + long(k) + 1));
  CHECK(eos.complete().finish_reason() == "stop");
  CHECK(eos.complete().matched_token_id() == uint32_t(greedy[k]));
  sgl::GenerateRequest on = sglang_request("ignore", prompt, 9, false);
  on.mutable_sampling_params()->set_ignore_eos(true);
  const SglangResult ignored = sglang_generate(*stub, on);
  REQUIRE(ignored.status.ok());
  CHECK(ignored.output_ids() == greedy);
  CHECK(ignored.complete().finish_reason() == "length");
}

TEST_CASE("sglang: logprobs are kvfuse.v1's: output and top per token, input from logprob_start_len",
          "[server][sglang][logprobs]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  const std::vector<int32_t> prompt = test_prompt(6, 18);
  v1::GenerateRequest v1req = generate_request(prompt, 6);
  v1req.mutable_logprobs()->set_enabled(true);
  v1req.mutable_logprobs()->set_top_n(3);
  v1req.mutable_logprobs()->set_prompt(true);
  const StreamResult want = generate(*t.stub, v1req);
  REQUIRE(want.status.ok());
  REQUIRE(want.logprobs.size() == 6);
  REQUIRE(want.prompt_logprobs.size() == prompt.size() - 1);
  for (int start : {0, 5}) {
    for (bool stream : {true, false}) {
      INFO("logprob_start_len " << start << (stream ? ", streamed" : ", one complete"));
      sgl::GenerateRequest req = sglang_request(absl::StrCat("lp-", start, stream), prompt, 6, stream);
      req.set_return_logprob(true);
      req.set_top_logprobs_num(3);
      req.set_logprob_start_len(start);
      const SglangResult got = sglang_generate(*stub, req);
      REQUIRE(got.status.ok());
      CHECK(got.output_ids() == want.tokens);
      const sgl::OutputLogProbs& out = got.complete().output_logprobs();
      REQUIRE(out.token_logprobs_size() == 6);
      REQUIRE(out.top_logprobs_size() == 6);
      for (int i = 0; i < 6; ++i) {
        CHECK(out.token_ids(i) == uint32_t(want.logprobs[size_t(i)].token_id()));
        CHECK(out.token_logprobs(i) == want.logprobs[size_t(i)].logprob());
        REQUIRE(out.top_logprobs(i).values_size() == 3);
        for (int j = 0; j < 3; ++j) {
          CHECK(out.top_logprobs(i).token_ids(j) == uint32_t(want.logprobs[size_t(i)].top(j).token_id()));
          CHECK(out.top_logprobs(i).values(j) == want.logprobs[size_t(i)].top(j).logprob());
        }
      }
      const sgl::InputLogProbs& in = got.complete().input_logprobs();
      REQUIRE(in.token_ids_size() == int(prompt.size()) - start);
      for (int i = start; i < int(prompt.size()); ++i) {
        const int at = i - start;
        CHECK(in.token_ids(at) == uint32_t(prompt[size_t(i)]));
        if (i == 0) {
          CHECK_FALSE(in.token_logprobs(at).has_value());  // the first token has none
        } else {
          REQUIRE(in.token_logprobs(at).has_value());
          CHECK(in.token_logprobs(at).value() == want.prompt_logprobs[size_t(i) - 1].logprob());
          CHECK(in.top_logprobs(at).token_ids(0) == uint32_t(want.prompt_logprobs[size_t(i) - 1].top(0).token_id()));
        }
      }
      if (stream) {
        // Incremental in the chunks, the input logprobs in the first.
        std::vector<float> streamed;
        for (const auto& ch : got.chunks) {
          for (float v : ch.output_logprobs().token_logprobs()) streamed.push_back(v);
        }
        CHECK(streamed == std::vector<float>(out.token_logprobs().begin(), out.token_logprobs().end()));
        CHECK(got.chunks.front().input_logprobs().token_ids_size() == in.token_ids_size());
        for (size_t c = 1; c < got.chunks.size(); ++c) CHECK_FALSE(got.chunks[c].has_input_logprobs());
      }
    }
  }
  // return_logprob alone: output logprobs without top entries, no input logprobs.
  sgl::GenerateRequest plain = sglang_request("lp-plain", prompt, 6, false);
  plain.set_return_logprob(true);
  const SglangResult got = sglang_generate(*stub, plain);
  REQUIRE(got.status.ok());
  CHECK(got.complete().output_logprobs().token_logprobs_size() == 6);
  CHECK(got.complete().output_logprobs().top_logprobs_size() == 0);
  CHECK_FALSE(got.complete().has_input_logprobs());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("sglang: a second request with the same long prompt reports the prefix cache's cached_tokens",
          "[server][sglang][prefix]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  const std::vector<int32_t> prompt = test_prompt(12, 40);
  const SglangResult first = sglang_generate(*stub, sglang_request("cache-1", prompt, 4));
  REQUIRE(first.status.ok());
  CHECK(first.complete().cached_tokens() == 0);
  const SglangResult second = sglang_generate(*stub, sglang_request("cache-2", prompt, 4));
  REQUIRE(second.status.ok());
  CHECK(second.complete().cached_tokens() == 32);  // two whole pages of 16 of the 39 before the last
  CHECK(second.chunks.front().cached_tokens() == 32);
  CHECK(second.output_ids() == first.output_ids());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("sglang: Abort ends a live stream with finish_reason abort, and an unknown or ended id gets success=false",
          "[server][sglang][abort]") {
  StepGate gate;
  auto t = TestServer::start({}, [&](server::ServerOptions& o) { o.loop.result_hook = gate.hook(); });
  auto stub = sglang_stub(t);
  const uint32_t max_new = 500;
  std::promise<void> first_token;
  auto run = std::async(std::launch::async, [&] {
    return sglang_generate(*stub, sglang_request("to-abort", test_prompt(8, 10), max_new), 60, [&](int n) {
      if (n == 1) {
        gate.closed = true;  // the request stays live
        first_token.set_value();
      }
    });
  });
  REQUIRE(first_token.get_future().wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  // A live id is taken: a second request with it is ALREADY_EXISTS.
  const SglangResult dup = sglang_generate(*stub, sglang_request("to-abort", test_prompt(8, 10), 4));
  CHECK(dup.status.error_code() == grpc::StatusCode::ALREADY_EXISTS);
  CHECK_THAT(dup.status.error_message(), Catch::Matchers::ContainsSubstring("request_id"));
  // The Abort is queued while the loop is held; it runs at the loop's next turn.
  auto abort = std::async(std::launch::async, [&] {
    sgl::AbortRequest req;
    req.set_request_id("to-abort");
    req.set_reason("test");
    sgl::AbortResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(60));
    const grpc::Status st = stub->Abort(&ctx, req, &resp);
    return std::pair{st, resp};
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  gate.closed = false;
  const auto [abort_status, abort_resp] = abort.get();
  REQUIRE(abort_status.ok());
  CHECK(abort_resp.success());
  const SglangResult got = run.get();
  REQUIRE(got.status.ok());
  CHECK(got.complete().finish_reason() == "abort");
  CHECK(got.complete().completion_tokens() < max_new);
  CHECK(got.complete().output_ids_size() == int(got.complete().completion_tokens()));
  for (const char* id : {"to-abort", "never-seen"}) {
    INFO(id);
    sgl::AbortRequest req;
    req.set_request_id(id);
    sgl::AbortResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(10));
    REQUIRE(stub->Abort(&ctx, req, &resp).ok());
    CHECK_FALSE(resp.success());
    CHECK_THAT(resp.message(), Catch::Matchers::ContainsSubstring("not live"));
  }
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("sglang: a retried request returns the first answer, and an empty request_id gets one made up",
          "[server][sglang]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  for (bool sampled : {false, true}) {
    INFO((sampled ? "sampled, seed 11" : "greedy"));
    sgl::GenerateRequest req = sglang_request("retry", test_prompt(9, 14), 10);
    if (sampled) {
      req.mutable_sampling_params()->set_temperature(0.9f);
      set_seed(req, 11);
    }
    const SglangResult first = sglang_generate(*stub, req);
    const SglangResult again = sglang_generate(*stub, req);  // the id has ended: a new request
    REQUIRE(first.status.ok());
    REQUIRE(again.status.ok());
    CHECK(again.output_ids() == first.output_ids());
    CHECK(as_ints(again.chunk_tokens) == as_ints(first.chunk_tokens));
  }
  sgl::GenerateRequest anon = sglang_request("", test_prompt(10, 6), 3);
  const SglangResult a = sglang_generate(*stub, anon);
  const SglangResult b = sglang_generate(*stub, anon);
  REQUIRE(a.status.ok());
  REQUIRE(b.status.ok());
  REQUIRE_FALSE(a.request_ids.empty());
  CHECK_FALSE(a.request_ids.front().empty());
  CHECK(a.request_ids.front() != b.request_ids.front());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("kvfuse-bench-serve --protocol sglang sends the same load as kvfuse.v1's", "[server][sglang][tools]") {
  // One stream, 2 conversations of 3 turns: the prompts, and what the prefix cache finds
  // of them, are the same through either protocol.
  std::map<std::string, std::pair<long long, long long>> counts;
  for (const char* protocol : {"kvfuse", "sglang"}) {
    INFO(protocol);
    auto t = TestServer::start();
    auto [rc, out] = run_command(std::string(KVFUSE_BENCH_SERVE_BIN) + " --addr " + t.server->address() +
                                 " --protocol " + protocol +
                                 " --concurrency 1 --duration-s 60 --max-requests 6 --prompt-len 8 --max-tokens 8"
                                 " --shared-prefix-len 40 --turns 3");
    INFO(out);
    CHECK(rc == 0);
    CHECK(out.find(std::string(protocol) + " protocol") != std::string::npos);
    CHECK(out.find("6 ok, 0 failed") != std::string::npos);
    CHECK(out.find("ITL   ms   p50") != std::string::npos);
    const size_t at = out.find("prefix cache  ");
    REQUIRE(at != std::string::npos);
    long long cached = -1, prompt = -1;
    REQUIRE(std::sscanf(out.c_str() + at, "prefix cache  %lld of %lld", &cached, &prompt) == 2);
    counts[protocol] = {cached, prompt};
    CHECK(t.wait_all_pages_free());
  }
  CHECK(counts["sglang"] == counts["kvfuse"]);
  CHECK(counts["sglang"].second == 2 * (48 + 64 + 80));
}
