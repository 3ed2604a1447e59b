// The gRPC API of a real server on a loopback port: every RPC, health and reflection,
// the metrics endpoint, and the router-driven calls against the engine's own output.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <tuple>

#include "src/backends/cpu/cpu_backend.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/reflection_client.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

namespace {

HealthCheckResponse::ServingStatus health_check(grpc::Channel& ch, const std::string& service = "",
                                                grpc::Status* status = nullptr) {
  auto stub = grpc::health::v1::Health::NewStub(std::shared_ptr<grpc::Channel>(&ch, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(10));
  HealthCheckRequest req;
  req.set_service(service);
  HealthCheckResponse resp;
  const grpc::Status st = stub->Check(&ctx, req, &resp);
  if (status) *status = st;
  return resp.status();
}

std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  REQUIRE(write(fd, req.data(), req.size()) == ssize_t(req.size()));
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, size_t(n));
  close(fd);
  return resp;
}

}  // namespace

TEST_CASE("server: GetInfo reports the model, KV cache format, paths and pool", "[server]") {
  auto t = TestServer::start(
      {"num_pages=300", "kv_write=unfused", "attention=split", "k_scale=[0.5,1,2,4]", "v_scale=3"});
  grpc::ClientContext ctx;
  v1::GetInfoResponse info;
  REQUIRE(t.stub->GetInfo(&ctx, {}, &info).ok());
  CHECK(info.model() == "tiny");
  CHECK(info.vocab_size() == 1024);
  CHECK(info.kv_cache_dtype() == "fp8_e4m3");
  CHECK(info.kv_format() == "fp8_e4m3fn");  // the CPU stores OCP e4m3
  CHECK(info.page_size() == 16);
  CHECK(info.num_pages() == 300);
  CHECK(info.attention() == "split");
  CHECK(info.kv_write() == "unfused");
  CHECK(info.device().rfind("cpu", 0) == 0);
  CHECK(info.version() == KVFUSE_VERSION);
  CHECK(info.max_seq_len() == 4096);
  CHECK(info.max_decode_steps() == 256);
  // The synthetic tiny preset declares no special tokens; its max position is 8192.
  CHECK(info.eos_token_ids_size() == 0);
  CHECK_FALSE(info.has_bos_token_id());
  CHECK_FALSE(info.has_pad_token_id());
  CHECK(info.max_position() == 8192);
  // bf16 weights: two bytes a parameter.
  CHECK(info.weight_format() == "bf16");
  CHECK(info.weight_bytes() == uint64_t(2 * model_preset("tiny")->num_params()));
  // The scales in use, per layer, as the pool holds them on the device.
  REQUIRE(info.k_scale_size() == 4);
  REQUIRE(info.v_scale_size() == 4);
  CHECK(info.k_scale(0) == 0.5f);
  CHECK(info.k_scale(3) == 4.0f);
  CHECK(info.v_scale(2) == 3.0f);
  // Where the memory went (docs/design.md#device-memory): the weights as loaded, the pool
  // of 300 pages (4 layers of 16 x 2 x 64 bytes of K and of V each, and the scales), the
  // host's memory for the CPU's device.
  REQUIRE(info.has_memory());
  const v1::MemorySplit& m = info.memory();
  // The model's weights and what loads with them (the RoPE frequency table: 32 floats).
  CHECK(m.weight_bytes() == info.weight_bytes() + 32 * 4);
  CHECK(m.kv_pool_bytes() == uint64_t(300 * 4 * 2 * 16 * 2 * 64 + 4 * 4 * 4));
  CHECK(m.workspace_bytes() > 0);
  CHECK(m.graph_bytes() == 0);  // the CPU has no graphs
  CHECK(m.device_total_bytes() > 0);
  CHECK(m.device_free_bytes() > 0);
  CHECK(m.headroom_bytes() == uint64_t(2048) << 20);
  CHECK_FALSE(m.pool_sized_to_fit());
}

