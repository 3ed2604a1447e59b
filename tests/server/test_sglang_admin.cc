// smg's SGLang service besides Generate: HealthCheck against kvfuse's health (and gRPC
// health and reflection listing the service), GetModelInfo, GetServerInfo, GetLoads,
// FlushCache, SubscribeKvEvents and GetTokenizer, each against what kvfuse.v1 says.
#include <future>

#include "server/tokenizer_bundle.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/reflection_client.h"
#include "tests/util/sglang_test_util.h"
#include "tests/util/zip_reader.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

constexpr char kService[] = "sglang.grpc.scheduler.SglangScheduler";

std::unique_ptr<grpc::ClientContext> ctx(double timeout_s = 10) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(in_seconds(timeout_s));
  return c;
}

sgl::HealthCheckResponse sglang_health(sgl::SglangScheduler::Stub& stub) {
  sgl::HealthCheckResponse resp;
  REQUIRE(stub.HealthCheck(ctx().get(), {}, &resp).ok());
  return resp;
}

// GetTokenizer's chunks, and the call's status.
std::pair<grpc::Status, std::vector<smgc::GetTokenizerChunk>> get_tokenizer(sgl::SglangScheduler::Stub& stub) {
  auto c = ctx(30);
  auto reader = stub.GetTokenizer(c.get(), {});
  std::vector<smgc::GetTokenizerChunk> chunks;
  smgc::GetTokenizerChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(chunk);
  return {reader->Finish(), chunks};
}

// Reads batches until `done` holds for what was read (or the deadline passes).
std::vector<smgc::KvEventBatch> read_kv_events(grpc::ClientReaderInterface<smgc::KvEventBatch>& reader,
                                               const std::function<bool(const std::vector<smgc::KvEventBatch>&)>& done) {
  std::vector<smgc::KvEventBatch> out;
  smgc::KvEventBatch b;
  while (!done(out) && reader.Read(&b)) out.push_back(b);
  return out;
}

}  // namespace

