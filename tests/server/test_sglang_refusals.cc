// What kvfuse refuses on smg's SGLang service, one check each: the status code and a
// message naming the field (or the call); a malformed request; and afterwards the server
// still serves and every KV page is back in the pool.
#include "tests/util/raw_call.h"
#include "tests/util/sglang_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// One Generate call with `body` as its raw request bytes: the call's status.
grpc::Status raw_generate(const std::shared_ptr<grpc::Channel>& ch, const std::string& body) {
  const RawReply r = raw_call(ch, "/sglang.grpc.scheduler.SglangScheduler/Generate", body, 30);
  CHECK_FALSE(r.got_message);
  return r.status;
}

}  // namespace

TEST_CASE("sglang: every field kvfuse cannot honour is refused naming it, and nothing leaks",
          "[server][sglang][errors]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  const uint64_t free_at_start = t.load().pools(0).free_pages();
  using Edit = std::function<void(sgl::GenerateRequest&)>;
  struct Case {
    const char* field;  // what the message names
    Edit edit;
  };
  auto sp = [](sgl::GenerateRequest& r) { return r.mutable_sampling_params(); };
  const std::vector<Case> cases = {
      {"mm_inputs", [](auto& r) { r.mutable_mm_inputs()->add_image_urls("http://x/y.png"); }},
      {"input_embeds", [](auto& r) { r.add_input_embeds(0.5f); }},
      {"lora_id", [](auto& r) { r.set_lora_id("adapter-1"); }},
      {"return_hidden_states", [](auto& r) { r.set_return_hidden_states(true); }},
      {"disaggregated_params", [](auto& r) { r.mutable_disaggregated_params()->set_bootstrap_host("h"); }},
      {"custom_logit_processor", [](auto& r) { r.set_custom_logit_processor("{}"); }},
      {"data_parallel_rank", [](auto& r) { r.set_data_parallel_rank(1); }},
      {"token_ids_logprob", [](auto& r) { r.add_token_ids_logprob(3); }},
      {"sampling_params.stop", [&](auto& r) { sp(r)->add_stop("</s>"); }},
      {"sampling_params.regex", [&](auto& r) { sp(r)->set_regex("[a-z]+"); }},
      {"sampling_params.json_schema", [&](auto& r) { sp(r)->set_json_schema("{}"); }},
      {"sampling_params.ebnf_grammar", [&](auto& r) { sp(r)->set_ebnf_grammar("root ::= \"a\""); }},
      {"sampling_params.structural_tag", [&](auto& r) { sp(r)->set_structural_tag("{}"); }},
      {"sampling_params.n", [&](auto& r) { sp(r)->set_n(2); }},
      {"sampling_params.custom_params[\"top_a\"]",
       [&](auto& r) { (*sp(r)->mutable_custom_params()->mutable_fields())["top_a"].set_number_value(1); }},
      {"sampling_params.custom_params[\"seed\"]", [](auto& r) { set_seed(r, 1.5); }},
      {"sampling_params.custom_params[\"seed\"]",
       [&](auto& r) { (*sp(r)->mutable_custom_params()->mutable_fields())["seed"].set_string_value("7"); }},
      {"sampling_params.logit_bias[\"five\"]", [&](auto& r) { (*sp(r)->mutable_logit_bias())["five"] = 1.0f; }},
      {"sampling_params.logit_bias", [&](auto& r) { (*sp(r)->mutable_logit_bias())["4096"] = 1.0f; }},
      {"sampling_params.temperature", [&](auto& r) { sp(r)->set_temperature(-1.0f); }},
      {"sampling_params.top_p", [&](auto& r) { sp(r)->set_top_p(2.0f); }},
      {"sampling_params.top_k", [&](auto& r) { sp(r)->set_top_k(5000); }},
      {"sampling_params.min_p", [&](auto& r) { sp(r)->set_min_p(1.5f); }},
      {"sampling_params.repetition_penalty", [&](auto& r) { sp(r)->set_repetition_penalty(3.0f); }},
      {"sampling_params.frequency_penalty", [&](auto& r) { sp(r)->set_frequency_penalty(5.0f); }},
      {"sampling_params.presence_penalty", [&](auto& r) { sp(r)->set_presence_penalty(-5.0f); }},
      {"sampling_params.max_new_tokens", [&](auto& r) { sp(r)->set_max_new_tokens(0); }},
      {"sampling_params.max_new_tokens", [&](auto& r) { sp(r)->set_max_new_tokens(1u << 20); }},
      {"sampling_params.min_new_tokens", [&](auto& r) { sp(r)->set_min_new_tokens(9); }},
      {"sampling_params.stop_token_ids", [&](auto& r) { sp(r)->add_stop_token_ids(1u << 20); }},
      {"sampling_params.stream_interval", [&](auto& r) { sp(r)->set_stream_interval(0); }},
      {"tokenized.input_ids", [](auto& r) { r.mutable_tokenized()->clear_input_ids(); }},
      {"tokenized.input_ids", [](auto& r) { r.mutable_tokenized()->set_input_ids(0, 1u << 20); }},
      {"top_logprobs_num", [](auto& r) {
         r.set_return_logprob(true);
         r.set_top_logprobs_num(21);
       }},
      {"logprob_start_len", [](auto& r) {
         r.set_return_logprob(true);
         r.set_logprob_start_len(-2);
       }},
      {"logprob_start_len", [](auto& r) {
         r.set_return_logprob(true);
         r.set_logprob_start_len(12);
       }},
  };
  for (const Case& c : cases) {
    for (bool stream : {true, false}) {
      sgl::GenerateRequest req = sglang_request("refused", test_prompt(1, 12), 8, stream);
      c.edit(req);
      INFO(c.field << (stream ? " (stream)" : "") << ": " << req.ShortDebugString());
      const SglangResult r = sglang_generate(*stub, req);
      CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(r.status.error_message(), Catch::Matchers::ContainsSubstring(c.field));
      CHECK(r.chunks.empty());
      CHECK(r.completes.empty());
    }
  }
  // A request whose bytes are no GenerateRequest (field 2, a message, cut short).
  const grpc::Status malformed = raw_generate(t.channel, std::string("\x12\x20\x10\x01", 4));
  CHECK_FALSE(malformed.ok());
  CHECK(malformed.error_code() != grpc::StatusCode::UNKNOWN);
  // The server serves on, and the refused requests took no page.
  const SglangResult ok = sglang_generate(*stub, sglang_request("refused", test_prompt(1, 12), 8));
  REQUIRE(ok.status.ok());
  CHECK(ok.output_ids().size() == 8);
  CHECK(t.wait_all_pages_free());
  CHECK(t.load().pools(0).free_pages() == free_at_start);
}