TEST_CASE("server: num_pages 0 takes what the device has free less the headroom, and says so", "[server]") {
  // On the CPU the device's memory is the host's: a pool sized to fit there is large; a
  // headroom of all but 1 GiB of what is available keeps it at about that (the margin
  // absorbs what other processes take meanwhile).
  auto host = host_memory();
  REQUIRE(host.ok());
  if (host->free_bytes < (int64_t(3) << 30)) {
    WARN("skipped: under 3 GiB of host memory available");
    return;
  }
  const int64_t headroom_mib = (host->free_bytes >> 20) - 1024;
  auto t = TestServer::start({"num_pages=0", "memory_headroom_mib=" + std::to_string(headroom_mib)});
  grpc::ClientContext ctx;
  v1::GetInfoResponse info;
  REQUIRE(t.stub->GetInfo(&ctx, {}, &info).ok());
  CHECK(info.memory().pool_sized_to_fit());
  CHECK(info.num_pages() > 0);
  CHECK(info.memory().kv_pool_bytes() > 0);
  CHECK(info.memory().headroom_bytes() == uint64_t(headroom_mib) << 20);
}

TEST_CASE("server: GetInfo reports FP8 weights: their scheme and bytes", "[server][fp8]") {
  auto t = TestServer::start({"model=tiny-fp8"});
  grpc::ClientContext ctx;
  v1::GetInfoResponse info;
  REQUIRE(t.stub->GetInfo(&ctx, {}, &info).ok());
  CHECK(info.model() == "tiny-fp8");
  CHECK(info.weight_format() == "preset fp8_e4m3 W8A8 (weights per channel, activations dynamic per token), 1 ignore entry");
  CHECK(info.weight_bytes() == uint64_t(model_preset("tiny-fp8")->weight_bytes()));
  CHECK(info.weight_bytes() < uint64_t(2 * model_preset("tiny")->num_params()));
}

