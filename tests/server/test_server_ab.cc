// kvfuse-ab --server: the A/B against two running servers over gRPC (bench/ab/ab_server.h),
// against two in-process servers on the CPU with the tiny model. Checks what the mode
// measures and that it never leaves sequences or KV pages behind, not how fast it is.
#include <cmath>

#include "bench/ab/ab_server.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

ab::ServerAbOptions quiet_options(const TestServer& a, const TestServer& b) {
  ab::ServerAbOptions o;
  o.servers = {a.server->address(), b.server->address()};
  o.batches = {1, 2};
  o.contexts = {8, 16};
  o.reps = 5;
  o.warmup = 1;
  o.steps = 2;
  o.wait_serving_s = 30;
  o.rpc_timeout_s = 60;
  o.info_out = nullptr;
  o.progress_out = nullptr;
  return o;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void require_nothing_held(const TestServer& s) {
  REQUIRE(s.wait_all_pages_free());
  const auto load = s.load();
  CHECK(load.num_router_sequences() == 0);
  for (const auto& p : load.pools()) CHECK(p.used_pages() == 0);
}

}  // namespace

TEST_CASE("server A/B: every cell has reps positive samples per side and no page leaks", "[server][ab]") {
  TestServer a = TestServer::start({"kv_write=fused"});
  TestServer b = TestServer::start({"kv_write=unfused"});
  const ab::ServerAbOptions o = quiet_options(a, b);
  auto r = ab::run_server_ab(o);
  REQUIRE(r.ok());

  CHECK(r->a_name == "fused");
  CHECK(r->b_name == "unfused");
  CHECK(r->warnings.empty());  // the servers differ only in the write path
  REQUIRE(r->cells.size() == 4);
  size_t k = 0;
  for (int batch : o.batches) {
    for (int context : o.contexts) {
      const ab::Cell& c = r->cells[k++];
      CHECK(c.batch == batch);
      CHECK(c.context == context);
      REQUIRE(c.a.size() == size_t(o.reps));
      REQUIRE(c.b.size() == size_t(o.reps));
      for (const auto* side : {&c.a, &c.b}) {
        for (const ab::Sample& s : *side) {
          CHECK(s.step_ms > 0);
          CHECK(s.tokens_per_s > 0);
          // tokens/s = batch * steps / seconds, and step_ms = milliseconds / steps.
          CHECK(std::abs(s.tokens_per_s * s.step_ms / 1000.0 - double(batch)) < 1e-9 * batch);
        }
      }
      const ab::Summary sum = ab::summarize(c);
      CHECK(sum.ratio > 0);
      CHECK(sum.ci_low <= sum.ratio);
      CHECK(sum.ratio <= sum.ci_high);
    }
  }

  // The JSON meta names both servers and carries both GetInfo summaries.
  const auto& m = r->meta;
  CHECK(m.at("mode") == "server");
  CHECK(m.at("servers") == "server A " + a.server->address() + " / server B " + b.server->address());
  CHECK(m.at("info_a").at("kv_write") == "fused");
  CHECK(m.at("info_b").at("kv_write") == "unfused");
  CHECK(m.at("info_a").at("model") == "tiny");
  CHECK(m.at("decode_calls_per_rep") == 1);
  const nlohmann::json j = ab::to_json(r->cells, r->a_name, r->b_name, r->meta);
  CHECK(j.dump().find(a.server->address()) != std::string::npos);
  CHECK(contains(ab::render_table(r->cells, r->a_name, r->b_name), "unfused"));

  // Every sequence was released on both servers.
  require_nothing_held(a);
  require_nothing_held(b);

  // The servers still serve: a second run (fresh ids) works as well.
  ab::ServerAbOptions again = o;
  again.batches = {2};
  again.contexts = {8};
  again.steps = 300;  // above max_decode_steps (256): two Decode calls per repetition
  again.warmup = 0;
  again.reps = 2;
  auto r2 = ab::run_server_ab(again);
  REQUIRE(r2.ok());
  REQUIRE(r2->cells.size() == 1);
  CHECK(r2->cells[0].a.size() == 2);
  CHECK(r2->meta.at("decode_calls_per_rep") == 2);
  require_nothing_held(a);
  require_nothing_held(b);
}

TEST_CASE("server A/B: a cell beyond the server limits fails clearly before creating anything", "[server][ab]") {
  TestServer a = TestServer::start({"kv_write=fused", "max_seq_len=128", "max_running_seqs=4"});
  TestServer b = TestServer::start({"kv_write=unfused", "max_seq_len=128", "max_running_seqs=4"});

  SECTION("batch above max_running_seqs") {
    ab::ServerAbOptions o = quiet_options(a, b);
    o.batches = {1, 5};
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "batch 5"));
    CHECK(contains(msg, "max_running_seqs 4"));
    CHECK(contains(msg, a.server->address()));
  }
  SECTION("context plus decoded tokens above max_seq_len") {
    ab::ServerAbOptions o = quiet_options(a, b);
    o.contexts = {8, 100};  // 100 + (1 + 5) x 2 + 2 = 114 fits
    o.steps = 5;            // 100 + (1 + 5) x 5 + 2 = 132 does not
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "context 100"));
    CHECK(contains(msg, "max_seq_len is 128"));
    CHECK(contains(msg, "132"));
  }
  require_nothing_held(a);
  require_nothing_held(b);
}

