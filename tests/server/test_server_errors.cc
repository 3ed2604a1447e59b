// Every error code of the API, from a real server on a loopback port: malformed
// requests (INVALID_ARGUMENT, the whole call), and per-sequence failures inside batch
// calls that leave the other sequences running (NOT_FOUND, ALREADY_EXISTS, ABORTED,
// FAILED_PRECONDITION, OUT_OF_RANGE, RESOURCE_EXHAUSTED with a retry hint), a full
// queue, draining (UNAVAILABLE) and engine faults (INTERNAL, health NOT_SERVING).
#include <cmath>
#include <future>

#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

grpc::StatusCode prefill_code(const TestServer& t, const v1::PrefillRequest& req) {
  v1::PrefillResponse resp;
  return t.prefill(req, &resp).error_code();
}

grpc::StatusCode decode_code(const TestServer& t, const v1::DecodeRequest& req) {
  v1::DecodeResponse resp;
  return t.decode(req, &resp).error_code();
}

v1::DecodeRequest decode_request(std::vector<uint64_t> ids, uint32_t steps = 1) {
  v1::DecodeRequest req;
  req.set_steps(steps);
  for (uint64_t id : ids) req.add_sequences()->set_id(id);
  return req;
}

}  // namespace

TEST_CASE("server: every malformed field is INVALID_ARGUMENT and changes nothing", "[server][errors]") {
  auto t = TestServer::start({"max_seq_len=64"});
  const auto ok_prompt = test_prompt(1, 8);
  using Mut = std::function<void(v1::PrefillRequest&)>;
  const std::vector<std::pair<const char*, Mut>> prefill_cases = {
      {"no sequences", [](auto&) {}},
      {"id 0", [&](auto& r) { add_prefill(r, 0, ok_prompt); }},
      {"duplicate ids", [&](auto& r) { add_prefill(r, 1, ok_prompt), add_prefill(r, 1, ok_prompt); }},
      {"empty prompt", [&](auto& r) { add_prefill(r, 1, {}); }},
      {"over-long prompt", [&](auto& r) { add_prefill(r, 1, test_prompt(1, 64)); }},
      {"token beyond vocab",
       [&](auto& r) {
         add_prefill(r, 1, {1, 1024});
       }},
      {"negative token",
       [&](auto& r) {
         add_prefill(r, 1, {-1, 2});
       }},
      {"negative temperature",
       [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_temperature(-1); }},
      {"NaN temperature",
       [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_temperature(NAN); }},
      {"top_p 0", [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_top_p(0); }},
      {"top_p > 1", [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_top_p(1.5f); }},
      {"top_k < 0", [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_top_k(-1); }},
      {"top_k > vocab", [&](auto& r) { add_prefill(r, 1, ok_prompt)->mutable_sampling()->set_top_k(5000); }},
      {"sampling on extend",
       [&](auto& r) { add_prefill(r, 1, ok_prompt, true)->mutable_sampling()->set_temperature(1); }},
      {"too many sequences",
       [&](auto& r) {
         for (int i = 1; i <= 4097; ++i) add_prefill(r, uint64_t(i), {1});
       }},
  };
  for (const auto& [name, mutate] : prefill_cases) {
    INFO(name);
    v1::PrefillRequest req;
    mutate(req);
    CHECK(prefill_code(t, req) == grpc::StatusCode::INVALID_ARGUMENT);
  }

  const std::vector<std::pair<const char*, v1::DecodeRequest>> decode_cases = {
      {"no sequences", decode_request({})},
      {"id 0", decode_request({0})},
      {"duplicate ids", decode_request({4, 4})},
      {"too many steps", decode_request({4}, 257)},
  };
  for (const auto& [name, req] : decode_cases) {
    INFO(name);
    CHECK(decode_code(t, req) == grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::DecodeRequest req = decode_request({4});
    req.mutable_sequences(0)->set_expected_len(0);
    CHECK(decode_code(t, req) == grpc::StatusCode::INVALID_ARGUMENT);
    req.mutable_sequences(0)->set_expected_len(65);
    CHECK(decode_code(t, req) == grpc::StatusCode::INVALID_ARGUMENT);
  }
  CHECK(t.release({}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(t.release({0}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(t.release({3, 3}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  {
    grpc::ClientContext ctx;
    v1::AbortResponse resp;
    CHECK(t.stub->Abort(&ctx, v1::AbortRequest{}, &resp).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }

  using GenMut = std::function<void(v1::GenerateRequest&)>;
  const std::vector<std::pair<const char*, GenMut>> generate_cases = {
      {"empty prompt", [](auto& r) { r.clear_prompt_ids(); }},
      {"over-long prompt",
       [](auto& r) {
         for (int i = 0; i < 64; ++i) r.add_prompt_ids(1);
       }},
      {"token beyond vocab", [](auto& r) { r.add_prompt_ids(99999); }},
      {"max_tokens beyond max_seq_len", [](auto& r) { r.set_max_tokens(65); }},
      {"stop token beyond vocab", [](auto& r) { r.add_stop_token_ids(1024); }},
      {"too many stop tokens",
       [](auto& r) {
         for (int i = 0; i < 65; ++i) r.add_stop_token_ids(i);
       }},
      {"min_tokens beyond max_tokens", [](auto& r) { r.set_min_tokens(5); }},
      {"min_tokens beyond max_seq_len",
       [](auto& r) {
         r.set_max_tokens(0);
         r.set_min_tokens(65);
       }},
      {"infinite temperature", [](auto& r) { r.mutable_sampling()->set_temperature(INFINITY); }},
      {"temperature > 100", [](auto& r) { r.mutable_sampling()->set_temperature(101); }},
      {"NaN top_p", [](auto& r) { r.mutable_sampling()->set_top_p(NAN); }},
  };
  for (const auto& [name, mutate] : generate_cases) {
    INFO(name);
    v1::GenerateRequest req = generate_request(ok_prompt, 4);
    mutate(req);
    const StreamResult r = generate(*t.stub, req);
    CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(r.messages == 0);
  }
  const auto load = t.load();
  CHECK(load.num_router_sequences() == 0);
  CHECK(load.pools(0).used_pages() == 0);
}

TEST_CASE("server: batch calls report per-sequence failures and run the others", "[server][errors]") {
  // Steps that include sequence 900 or 5 are slowed down, so that the calls below
  // reliably find them busy.
  auto t = TestServer::start({"max_seq_len=64"}, [](server::ServerOptions& o) {
    o.loop.result_hook = [](std::vector<StepResult>& results) {
      for (const auto& r : results) {
        if (r.id == 900 || r.id == 5) std::this_thread::sleep_for(std::chrono::milliseconds(15));
      }
    };
  });
  v1::PrefillRequest first;
  add_prefill(first, 2, test_prompt(2, 10));
  add_prefill(first, 6, test_prompt(6, 10), false, /*no_sample=*/true);
  v1::PrefillResponse fr;
  REQUIRE(t.prefill(first, &fr).ok());

  // A Generate request holds id 900 while this runs (56 slow steps).
  std::promise<void> started;
  auto stream = std::async(std::launch::async, [&] {
    bool once = false;
    return generate(*t.stub, generate_request(test_prompt(9, 8), 60, 900), 60, [&](int) {
      if (!once) started.set_value(), once = true;
    });
  });
  started.get_future().wait();

  v1::PrefillRequest req;
  add_prefill(req, 1, test_prompt(1, 10));        // OK
  add_prefill(req, 2, test_prompt(2, 10));        // ALREADY_EXISTS (a router sequence)
  add_prefill(req, 3, test_prompt(3, 10), true);  // NOT_FOUND (extends an unknown one)
  add_prefill(req, 900, test_prompt(4, 10));      // ALREADY_EXISTS (a Generate request)
  add_prefill(req, 5, test_prompt(5, 10));        // OK
  v1::PrefillResponse resp;
  REQUIRE(t.prefill(req, &resp).ok());
  REQUIRE(resp.results_size() == 5);
  CHECK(code_of(resp.results(0).status()) == grpc::StatusCode::OK);
  CHECK(resp.results(0).has_token_id());
  CHECK(code_of(resp.results(1).status()) == grpc::StatusCode::ALREADY_EXISTS);
  CHECK(code_of(resp.results(2).status()) == grpc::StatusCode::NOT_FOUND);
  CHECK(code_of(resp.results(3).status()) == grpc::StatusCode::ALREADY_EXISTS);
  CHECK(code_of(resp.results(4).status()) == grpc::StatusCode::OK);
  CHECK(resp.results(4).has_token_id());
  {
    // Extending past max_seq_len: INVALID_ARGUMENT for that sequence, which is unchanged.
    v1::PrefillRequest r2;
    add_prefill(r2, 2, test_prompt(5, 60), true);
    v1::PrefillResponse p2;
    REQUIRE(t.prefill(r2, &p2).ok());
    CHECK(code_of(p2.results(0).status()) == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(p2.results(0).seq_len() == 11);
  }

  // Generate with a live id: ALREADY_EXISTS for the call.
  CHECK(generate(*t.stub, generate_request({1, 2}, 2, 900)).status.error_code() ==
        grpc::StatusCode::ALREADY_EXISTS);
  CHECK(generate(*t.stub, generate_request({1, 2}, 2, 1)).status.error_code() ==
        grpc::StatusCode::ALREADY_EXISTS);

  // Decode: OK, unknown, a Generate id, a replay that cannot match, nothing to decode from.
  v1::DecodeRequest dec = decode_request({1, 999, 900, 2, 6}, 2);
  dec.mutable_sequences(3)->set_expected_len(3);
  v1::DecodeResponse dr;
  REQUIRE(t.decode(dec, &dr).ok());
  CHECK(code_of(dr.results(0).status()) == grpc::StatusCode::OK);
  CHECK(dr.results(0).token_ids_size() == 2);
  CHECK(code_of(dr.results(1).status()) == grpc::StatusCode::NOT_FOUND);
  CHECK(code_of(dr.results(2).status()) == grpc::StatusCode::NOT_FOUND);
  CHECK(code_of(dr.results(3).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(code_of(dr.results(4).status()) == grpc::StatusCode::FAILED_PRECONDITION);

  // OUT_OF_RANGE: the sequence reaches max_seq_len part way; the tokens before count.
  {
    v1::PrefillRequest p;
    add_prefill(p, 7, test_prompt(7, 60));
    v1::PrefillResponse pr;
    REQUIRE(t.prefill(p, &pr).ok());
    REQUIRE(pr.results(0).seq_len() == 61);
    v1::DecodeResponse r;
    REQUIRE(t.decode(decode_request({7, 1}, 5), &r).ok());
    CHECK(code_of(r.results(0).status()) == grpc::StatusCode::OUT_OF_RANGE);
    CHECK(r.results(0).token_ids_size() == 3);
    CHECK(r.results(0).seq_len() == 64);
    CHECK(code_of(r.results(1).status()) == grpc::StatusCode::OK);
    CHECK(r.results(1).token_ids_size() == 5);
  }

  // ABORTED: a call on a sequence that another call is stepping. The probe is a full
  // replay (it would change nothing) until the long call starts.
  {
    const uint32_t len = resp.results(4).seq_len();
    auto long_call = std::async(std::launch::async, [&] {
      v1::DecodeResponse r;
      const grpc::Status st = t.decode(decode_request({5}, 20), &r);
      return std::make_pair(st, r);
    });
    v1::DecodeRequest probe = decode_request({5}, 1);
    probe.mutable_sequences(0)->set_expected_len(len - 1);
    bool saw_aborted = false;
    const auto end = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < end && !saw_aborted) {
      v1::DecodeResponse busy;
      REQUIRE(t.decode(probe, &busy).ok());
      const auto code = code_of(busy.results(0).status());
      saw_aborted = code == grpc::StatusCode::ABORTED;
      if (code == grpc::StatusCode::FAILED_PRECONDITION) break;  // the long call is already done
    }
    CHECK(saw_aborted);
    auto [st, r] = long_call.get();
    REQUIRE(st.ok());
    CHECK(code_of(r.results(0).status()) == grpc::StatusCode::OK);
    CHECK(r.results(0).token_ids_size() == 20);
  }

  const StreamResult s = stream.get();
  CHECK(s.status.ok());
  CHECK(s.finish == v1::FINISH_REASON_LENGTH);
  CHECK(s.tokens.size() == 56);  // max_seq_len 64 stops 8 + 60 at 64
  REQUIRE(t.release({1, 2, 5, 6, 7}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: an exhausted pool is a per-sequence RESOURCE_EXHAUSTED with a retry hint",
          "[server][errors]") {
  auto t = TestServer::start({"num_pages=8"});  // 128 tokens
  v1::PrefillRequest req;
  add_prefill(req, 1, test_prompt(1, 60));  // 4 pages
  add_prefill(req, 2, test_prompt(2, 60));  // 4 pages
  add_prefill(req, 3, test_prompt(3, 60));  // no room
  v1::PrefillResponse resp;
  REQUIRE(t.prefill(req, &resp).ok());
  CHECK(code_of(resp.results(0).status()) == grpc::StatusCode::OK);
  CHECK(code_of(resp.results(1).status()) == grpc::StatusCode::OK);
  CHECK(code_of(resp.results(2).status()) == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(resp.results(2).status().retry_after_ms() > 0);
  CHECK(t.load().num_router_sequences() == 2);  // the failed one left nothing behind

  // Decoding past the last page needs a page no one can give.
  v1::DecodeResponse dr;
  REQUIRE(t.decode(decode_request({1, 2}, 5), &dr).ok());
  CHECK(code_of(dr.results(0).status()) == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(dr.results(0).status().retry_after_ms() > 0);

  // A Generate request larger than the whole pool fails at once.
  const StreamResult big = generate(*t.stub, generate_request(test_prompt(4, 200), 4));
  CHECK(big.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);

  // After a release, the same request fits.
  REQUIRE(t.release({2}).ok());
  v1::PrefillRequest again;
  add_prefill(again, 3, test_prompt(3, 60));
  REQUIRE(t.prefill(again, &resp).ok());
  CHECK(code_of(resp.results(0).status()) == grpc::StatusCode::OK);
  REQUIRE(t.release({1, 3}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a full queue is RESOURCE_EXHAUSTED with grpc-retry-pushback-ms", "[server][errors]") {
  auto t = TestServer::start({"num_pages=8"}, [](server::ServerOptions& o) { o.loop.max_waiting = 2; });
  v1::PrefillRequest hold;
  add_prefill(hold, 1, test_prompt(1, 110));  // 7 of 8 pages: Generate requests must wait
  v1::PrefillResponse hr;
  REQUIRE(t.prefill(hold, &hr).ok());
  REQUIRE(code_of(hr.results(0).status()) == grpc::StatusCode::OK);

  std::vector<std::future<StreamResult>> waiting;
  for (int i = 0; i < 2; ++i) {
    waiting.push_back(std::async(std::launch::async, [&, i] {
      return generate(*t.stub, generate_request(test_prompt(i + 2, 30), 3));
    }));
  }
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (t.load().num_waiting() < 2 && Clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  REQUIRE(t.load().num_waiting() == 2);

  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(10));
  auto reader = t.stub->Generate(&ctx, generate_request(test_prompt(9, 30), 3));
  v1::GenerateResponse msg;
  CHECK(!reader->Read(&msg));
  const grpc::Status st = reader->Finish();
  CHECK(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto hint = trailers.find("grpc-retry-pushback-ms");
  REQUIRE(hint != trailers.end());
  CHECK(std::stoi(std::string(hint->second.data(), hint->second.size())) > 0);

  REQUIRE(t.release({1}).ok());  // the queued requests now run
  for (auto& w : waiting) {
    const StreamResult r = w.get();
    CHECK(r.status.ok());
    CHECK(r.tokens.size() == 3);
  }
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: while draining, new work is UNAVAILABLE and in-flight work finishes", "[server][errors]") {
  auto t = TestServer::start();
  v1::PrefillRequest pre;
  add_prefill(pre, 1, test_prompt(1, 8));
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  std::promise<void> first_token;
  auto stream = std::async(std::launch::async, [&] {
    bool once = false;
    return generate(*t.stub, generate_request(test_prompt(2, 8), 200), 60, [&](int) {
      if (!once) first_token.set_value(), once = true;
    });
  });
  first_token.get_future().wait();
  auto drained = std::async(std::launch::async, [&] { t.server->drain(30); });
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (t.load().serving() && Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(1));

  CHECK(generate(*t.stub, generate_request({1, 2, 3}, 2)).status.error_code() ==
        grpc::StatusCode::UNAVAILABLE);
  v1::PrefillRequest create;
  add_prefill(create, 2, {1, 2, 3});
  REQUIRE(t.prefill(create, &pr).ok());
  CHECK(code_of(pr.results(0).status()) == grpc::StatusCode::UNAVAILABLE);
  // Work on the router's live sequence goes on, until it releases it.
  v1::DecodeResponse dr;
  REQUIRE(t.decode(decode_request({1}, 3), &dr).ok());
  CHECK(code_of(dr.results(0).status()) == grpc::StatusCode::OK);
  REQUIRE(t.release({1}).ok());

  const StreamResult r = stream.get();
  CHECK(r.status.ok());
  CHECK(r.tokens.size() == 200);
  drained.get();
  // Stopped: calls now fail UNAVAILABLE (or cannot connect at all).
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(2));
  v1::GetInfoResponse info;
  CHECK(t.stub->GetInfo(&ctx, {}, &info).error_code() == grpc::StatusCode::UNAVAILABLE);
}

TEST_CASE("server: an engine fault is INTERNAL for its sequence and flips health to NOT_SERVING",
          "[server][errors]") {
  // The engine reports non-finite logits as a per-sequence INTERNAL; the hook injects
  // exactly that status for chosen sequences.
  auto poison = std::make_shared<std::atomic<uint64_t>>(0);
  auto t = TestServer::start({}, [poison](server::ServerOptions& o) {
    o.loop.result_hook = [poison](std::vector<StepResult>& results) {
      for (auto& r : results) {
        if (r.id == poison->load() && r.token) {
          r.token.reset();
          r.status = absl::InternalError("non-finite logits (injected)");
        }
      }
    };
  });
  auto health = grpc::health::v1::Health::NewStub(t.channel);
  auto serving = [&] {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse resp;
    REQUIRE(health->Check(&ctx, {}, &resp).ok());
    return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  };
  CHECK(serving());

  poison->store(42);
  v1::PrefillRequest req;
  add_prefill(req, 41, test_prompt(1, 8));
  add_prefill(req, 42, test_prompt(2, 8));
  v1::PrefillResponse resp;
  REQUIRE(t.prefill(req, &resp).ok());
  CHECK(code_of(resp.results(0).status()) == grpc::StatusCode::OK);
  CHECK(code_of(resp.results(1).status()) == grpc::StatusCode::INTERNAL);
  CHECK(!serving());
  CHECK(!t.load().serving());

  poison->store(77);
  const StreamResult r = generate(*t.stub, generate_request(test_prompt(3, 8), 5, 77));
  CHECK(r.status.error_code() == grpc::StatusCode::INTERNAL);
  REQUIRE(t.release({41, 42}).ok());
  CHECK(t.wait_all_pages_free());
}