TEST_CASE("server: health is NOT_SERVING and calls are UNAVAILABLE until the engine is warm", "[server]") {
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  auto t = TestServer::start(
      {}, [gate](server::ServerOptions& o) { o.loop.before_warmup = [gate] { gate.wait(); }; },
      /*wait=*/false);
  CHECK(health_check(*t.channel) == HealthCheckResponse::NOT_SERVING);
  CHECK(health_check(*t.channel, "kvfuse.v1.DecodeService") == HealthCheckResponse::NOT_SERVING);
  grpc::Status st;
  health_check(*t.channel, "no.such.Service", &st);
  CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);

  // A Watch stream sees NOT_SERVING now and SERVING once warm.
  auto hs = grpc::health::v1::Health::NewStub(t.channel);
  grpc::ClientContext wctx;
  wctx.set_deadline(in_seconds(30));
  HealthCheckRequest wreq;
  auto watch = hs->Watch(&wctx, wreq);
  HealthCheckResponse w;
  REQUIRE(watch->Read(&w));
  CHECK(w.status() == HealthCheckResponse::NOT_SERVING);

  {
    grpc::ClientContext ctx;
    v1::GetInfoResponse info;
    CHECK(t.stub->GetInfo(&ctx, {}, &info).error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  {
    v1::PrefillRequest req;
    add_prefill(req, 1, {1, 2, 3});
    v1::PrefillResponse resp;
    CHECK(t.prefill(req, &resp).error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  CHECK(generate(*t.stub, generate_request({1, 2, 3}, 4)).status.error_code() ==
        grpc::StatusCode::UNAVAILABLE);
  {
    grpc::ClientContext ctx;
    v1::GetLoadResponse load;
    CHECK(t.stub->GetLoad(&ctx, {}, &load).error_code() == grpc::StatusCode::UNAVAILABLE);
  }

  go.set_value();
  REQUIRE(t.server->wait_until_serving(30).ok());
  REQUIRE(watch->Read(&w));
  CHECK(w.status() == HealthCheckResponse::SERVING);
  CHECK(health_check(*t.channel) == HealthCheckResponse::SERVING);
  CHECK(t.load().serving());
  wctx.TryCancel();
  while (watch->Read(&w)) {
  }
  watch->Finish();
}

TEST_CASE("server: reflection lists and describes the services (what grpcurl needs)", "[server]") {
  auto t = TestServer::start();
  const std::string list = reflection_exchange(t.channel, string_field(7, "*"));
  CHECK(list.find("kvfuse.v1.DecodeService") != std::string::npos);
  CHECK(list.find("grpc.health.v1.Health") != std::string::npos);
  const std::string file = reflection_exchange(t.channel, string_field(4, "kvfuse.v1.DecodeService"));
  CHECK(file.find("kvfuse/v1/decode.proto") != std::string::npos);
  CHECK(file.find("PrefillRequest") != std::string::npos);
  const std::string health = reflection_exchange(t.channel, string_field(4, "grpc.health.v1.Health"));
  CHECK(health.find("grpc/health/v1/health.proto") != std::string::npos);
}

TEST_CASE("server: Prefill then Decode stream the engine's tokens and expected_len makes a retry safe",
          "[server]") {
  auto t = TestServer::start();
  const std::vector<std::vector<int32_t>> prompts = {test_prompt(1, 20), test_prompt(2, 37),
                                                     test_prompt(3, 5)};
  const auto expected = expected_tokens(test_config(), prompts, 9);

  v1::PrefillRequest pre;
  for (size_t i = 0; i < prompts.size(); ++i) add_prefill(pre, 100 + i, prompts[i]);
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  REQUIRE(pr.results_size() == 3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& r = pr.results(int(i));
    CHECK(r.id() == 100 + i);
    CHECK(r.status().code() == v1::SequenceStatus::OK);
    REQUIRE(r.has_token_id());
    CHECK(r.token_id() == expected[i][0]);
    CHECK(r.seq_len() == prompts[i].size() + 1);
  }
  CHECK(t.load().num_router_sequences() == 3);

  // 4 steps, then 4 more: the concatenation is the engine's output.
  std::vector<std::vector<int32_t>> got(3);
  for (size_t i = 0; i < 3; ++i) got[i].push_back(pr.results(int(i)).token_id());
  for (int call = 0; call < 2; ++call) {
    v1::DecodeRequest dec;
    dec.set_steps(4);
    for (size_t i = 0; i < 3; ++i) {
      auto* s = dec.add_sequences();
      s->set_id(100 + i);
      s->set_expected_len(uint32_t(prompts[i].size() + got[i].size()));
    }
    v1::DecodeResponse dr;
    REQUIRE(t.decode(dec, &dr).ok());
    for (size_t i = 0; i < 3; ++i) {
      const auto& r = dr.results(int(i));
      REQUIRE(r.status().code() == v1::SequenceStatus::OK);
      REQUIRE(r.token_ids_size() == 4);
      got[i].insert(got[i].end(), r.token_ids().begin(), r.token_ids().end());
      CHECK(r.seq_len() == prompts[i].size() + got[i].size());
    }
    if (call == 1) {
      // The same call again (the response was "lost"): the same tokens, no new step.
      v1::DecodeResponse again;
      REQUIRE(t.decode(dec, &again).ok());
      for (size_t i = 0; i < 3; ++i) {
        CHECK(std::vector<int32_t>(again.results(int(i)).token_ids().begin(),
                                   again.results(int(i)).token_ids().end()) ==
              std::vector<int32_t>(dr.results(int(i)).token_ids().begin(),
                                   dr.results(int(i)).token_ids().end()));
        CHECK(again.results(int(i)).seq_len() == dr.results(int(i)).seq_len());
      }
    }
  }
  for (size_t i = 0; i < 3; ++i) CHECK(got[i] == expected[i]);

  // A replay that is half done: 2 of 3 tokens exist, one step runs.
  {
    v1::DecodeRequest dec;
    dec.set_steps(3);
    auto* s = dec.add_sequences();
    s->set_id(100);
    s->set_expected_len(uint32_t(prompts[0].size() + got[0].size() - 2));
    v1::DecodeResponse dr;
    REQUIRE(t.decode(dec, &dr).ok());
    REQUIRE(dr.results(0).token_ids_size() == 3);
    CHECK(dr.results(0).token_ids(0) == got[0][got[0].size() - 2]);
    CHECK(dr.results(0).token_ids(1) == got[0].back());
    CHECK(dr.results(0).seq_len() == prompts[0].size() + got[0].size() + 1);
  }

  v1::ReleaseResponse rel;
  REQUIRE(t.release({100, 101, 102}, &rel).ok());
  CHECK(rel.released_size() == 3);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a chunked prefill gives the token of a one-shot prefill", "[server]") {
  auto t = TestServer::start({"max_batch_tokens=16"});  // the one-shot prompt is chunked by the scheduler too
  const auto prompt = test_prompt(7, 50);
  v1::PrefillRequest one;
  add_prefill(one, 1, prompt);
  v1::PrefillResponse r1;
  REQUIRE(t.prefill(one, &r1).ok());
  REQUIRE(r1.results(0).has_token_id());

  const std::vector<int32_t> a(prompt.begin(), prompt.begin() + 20),
      b(prompt.begin() + 20, prompt.begin() + 41), c(prompt.begin() + 41, prompt.end());
  v1::PrefillRequest p1, p2, p3;
  add_prefill(p1, 2, a, false, true);
  add_prefill(p2, 2, b, true, true);
  add_prefill(p3, 2, c, true, false);
  v1::PrefillResponse q1, q2, q3;
  REQUIRE(t.prefill(p1, &q1).ok());
  CHECK(!q1.results(0).has_token_id());
  CHECK(q1.results(0).seq_len() == 20);
  REQUIRE(t.prefill(p2, &q2).ok());
  CHECK(!q2.results(0).has_token_id());
  REQUIRE(t.prefill(p3, &q3).ok());
  REQUIRE(q3.results(0).status().code() == v1::SequenceStatus::OK);
  REQUIRE(q3.results(0).has_token_id());
  CHECK(q3.results(0).token_id() == r1.results(0).token_id());
  CHECK(q3.results(0).seq_len() == 51);
  REQUIRE(t.release({1, 2}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: Release is idempotent, Abort ends streams and sequences", "[server]") {
  auto t = TestServer::start();
  v1::PrefillRequest pre;
  add_prefill(pre, 5, test_prompt(5, 40));
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  CHECK(t.used_pages() > 0);
  v1::ReleaseResponse r1, r2;
  REQUIRE(t.release({5, 6}, &r1).ok());
  REQUIRE(r1.released_size() == 1);
  CHECK(r1.released(0) == 5);
  REQUIRE(t.release({5, 6}, &r2).ok());  // again: nothing left to free, still OK
  CHECK(r2.released_size() == 0);
  CHECK(t.used_pages() == 0);

  // Abort: unknown id, a router sequence, a running Generate stream.
  {
    grpc::ClientContext ctx;
    v1::AbortRequest req;
    req.set_id(12345);
    v1::AbortResponse resp;
    CHECK(t.stub->Abort(&ctx, req, &resp).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  REQUIRE(t.prefill(pre, &pr).ok());
  {
    grpc::ClientContext ctx;
    v1::AbortRequest req;
    req.set_id(5);
    v1::AbortResponse resp;
    CHECK(t.stub->Abort(&ctx, req, &resp).ok());
    CHECK(t.load().num_router_sequences() == 0);
  }
  std::atomic<bool> aborted{false};
  auto stream = std::async(std::launch::async, [&] {
    return generate(*t.stub, generate_request(test_prompt(9, 8), 4000, 777), 60, [&](int n) {
      if (n == 3 && !aborted.exchange(true)) {
        grpc::ClientContext ctx;
        v1::AbortRequest req;
        req.set_id(777);
        v1::AbortResponse resp;
        CHECK(t.stub->Abort(&ctx, req, &resp).ok());
      }
    });
  });
  const StreamResult r = stream.get();
  CHECK(r.status.ok());
  CHECK(r.finish == v1::FINISH_REASON_ABORT);
  CHECK(r.final_messages == 1);
  CHECK(r.request_id_header == "777");
  CHECK(r.tokens.size() < 4000);
  CHECK(r.usage.completion_tokens() == r.tokens.size());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: Generate streams tokens, then one final message with finish reason and usage",
          "[server]") {
  auto t = TestServer::start();
  const auto prompt = test_prompt(11, 12);
  const auto expected = expected_tokens(test_config(), {prompt}, 10);
  const StreamResult r = generate(*t.stub, generate_request(prompt, 10));
  REQUIRE(r.status.ok());
  CHECK(r.tokens == expected[0]);
  CHECK(r.finish == v1::FINISH_REASON_LENGTH);
  CHECK(r.final_messages == 1);
  CHECK(r.id != 0);
  CHECK(r.request_id_header == std::to_string(r.id));
  CHECK(r.usage.prompt_tokens() == 12);
  CHECK(r.usage.completion_tokens() == 10);
  CHECK(r.usage.time_to_first_token_s() > 0);
  CHECK(r.usage.e2e_latency_s() >= r.usage.time_to_first_token_s());

  // A stop token ends the request after it is streamed.
  v1::GenerateRequest req = generate_request(prompt, 10);
  req.add_stop_token_ids(expected[0][3]);
  const StreamResult s = generate(*t.stub, req);
  REQUIRE(s.status.ok());
  CHECK(s.finish == v1::FINISH_REASON_STOP);
  CHECK(s.tokens == std::vector<int32_t>(expected[0].begin(), expected[0].begin() + 4));

  // Default max_tokens is 16.
  const StreamResult d = generate(*t.stub, generate_request(prompt, 0));
  CHECK(d.tokens.size() == 16);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: /metrics serves the Prometheus metrics users know", "[server]") {
  auto t = TestServer::start({}, [](server::ServerOptions& o) { o.metrics_port = 0; });
  REQUIRE(t.server->metrics_port() > 0);
  REQUIRE(generate(*t.stub, generate_request(test_prompt(1, 8), 5)).status.ok());
  v1::PrefillRequest pre;
  add_prefill(pre, 3, test_prompt(3, 6));
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  const std::string body = http_get(t.server->metrics_port(), "/metrics");
  CHECK(body.find("200 OK") != std::string::npos);
  // Every series carries vLLM's model_name label.
  for (const char* name : {"kvfuse:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.1\"}",
                           "kvfuse:inter_token_latency_seconds_bucket{model_name=\"tiny\",le=",
                           "kvfuse:e2e_request_latency_seconds_count{model_name=\"tiny\"} 1",
                           "kvfuse:num_requests_running{model_name=\"tiny\"} 1",
                           "kvfuse:num_requests_waiting{model_name=\"tiny\"} 0",
                           "kvfuse:kv_cache_usage_perc{model_name=\"tiny\"}",
                           "kvfuse:prompt_tokens_total{model_name=\"tiny\"} 14",
                           "kvfuse:generation_tokens_total{model_name=\"tiny\"} 6",
                           "kvfuse:kv_write_path_info{model_name=\"tiny\",kv_write=\"fused\"} 1",
                           "kvfuse:step_duration_seconds_bucket{model_name=\"tiny\",le=\"0.0025\"}",
                           "kvfuse:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1",
                           "kv_format=\"fp8_e4m3fn\""}) {
    INFO(name);
    CHECK(body.find(name) != std::string::npos);
  }
  // Bucket bounds in their shortest round-trip form, as other exporters print them.
  CHECK(body.find("0.10000000000000001") == std::string::npos);
  CHECK(body.find("le=\"0.001\"") != std::string::npos);
  CHECK(body.find("le=\"+Inf\"") != std::string::npos);
  CHECK(http_get(t.server->metrics_port(), "/health").find("200 OK") != std::string::npos);
  REQUIRE(t.release({3}).ok());
}

TEST_CASE("server: the message size limit takes batches beyond gRPC's default 4 MiB", "[server]") {
  auto t = TestServer::start();
  // ~5 MiB of token ids; a duplicate id makes the server reject it after parsing it,
  // so nothing runs: INVALID_ARGUMENT proves the message got through.
  v1::PrefillRequest req;
  const auto prompt = test_prompt(1, 4000);
  for (int i = 0; i < 700; ++i) add_prefill(req, uint64_t(i % 699 + 1), prompt);
  REQUIRE(req.ByteSizeLong() > (5u << 20));
  v1::PrefillResponse resp;
  const grpc::Status st = t.prefill(req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(st.error_message().find("duplicate id") != std::string::npos);
}

TEST_CASE("server: router stop rules end a sequence mid-Decode with its finish reason - the others go on",
          "[server][router]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(11, 24);
  const std::vector<int32_t> greedy = expected_tokens(test_config(), {prompt}, 9)[0];
  // The stop token: the first greedy token from index 3 on that has not come before it,
  // so that it ends the sequence exactly there.
  size_t k = 0;
  for (size_t j = 3; j < greedy.size() && k == 0; ++j) {
    if (std::find(greedy.begin(), greedy.begin() + long(j), greedy[j]) == greedy.begin() + long(j)) k = j;
  }
  REQUIRE(k != 0);
  const int32_t stop_tok = greedy[k];
  const uint32_t plen = uint32_t(prompt.size());

  v1::PrefillRequest pre;
  add_prefill(pre, 300, prompt);                                       // no rules
  add_prefill(pre, 301, prompt)->mutable_stop()->add_stop_token_ids(stop_tok);
  add_prefill(pre, 302, prompt)->mutable_stop()->set_max_new_tokens(4);  // the prefill's token counts
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  for (int i = 0; i < 3; ++i) {
    REQUIRE(pr.results(i).status().code() == v1::SequenceStatus::OK);
    CHECK(pr.results(i).token_id() == greedy[0]);
    CHECK(pr.results(i).finish_reason() == v1::FINISH_REASON_UNSPECIFIED);
  }

  v1::DecodeRequest dec;
  dec.set_steps(8);
  for (uint64_t id : {300, 301, 302}) {
    auto* s = dec.add_sequences();
    s->set_id(id);
    s->set_expected_len(plen + 1);
  }
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  auto tokens = [&](int i) {
    return std::vector<int32_t>(dr.results(i).token_ids().begin(), dr.results(i).token_ids().end());
  };
  // 300 runs all 8 steps; 301 ends on its stop token (included); 302 after 4 sampled tokens.
  CHECK(tokens(0) == std::vector<int32_t>(greedy.begin() + 1, greedy.end()));
  CHECK(dr.results(0).finish_reason() == v1::FINISH_REASON_UNSPECIFIED);
  CHECK(tokens(1) == std::vector<int32_t>(greedy.begin() + 1, greedy.begin() + long(k) + 1));
  CHECK(dr.results(1).finish_reason() == v1::FINISH_REASON_STOP);
  CHECK(dr.results(1).seq_len() == plen + k + 1);
  CHECK(tokens(2) == std::vector<int32_t>(greedy.begin() + 1, greedy.begin() + 4));
  CHECK(dr.results(2).finish_reason() == v1::FINISH_REASON_LENGTH);
  for (int i = 0; i < 3; ++i) CHECK(dr.results(i).status().code() == v1::SequenceStatus::OK);

  // The same call again (a lost response): the same tokens and reasons, no new step.
  v1::DecodeResponse again;
  REQUIRE(t.decode(dec, &again).ok());
  for (int i = 1; i < 3; ++i) {
    CHECK(std::vector<int32_t>(again.results(i).token_ids().begin(), again.results(i).token_ids().end()) ==
          tokens(i));
    CHECK(again.results(i).finish_reason() == dr.results(i).finish_reason());
  }

  // A finished sequence decodes no more, until a call gives it new rules.
  v1::DecodeRequest more;
  more.add_sequences()->set_id(301);
  v1::DecodeResponse mr;
  REQUIRE(t.decode(more, &mr).ok());
  CHECK(code_of(mr.results(0).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(mr.results(0).status().message(), Catch::Matchers::ContainsSubstring("finished (stop)"));
  more.set_steps(3);
  auto* rules = more.mutable_sequences(0)->mutable_stop();
  rules->set_max_new_tokens(2);
  REQUIRE(t.decode(more, &mr).ok());
  REQUIRE(mr.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(mr.results(0).token_ids_size() == 2);
  CHECK(mr.results(0).finish_reason() == v1::FINISH_REASON_LENGTH);

  // Bad rules: INVALID_ARGUMENT naming the field; nothing is created.
  {
    v1::PrefillRequest bad;
    add_prefill(bad, 310, prompt)->mutable_stop()->add_stop_token_ids(1024);  // the tiny model has 1024 tokens
    v1::PrefillResponse br;
    const grpc::Status st = t.prefill(bad, &br);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("stop.stop_token_ids"));
  }
  {
    v1::DecodeRequest bad;
    auto* s = bad.add_sequences();
    s->set_id(300);
    s->mutable_stop()->set_max_new_tokens(3);
    s->mutable_stop()->set_min_new_tokens(5);
    v1::DecodeResponse br;
    const grpc::Status st = t.decode(bad, &br);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(),
               Catch::Matchers::ContainsSubstring("stop.min_new_tokens 5 exceeds stop.max_new_tokens 3"));
  }
  {
    // Every other bound of the rules, on both calls that take them.
    v1::PrefillRequest many;
    auto* rules = add_prefill(many, 311, prompt)->mutable_stop();
    for (int i = 0; i < 65; ++i) rules->add_stop_token_ids(i);
    v1::PrefillResponse mr;
    const grpc::Status st = t.prefill(many, &mr);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("stop.stop_token_ids: 65 tokens exceed"));
    for (const auto& [max_new, min_new, what] :
         {std::tuple<int, int, const char*>{4097, 0, "stop.max_new_tokens 4097 exceeds max_seq_len 4096"},
          std::tuple<int, int, const char*>{-1, 4097, "stop.min_new_tokens 4097 exceeds max_seq_len 4096"}}) {
      v1::DecodeRequest bad;
      auto* s = bad.add_sequences();
      s->set_id(300);
      if (max_new >= 0) s->mutable_stop()->set_max_new_tokens(uint32_t(max_new));
      s->mutable_stop()->set_min_new_tokens(uint32_t(min_new));
      v1::DecodeResponse br;
      const grpc::Status dst = t.decode(bad, &br);
      CHECK(dst.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(dst.error_message(), Catch::Matchers::ContainsSubstring(what));
    }
  }
  CHECK(t.load().num_router_sequences() == 3);
  v1::ReleaseResponse rel;
  REQUIRE(t.release({300, 301, 302}, &rel).ok());
  CHECK(rel.released_size() == 3);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a checkpoint's EOS (generation_config.json) ends a router sequence mid-Decode by default",
          "[server][router][checkpoint]") {
  TempDir dir;
  export_synthetic(dir.path(), mini_spec("llama"), 3);
  const std::vector<std::string> cfg = {"model_path=" + dir.path()};
  const std::vector<int32_t> prompt = prompt_of(12, 5, mini_spec().vocab);
  const std::vector<int32_t> greedy = expected_tokens(test_config(cfg), {prompt}, 9)[0];
  size_t k = 0;  // the first greedy token from index 3 on that has not come before it
  for (size_t j = 3; j < greedy.size() && k == 0; ++j) {
    if (std::find(greedy.begin(), greedy.begin() + long(j), greedy[j]) == greedy.begin() + long(j)) k = j;
  }
  REQUIRE(k != 0);
  // The checkpoint declares that token its EOS (generation_config.json wins over config.json).
  write_file(dir / "generation_config.json", "{\"eos_token_id\": [" + std::to_string(greedy[k]) + "]}");
  auto t = TestServer::start(cfg);
  {
    grpc::ClientContext ctx;
    v1::GetInfoResponse info;
    REQUIRE(t.stub->GetInfo(&ctx, {}, &info).ok());
    REQUIRE(info.eos_token_ids_size() == 1);
    CHECK(info.eos_token_ids(0) == greedy[k]);
  }
  v1::PrefillRequest pre;
  add_prefill(pre, 1, prompt);                                 // EOS stops it
  add_prefill(pre, 2, prompt)->mutable_stop()->set_ignore_eos(true);  // goes on
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  v1::DecodeRequest dec;
  dec.set_steps(8);
  dec.add_sequences()->set_id(1);
  dec.add_sequences()->set_id(2);
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  CHECK(std::vector<int32_t>(dr.results(0).token_ids().begin(), dr.results(0).token_ids().end()) ==
        std::vector<int32_t>(greedy.begin() + 1, greedy.begin() + long(k) + 1));
  CHECK(dr.results(0).finish_reason() == v1::FINISH_REASON_STOP);
  CHECK(std::vector<int32_t>(dr.results(1).token_ids().begin(), dr.results(1).token_ids().end()) ==
        std::vector<int32_t>(greedy.begin() + 1, greedy.end()));
  CHECK(dr.results(1).finish_reason() == v1::FINISH_REASON_UNSPECIFIED);
  v1::ReleaseResponse rel;
  REQUIRE(t.release({1, 2}, &rel).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: prefix_reuse shares a live sequence's prompt pages: cached_tokens, shared_pages, no leak",
          "[server][prefix]") {
  auto t = TestServer::start({"prefix_reuse=on"});
  const std::vector<int32_t> prompt = test_prompt(12, 40);
  v1::PrefillRequest first;
  add_prefill(first, 700, prompt);
  v1::PrefillResponse fr;
  REQUIRE(t.prefill(first, &fr).ok());
  REQUIRE(fr.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(fr.results(0).cached_tokens() == 0);
  v1::PrefillRequest second;
  add_prefill(second, 701, prompt);
  v1::PrefillResponse sr;
  REQUIRE(t.prefill(second, &sr).ok());
  REQUIRE(sr.results(0).status().code() == v1::SequenceStatus::OK);
  CHECK(sr.results(0).cached_tokens() == 32);  // two whole pages of 16 of the 39 before the last
  CHECK(sr.results(0).token_id() == fr.results(0).token_id());
  CHECK(t.load().pools(0).shared_pages() == 2);
  // Generate shares too, and says so in its usage.
  const StreamResult g = generate(*t.stub, generate_request(prompt, 3));
  REQUIRE(g.status.ok());
  CHECK(g.usage.cached_tokens() == 32);
  CHECK(g.tokens[0] == fr.results(0).token_id());
  REQUIRE(t.release({700}).ok());
  CHECK(t.load().pools(0).shared_pages() == 0);
  CHECK(t.used_pages() > 0);
  REQUIRE(t.release({701}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: tensor_parallel 2 on the CPU serves the sharded engine's tokens - bad input leaks nothing",
          "[server][tp]") {
  const std::vector<std::string> keys = {"tensor_parallel=2", "num_pages=200"};
  auto t = TestServer::start(keys);
  {
    grpc::ClientContext ctx;
    v1::GetInfoResponse info;
    REQUIRE(t.stub->GetInfo(&ctx, {}, &info).ok());
    CHECK(info.tensor_parallel() == 2);
  }
  const std::vector<std::vector<int32_t>> prompts = {test_prompt(1, 23), test_prompt(2, 40)};
  const auto want = expected_tokens(test_config(keys), prompts, 12);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const StreamResult r = generate(*t.stub, generate_request(prompts[i], 12));
    REQUIRE(r.status.ok());
    CHECK(r.tokens == want[i]);
  }
  // A bad request: refused, and the server goes on serving with no page held.
  v1::GenerateRequest bad = generate_request(prompts[0], 4);
  bad.mutable_logprobs()->set_enabled(true);
  bad.mutable_logprobs()->set_top_n(21);
  const StreamResult refused = generate(*t.stub, bad);
  CHECK(refused.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  const StreamResult again = generate(*t.stub, generate_request(prompts[1], 12));
  REQUIRE(again.status.ok());
  CHECK(again.tokens == want[1]);
  CHECK(t.wait_all_pages_free());
}