TEST_CASE("sglang: HealthCheck follows kvfuse's health, and gRPC health and reflection cover the service",
          "[server][sglang][health]") {
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  auto t = TestServer::start(
      {}, [gate](server::ServerOptions& o) { o.loop.before_warmup = [gate] { gate.wait(); }; }, /*wait=*/false);
  auto stub = sglang_stub(t);
  const sgl::HealthCheckResponse warming = sglang_health(*stub);
  CHECK_FALSE(warming.healthy());
  CHECK_THAT(warming.message(), Catch::Matchers::ContainsSubstring("NOT_SERVING"));
  sgl::GetModelInfoResponse info;
  CHECK(stub->GetModelInfo(ctx().get(), {}, &info).error_code() == grpc::StatusCode::UNAVAILABLE);
  go.set_value();
  REQUIRE(t.server->wait_until_serving(30).ok());
  CHECK(sglang_health(*stub).healthy());
  auto health = grpc::health::v1::Health::NewStub(t.channel);
  grpc::health::v1::HealthCheckRequest hreq;
  hreq.set_service(kService);
  grpc::health::v1::HealthCheckResponse hresp;
  REQUIRE(health->Check(ctx().get(), hreq, &hresp).ok());
  CHECK(hresp.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  const std::string list = reflection_exchange(t.channel, string_field(7, "*"));
  CHECK(list.find(kService) != std::string::npos);
  CHECK(list.find("kvfuse.v1.DecodeService") != std::string::npos);
  // A draining server is not healthy.
  t.server->loop().begin_drain();
  CHECK_FALSE(sglang_health(*stub).healthy());
}

TEST_CASE("sglang: GetModelInfo and GetServerInfo tell kvfuse.v1 GetInfo's model and the config",
          "[server][sglang][info]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  v1::GetInfoResponse v1info;
  REQUIRE(t.stub->GetInfo(ctx().get(), {}, &v1info).ok());
  sgl::GetModelInfoResponse m;
  REQUIRE(stub->GetModelInfo(ctx().get(), {}, &m).ok());
  CHECK(m.is_generation());
  CHECK(m.served_model_name() == v1info.model());
  CHECK(m.vocab_size() == int32_t(v1info.vocab_size()));
  CHECK(m.max_context_length() == int32_t(v1info.max_seq_len()));
  CHECK(m.max_req_input_len() == int32_t(v1info.max_seq_len()) - 1);
  CHECK(m.model_type() == "llama");
  CHECK(m.eos_token_ids_size() == 0);  // tiny declares none
  sgl::GetServerInfoResponse s;
  REQUIRE(stub->GetServerInfo(ctx().get(), {}, &s).ok());
  CHECK(s.server_type() == "grpc");
  CHECK(s.max_total_num_tokens() == int32_t(v1info.num_pages() * v1info.page_size()));
  CHECK(s.max_total_num_tokens() == 512 * 16);
  CHECK(s.server_args().fields().at("num_pages").number_value() == 512);
  CHECK(s.server_args().fields().at("model").string_value() == "tiny");
  // The keys smg reads under SGLang's names.
  CHECK(s.server_args().fields().at("dp_size").number_value() == 1);
  CHECK(s.server_args().fields().at("tp_size").number_value() == 1);
  CHECK(s.server_args().fields().at("context_length").number_value() == v1info.max_seq_len());
  CHECK(s.server_args().fields().at("max_total_tokens").number_value() == 512 * 16);
  CHECK(s.server_args().fields().at("served_model_name").string_value() == v1info.model());
  CHECK(s.scheduler_info().fields().at("page_size").number_value() == 16);
  CHECK(s.active_requests() == 0);
  CHECK(s.uptime_seconds() >= 0);
  CHECK(s.start_time().seconds() > 1600000000);
  CHECK_THAT(s.sglang_version(), Catch::Matchers::ContainsSubstring(v1info.version()));
}

TEST_CASE("sglang: GetModelInfo of a checkpoint tells its config.json and EOS", "[server][sglang][info][checkpoint]") {
  TempDir dir;
  export_synthetic(dir.path(), mini_spec("llama"), 3);
  write_file(dir / "generation_config.json", "{\"eos_token_id\": [7, 9], \"bos_token_id\": 1}");
  auto t = TestServer::start({"model_path=" + dir.path()});
  auto stub = sglang_stub(t);
  sgl::GetModelInfoResponse m;
  REQUIRE(stub->GetModelInfo(ctx().get(), {}, &m).ok());
  CHECK(std::vector<int32_t>(m.eos_token_ids().begin(), m.eos_token_ids().end()) == std::vector<int32_t>{7, 9});
  CHECK(m.bos_token_id() == 1);
  CHECK(m.model_type() == "llama");
  REQUIRE(m.architectures_size() == 1);
  CHECK(m.architectures(0) == "LlamaForCausalLM");
  CHECK(m.model_path() == dir.path());
}

TEST_CASE("sglang: GetLoads reports rank 0 from kvfuse.v1 GetLoad, the prefix cache's hit rate and throughput",
          "[server][sglang][load]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  const std::vector<int32_t> prompt = test_prompt(2, 40);
  for (const char* id : {"a", "b"}) REQUIRE(sglang_generate(*stub, sglang_request(id, prompt, 6)).status.ok());
  REQUIRE(t.wait_all_pages_free());
  sgl::GetLoadsRequest req;
  req.add_include("all");
  sgl::GetLoadsResponse r;
  REQUIRE(stub->GetLoads(ctx().get(), req, &r).ok());
  CHECK(r.dp_rank_count() == 1);
  REQUIRE(r.loads_size() == 1);
  const sgl::SchedulerLoad& l = r.loads(0);
  CHECK(l.dp_rank() == 0);
  CHECK(l.num_running_reqs() == 0);
  CHECK(l.num_waiting_reqs() == 0);
  CHECK(l.num_used_tokens() == 0);
  CHECK(l.max_total_num_tokens() == 512 * 16);
  CHECK(l.token_usage() == 0.0);
  CHECK(l.max_running_requests() == 64);
  CHECK(l.cache_hit_rate() > 0.0);  // the second request took 32 of its prompt's tokens from the cache
  CHECK(l.cache_hit_rate() <= 1.0);
  CHECK(l.gen_throughput() > 0.0);  // 12 tokens since the start
  CHECK(l.has_memory());
  CHECK(l.memory().token_capacity() == 512 * 16);
  CHECK(l.has_queues());
  CHECK(r.aggregate().total_reqs() == 0);
  CHECK_FALSE(r.timestamp().empty());
  // Core only by default; another rank has no load; an unknown section is refused by name.
  sgl::GetLoadsResponse core;
  REQUIRE(stub->GetLoads(ctx().get(), {}, &core).ok());
  REQUIRE(core.loads_size() == 1);
  CHECK_FALSE(core.loads(0).has_memory());
  sgl::GetLoadsRequest other;
  other.set_dp_rank(1);
  sgl::GetLoadsResponse none;
  REQUIRE(stub->GetLoads(ctx().get(), other, &none).ok());
  CHECK(none.loads_size() == 0);
  sgl::GetLoadsRequest bad;
  bad.add_include("gpu");
  const grpc::Status st = stub->GetLoads(ctx().get(), bad, &none);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("include"));
}