TEST_CASE("sglang: the calls kvfuse does not have are UNIMPLEMENTED naming the call, and no LoRA adapter is loaded",
          "[server][sglang][errors]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(in_seconds(10));
    return c;
  };
  auto expect = [](const grpc::Status& st, const char* rpc) {
    INFO(rpc);
    CHECK(st.error_code() == grpc::StatusCode::UNIMPLEMENTED);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring(rpc));
  };
  {
    sgl::EmbedResponse resp;
    expect(stub->Embed(ctx().get(), sgl::EmbedRequest(), &resp), "Embed");
  }
  {
    smgc::ProfileResponse resp;
    expect(stub->StartProfile(ctx().get(), smgc::StartProfileRequest(), &resp), "StartProfile");
    expect(stub->StopProfile(ctx().get(), smgc::StopProfileRequest(), &resp), "StopProfile");
  }
  {
    sgl::LoadLoRAAdapterRequest req;
    req.set_lora_name("a");
    req.set_lora_id("a");
    sgl::LoadLoRAAdapterResponse resp;
    expect(stub->LoadLoRAAdapter(ctx().get(), req, &resp), "LoadLoRAAdapter");
    sgl::UnloadLoRAAdapterResponse uresp;
    expect(stub->UnloadLoRAAdapter(ctx().get(), sgl::UnloadLoRAAdapterRequest(), &uresp), "UnloadLoRAAdapter");
  }
  sgl::ListLoadedLoRAAdaptersResponse list;
  REQUIRE(stub->ListLoadedLoRAAdapters(ctx().get(), sgl::ListLoadedLoRAAdaptersRequest(), &list).ok());
  CHECK(list.loaded_adapters_size() == 0);
}
