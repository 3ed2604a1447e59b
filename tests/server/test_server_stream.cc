// Continuous batching through the server: many concurrent Generate streams and
// router calls sharing steps against the engine's in-process output, slow readers,
// cancellation and deadlines (pages come back at the next step boundary), and a pool
// too small for the load.
#include <future>
#include <set>

#include <memory>

#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

TEST_CASE("server: 80 concurrent Generate streams and router calls share steps and equal the engine's output",
          "[server][stream]") {
  // The engine's output is recorded per sequence as the steps return it (an in-process
  // rerun would batch differently, and the CPU's GEMM sums a step of one or two rows in
  // another order than a larger step, so near-tied greedy choices could differ).
  // Both ways of sending a step's tokens: while the next step runs (default), and between
  // steps.
  const std::string fanout = GENERATE("overlap_fanout=on", "overlap_fanout=off");
  INFO(fanout);
  auto rec = std::make_shared<TokenRecord>();
  auto t = TestServer::start({fanout}, [rec](server::ServerOptions& o) { o.loop.result_hook = rec->hook(); });
  constexpr int kStreams = 80, kRouter = 4, kTokens = 24;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kStreams + kRouter; ++i) prompts.push_back(test_prompt(i, 5 + (i * 7) % 56));

  std::vector<std::future<StreamResult>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(std::async(std::launch::async, [&, i] {
      return generate(*t.stub, generate_request(prompts[size_t(i)], kTokens, i % 2 ? 0 : uint64_t(5000 + i)));
    }));
  }
  // Meanwhile a router prefills its own sequences and decodes them in chunks of steps.
  auto router = std::async(std::launch::async, [&] {
    std::vector<std::vector<int32_t>> got(kRouter);
    v1::PrefillRequest pre;
    for (int i = 0; i < kRouter; ++i) add_prefill(pre, uint64_t(100 + i), prompts[size_t(kStreams + i)]);
    v1::PrefillResponse pr;
    REQUIRE(t.prefill(pre, &pr).ok());
    for (int i = 0; i < kRouter; ++i) {
      REQUIRE(code_of(pr.results(i).status()) == grpc::StatusCode::OK);
      got[size_t(i)].push_back(pr.results(i).token_id());
    }
    while (got[0].size() < size_t(kTokens)) {
      v1::DecodeRequest dec;
      dec.set_steps(uint32_t(std::min<size_t>(5, kTokens - got[0].size())));
      for (int i = 0; i < kRouter; ++i) dec.add_sequences()->set_id(uint64_t(100 + i));
      v1::DecodeResponse dr;
      REQUIRE(t.decode(dec, &dr).ok());
      for (int i = 0; i < kRouter; ++i) {
        REQUIRE(code_of(dr.results(i).status()) == grpc::StatusCode::OK);
        got[size_t(i)].insert(got[size_t(i)].end(), dr.results(i).token_ids().begin(),
                              dr.results(i).token_ids().end());
      }
    }
    return got;
  });

  std::set<uint64_t> ids;
  for (int i = 0; i < kStreams; ++i) {
    const StreamResult r = streams[size_t(i)].get();
    INFO("stream " << i);
    REQUIRE(r.status.ok());
    CHECK(r.tokens.size() == size_t(kTokens));
    CHECK(r.tokens == rec->get(SeqId(r.id)));  // none lost, duplicated or reordered
    CHECK(r.final_messages == 1);
    CHECK(r.finish == v1::FINISH_REASON_LENGTH);
    CHECK(r.usage.completion_tokens() == uint32_t(kTokens));
    CHECK(r.usage.prompt_tokens() == prompts[size_t(i)].size());
    if (i % 2 == 0) CHECK(r.id == uint64_t(5000 + i));
    ids.insert(r.id);
  }
  CHECK(ids.size() == size_t(kStreams));
  const auto got = router.get();
  for (int i = 0; i < kRouter; ++i) CHECK(got[size_t(i)] == rec->get(SeqId(100 + i)));
  REQUIRE(t.release({100, 101, 102, 103}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a slow reader gets every token in order and never holds up the engine loop",
          "[server][stream]") {
  // Every token the engine produces, per sequence, as the steps return them: the stream
  // must deliver exactly these, in order. (Not an in-process rerun: which steps the two
  // requests share depends on timing here, and the CPU's GEMM sums a one-row step in
  // another order than a step of several, so near-tied greedy choices could differ.)
  auto rec = std::make_shared<TokenRecord>();
  auto t = TestServer::start({}, [rec](server::ServerOptions& o) {
    o.service.stream_queue_messages = 2;
    o.loop.result_hook = rec->hook();
  });
  // A client that advertises a tiny HTTP/2 window, so unread messages back up on the
  // server instead of in socket buffers.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 256);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto slow_channel =
      grpc::CreateCustomChannel(t.server->address(), grpc::InsecureChannelCredentials(), args);
  auto slow_stub = v1::DecodeService::NewStub(slow_channel);

  const auto slow_prompt = test_prompt(1, 10), fast_prompt = test_prompt(2, 10);
  const auto t0 = Clock::now();
  auto slow = std::async(std::launch::async, [&] {
    return generate(*slow_stub, generate_request(slow_prompt, 300), 60,
                    [](int) { std::this_thread::sleep_for(std::chrono::milliseconds(40)); });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const StreamResult fast = generate(*t.stub, generate_request(fast_prompt, 300));
  const double fast_done_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const StreamResult r = slow.get();
  const double slow_done_s = std::chrono::duration<double>(Clock::now() - t0).count();

  REQUIRE(fast.status.ok());
  REQUIRE(r.status.ok());
  CHECK(r.tokens.size() == 300);
  CHECK(fast.tokens.size() == 300);
  CHECK(r.tokens == rec->get(SeqId(r.id)));
  CHECK(fast.tokens == rec->get(SeqId(fast.id)));
  CHECK(r.final_messages == 1);
  // Tokens were coalesced into fewer messages than one per token...
  CHECK(r.messages < 300);
  // ...and the engine finished the slow request long before its reader did.
  CHECK(r.usage.e2e_latency_s() < slow_done_s);
  CHECK(fast_done_s < slow_done_s);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a cancelled stream frees its pages at the next step boundary", "[server][stream]") {
  const std::string fanout = GENERATE("overlap_fanout=on", "overlap_fanout=off");
  INFO(fanout);
  auto t = TestServer::start({fanout});
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(60));
  auto reader = t.stub->Generate(&ctx, generate_request(test_prompt(3, 40), 4000));
  v1::GenerateResponse msg;
  for (int i = 0; i < 5; ++i) REQUIRE(reader->Read(&msg));
  CHECK(t.used_pages() > 0);
  ctx.TryCancel();
  while (reader->Read(&msg)) {
  }
  CHECK(reader->Finish().error_code() == grpc::StatusCode::CANCELLED);
  CHECK(t.wait_all_pages_free(5));
  // The server goes on serving.
  CHECK(generate(*t.stub, generate_request(test_prompt(3, 8), 3)).status.ok());
}

TEST_CASE("server: a stream past its deadline ends DEADLINE_EXCEEDED and frees its pages",
          "[server][stream]") {
  // Each step is slowed down so that 4000 tokens take at least 4 s, however fast the machine.
  auto t = TestServer::start({}, [](server::ServerOptions& o) {
    o.loop.result_hook = [](std::vector<StepResult>&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
  });
  const StreamResult r = generate(*t.stub, generate_request(test_prompt(4, 30), 4000), /*timeout_s=*/0.3);
  CHECK(r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  CHECK(!r.tokens.empty());
  CHECK(t.wait_all_pages_free(5));
}

TEST_CASE("server: unary calls past their deadline stop at a step boundary", "[server][stream]") {
  // Steps with sequence 333 or 334 are slowed down so that a Prefill of 333 and a Decode
  // of 334 outlive their deadlines however fast the machine (256 steps of 334 take at
  // least 1.3 s against a 50 ms deadline).
  auto t = TestServer::start({"max_batch_tokens=64"}, [](server::ServerOptions& o) {
    o.loop.result_hook = [](std::vector<StepResult>& results) {
      for (const auto& r : results) {
        if (r.id == 333) std::this_thread::sleep_for(std::chrono::milliseconds(40));
        if (r.id == 334) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    };
  });
  // A Prefill cancelled part way leaves nothing behind: a retry can create the sequence.
  v1::PrefillRequest pre;
  add_prefill(pre, 333, test_prompt(5, 640));  // 10 chunks of 64 tokens
  v1::PrefillResponse pr;
  CHECK(t.prefill(pre, &pr, /*timeout_s=*/0.1).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  CHECK(t.wait_all_pages_free(5));
  CHECK(t.load().num_router_sequences() == 0);

  // A Decode stopped part way keeps its sequence; the next call finds it idle.
  v1::PrefillRequest p2;
  add_prefill(p2, 334, test_prompt(6, 10));
  REQUIRE(t.prefill(p2, &pr).ok());
  v1::DecodeRequest dec;
  dec.set_steps(256);
  dec.add_sequences()->set_id(334);
  v1::DecodeResponse dr;
  CHECK(t.decode(dec, &dr, /*timeout_s=*/0.05).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  dec.set_steps(2);
  const auto end = Clock::now() + std::chrono::seconds(5);
  grpc::StatusCode code = grpc::StatusCode::ABORTED;
  while (code == grpc::StatusCode::ABORTED && Clock::now() < end) {  // until the stop has happened
    REQUIRE(t.decode(dec, &dr).ok());
    code = code_of(dr.results(0).status());
  }
  CHECK(code == grpc::StatusCode::OK);
  CHECK(dr.results(0).token_ids_size() == 2);
  CHECK(dr.results(0).seq_len() < 10 + 1 + 256);
  REQUIRE(t.release({334}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a pool too small for the load queues and preempts, and every request completes",
          "[server][stream]") {
  auto t = TestServer::start({"num_pages=12"});  // 192 tokens; each request grows to 70
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 10; ++i) prompts.push_back(test_prompt(40 + i, 30));
  const auto expected = expected_tokens(test_config(), prompts, 40);
  std::vector<std::future<StreamResult>> streams;
  for (int i = 0; i < 10; ++i) {
    streams.push_back(std::async(
        std::launch::async, [&, i] { return generate(*t.stub, generate_request(prompts[size_t(i)], 40)); }));
  }
  int exact = 0;
  for (int i = 0; i < 10; ++i) {
    const StreamResult r = streams[size_t(i)].get();
    INFO("stream " << i);
    REQUIRE(r.status.ok());
    REQUIRE(r.tokens.size() == 40);
    CHECK(r.finish == v1::FINISH_REASON_LENGTH);
    CHECK(r.usage.completion_tokens() == 40);
    // The first token comes from the prompt's prefill whatever the schedule. After a
    // preemption the recomputed prefill runs other GEMM shapes than the decode steps
    // it replaces, so a later greedy token may differ in the last FP8 rounding (the
    // scheduler tests say the same); the tokens are compared exactly in the tests
    // without preemption.
    CHECK(r.tokens[0] == expected[size_t(i)][0]);
    exact += r.tokens == expected[size_t(i)];
  }
  INFO("streams equal to the unpreempted output: " << exact << " of 10");
  const std::string metrics = t.server->metrics().render();
  CHECK(metrics.find("kvfuse:num_preemptions_total{model_name=\"tiny\"} 0\n") == std::string::npos);
  CHECK(t.wait_all_pages_free());
}