TEST_CASE("sglang: FlushCache empties the prefix cache, and KV events come in smg's shape, resumable by number",
          "[server][sglang][prefix]") {
  auto t = TestServer::start();
  auto stub = sglang_stub(t);
  auto sub_ctx = ctx(60);
  auto reader = stub->SubscribeKvEvents(sub_ctx.get(), smgc::SubscribeKvEventsRequest());  // 0: from now on
  const std::vector<int32_t> prompt = test_prompt(3, 40);
  REQUIRE(sglang_generate(*stub, sglang_request("kv", prompt, 4)).status.ok());
  REQUIRE(t.wait_all_pages_free());
  CHECK(t.load().pools(0).cached_pages() > 0);
  auto has_stored = [](const std::vector<smgc::KvEventBatch>& bs) {
    for (const auto& b : bs)
      for (const auto& e : b.events())
        if (e.has_stored()) return true;
    return false;
  };
  const auto stored = read_kv_events(*reader, has_stored);
  REQUIRE(has_stored(stored));
  const smgc::KvEventBatch& first = stored.front();
  CHECK(first.dp_rank() == 0);
  CHECK(first.timestamp() > 1600000000.0);
  const smgc::KvBlocksStored* blocks = nullptr;
  for (const auto& b : stored)
    for (const auto& e : b.events())
      if (!blocks && e.has_stored()) blocks = &e.stored();
  REQUIRE(blocks->blocks_size() >= 2);
  CHECK_FALSE(blocks->has_parent_block_hash());  // the chain's first block
  CHECK(blocks->blocks(0).block_size() == 16);
  CHECK(std::vector<int32_t>(blocks->blocks(0).token_ids().begin(), blocks->blocks(0).token_ids().end()) ==
        std::vector<int32_t>(prompt.begin(), prompt.begin() + 16));
  CHECK(blocks->blocks(0).block_hash() != blocks->blocks(1).block_hash());

  smgc::FlushCacheRequest freq;
  smgc::FlushCacheResponse fresp;
  REQUIRE(stub->FlushCache(ctx().get(), freq, &fresp).ok());
  CHECK(fresp.success());
  CHECK_THAT(fresp.message(), Catch::Matchers::ContainsSubstring("flushed"));
  CHECK(t.load().pools(0).cached_pages() == 0);
  auto has_cleared = [](const std::vector<smgc::KvEventBatch>& bs) {
    for (const auto& b : bs)
      for (const auto& e : b.events())
        if (e.has_cleared()) return true;
    return false;
  };
  // The same live subscription, woken again by the flush's batch.
  CHECK(has_cleared(read_kv_events(*reader, has_cleared)));
  sub_ctx->TryCancel();
  reader->Finish();

  // Resuming from the first batch's number sees that batch again, the same.
  smgc::SubscribeKvEventsRequest resume;
  resume.set_start_sequence_number(first.sequence_number());
  auto rctx = ctx(30);
  auto again = stub->SubscribeKvEvents(rctx.get(), resume);
  smgc::KvEventBatch b;
  REQUIRE(again->Read(&b));
  CHECK(b.SerializeAsString() == first.SerializeAsString());
  rctx->TryCancel();
  again->Finish();
  // A negative timeout_s is refused by name.
  freq.set_timeout_s(-1);
  const grpc::Status st = stub->FlushCache(ctx().get(), freq, &fresp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("timeout_s"));
}