TEST_CASE("server A/B: a cell the KV pool cannot hold fails clearly and releases what it created",
          "[server][ab]") {
  // 6 pages of 16 tokens: two sequences of 40 tokens fit (3 pages each), four do not.
  TestServer a = TestServer::start({"kv_write=fused", "num_pages=6"});
  TestServer b = TestServer::start({"kv_write=unfused", "num_pages=6"});
  ab::ServerAbOptions o = quiet_options(a, b);
  o.batches = {4};
  o.contexts = {40};
  o.warmup = 0;
  o.steps = 1;

  SECTION("larger than the whole pool: checked before anything is created") {
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "batch 4 x context 40"));
    CHECK(contains(msg, "needs 12 KV pages; the pool has 6"));
  }
  SECTION("pages held by another client: checked against GetLoad before prefilling") {
    // Another router sequence of 90 tokens holds all 6 pages of B.
    v1::PrefillRequest req;
    add_prefill(req, 7, test_prompt(0, 90), false, true);
    v1::PrefillResponse resp;
    REQUIRE(b.prefill(req, &resp).ok());
    REQUIRE(resp.results(0).status().code() == v1::SequenceStatus::OK);
    REQUIRE(b.used_pages() == 6);
    o.batches = {1};
    o.contexts = {8};
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "batch 1 x context 8 on server B"));
    CHECK(contains(msg, "only 0 of 6 are free"));
    CHECK(b.used_pages() == 6);  // the other client's pages are left alone
    REQUIRE(b.release({7}).ok());
  }
  SECTION("left to the server: Prefill answers RESOURCE_EXHAUSTED") {
    o.precheck_pages = false;
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "batch 4 x context 40 does not fit"));
    CHECK(contains(msg, "Prefill of sequence 3 of 4"));
    CHECK(contains(msg, "server A (" + a.server->address() + ")"));
  }
  SECTION("left to the server: the decoded tokens outgrow the pool") {
    // Two sequences of 16 tokens take 1 page each; decoding 2 x 8 more needs 2 each.
    o.precheck_pages = false;
    o.batches = {2};
    o.contexts = {16};
    o.steps = 8;
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(r.status().message());
    CHECK(contains(msg, "batch 2 x context 16"));
    CHECK(contains(msg, "Decode of sequence"));
  }
  // Pages of the sequences created before the failure came back (A's, and B's when
  // its turn came).
  require_nothing_held(a);
  require_nothing_held(b);
}

TEST_CASE("server A/B: one server per side, and differences besides the write path are reported",
          "[server][ab]") {
  SECTION("argument checks") {
    auto one = ab::check_server_args({"127.0.0.1:50051"}, false);
    CHECK(one.code() == absl::StatusCode::kInvalidArgument);
    CHECK(contains(std::string(one.message()), "one server per side"));
    CHECK(contains(std::string(one.message()), "kv_write=unfused"));  // says how to start them
    CHECK(ab::check_server_args({"x:1", "y:2", "z:3"}, false).code() == absl::StatusCode::kInvalidArgument);
    auto with_files = ab::check_server_args({"x:1", "y:2"}, true);
    CHECK(with_files.code() == absl::StatusCode::kInvalidArgument);
    CHECK(contains(std::string(with_files.message()), "--a/--b"));
    CHECK(ab::check_server_args({"x:1", "y:2"}, false).ok());
  }
  SECTION("run_server_ab with one server") {
    TestServer a = TestServer::start({"kv_write=fused"});
    ab::ServerAbOptions o = quiet_options(a, a);
    o.servers = {a.server->address()};
    auto r = ab::run_server_ab(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    require_nothing_held(a);
  }
  SECTION("same write path, different attention: A/A with warnings, still measured") {
    TestServer a = TestServer::start({"kv_write=fused"});
    TestServer b = TestServer::start({"kv_write=fused", "attention=split"});
    ab::ServerAbOptions o = quiet_options(a, b);
    o.batches = {2};
    o.contexts = {8};
    auto r = ab::run_server_ab(o);
    REQUIRE(r.ok());
    CHECK(r->a_name == "A");
    CHECK(r->b_name == "B");
    REQUIRE(r->warnings.size() == 2);
    CHECK(contains(r->warnings[0], "attention"));
    CHECK(contains(r->warnings[1], "A/A"));
    REQUIRE(r->cells.size() == 1);
    CHECK(r->cells[0].b.size() == 5);
    require_nothing_held(a);
    require_nothing_held(b);
  }
}