TEST_CASE("sglang: SubscribeKvEvents from a batch that aged out is OUT_OF_RANGE", "[server][sglang][prefix]") {
  auto t = TestServer::start({"kv_events_history=1"});
  auto stub = sglang_stub(t);
  for (int i = 0; i < 3; ++i) {
    REQUIRE(sglang_generate(*stub, sglang_request("age", test_prompt(20 + i, 40), 2)).status.ok());
  }
  REQUIRE(t.server->loop().kv_events().next_sequence_number() > 2);
  smgc::SubscribeKvEventsRequest req;
  req.set_start_sequence_number(1);
  auto c = ctx(30);
  auto reader = stub->SubscribeKvEvents(c.get(), req);
  smgc::KvEventBatch b;
  CHECK_FALSE(reader->Read(&b));
  const grpc::Status st = reader->Finish();
  CHECK(st.error_code() == grpc::StatusCode::OUT_OF_RANGE);
  CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("aged out"));
}

TEST_CASE("sglang: GetTokenizer streams the checkpoint's tokenizer files as a zip with its SHA-256 last",
          "[server][sglang][tokenizer][checkpoint]") {
  {
    INFO("a synthetic preset has no tokenizer");
    auto t = TestServer::start();
    auto stub = sglang_stub(t);
    const auto [st, chunks] = get_tokenizer(*stub);
    CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("model_path"));
    CHECK(chunks.empty());
  }
  TempDir dir;
  export_synthetic(dir.path(), mini_spec("llama"), 3);
  auto t = TestServer::start({"model_path=" + dir.path()});
  auto stub = sglang_stub(t);
  {
    INFO("a checkpoint without tokenizer files");
    const auto [st, chunks] = get_tokenizer(*stub);
    CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_THAT(st.error_message(), Catch::Matchers::ContainsSubstring("tokenizer.json"));
  }
  // A tokenizer.json of 2.5 MiB: the bundle takes three chunks.
  std::string tokenizer(5 << 19, 'x');
  for (size_t i = 0; i < tokenizer.size(); i += 97) tokenizer[i] = char('a' + i % 26);
  write_file(dir / "tokenizer.json", tokenizer);
  write_file(dir / "tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
  write_file(dir / "merges.txt", "");
  const auto [st, chunks] = get_tokenizer(*stub);
  REQUIRE(st.ok());
  REQUIRE(chunks.size() == 3);
  std::string zip;
  for (size_t i = 0; i < chunks.size(); ++i) {
    zip += chunks[i].data();
    CHECK(chunks[i].sha256().empty() == (i + 1 < chunks.size()));  // on the last only
  }
  CHECK(chunks.back().sha256() == server::sha256_hex(zip));
  const auto files = read_stored_zip(zip);
  CHECK(files.size() == 4);  // config.json too (export_synthetic writes it)
  CHECK(files.at("tokenizer.json") == tokenizer);
  CHECK(files.at("tokenizer_config.json") == "{\"bos_token\": \"<s>\"}");
  CHECK(files.at("merges.txt").empty());
  CHECK(files.at("config.json") == read_file(dir / "config.json"));
  CHECK(files.count("special_tokens_map.json") == 0);
}
