// Failure paths of the service that a well-behaved client never takes: cancelled calls
// racing with other callers on the same ids, retried extends, a port already in use,
// and an engine step that does not come back.
#include <condition_variable>
#include <future>
#include <optional>

#include "absl/strings/str_cat.h"
#include "server/batch_calls.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// A result hook that holds the engine loop inside a step while `hold` is set: a stuck
// device call, or a step slow enough for a client's deadline to pass.
struct StepStall {
  std::mutex mu;
  std::condition_variable cv;
  bool hold = false;
  int held_steps = 0;

  std::function<void(std::vector<StepResult>&)> hook() {
    return [this](std::vector<StepResult>&) {
      std::unique_lock<std::mutex> lock(mu);
      if (!hold) return;
      ++held_steps;
      cv.notify_all();
      // Bounded, so that a failing test cannot hang the suite.
      cv.wait_for(lock, std::chrono::seconds(60), [this] { return !hold; });
    };
  }
  void set(bool h) {
    std::lock_guard<std::mutex> lock(mu);
    hold = h;
    cv.notify_all();
  }
  bool wait_held(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return held_steps > 0; });
  }
};

grpc::health::v1::HealthCheckResponse::ServingStatus health(grpc::Channel& ch) {
  auto stub = grpc::health::v1::Health::NewStub(std::shared_ptr<grpc::Channel>(&ch, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(5));
  grpc::health::v1::HealthCheckResponse resp;
  REQUIRE(stub->Check(&ctx, {}, &resp).ok());
  return resp.status();
}

bool wait_health(grpc::Channel& ch, grpc::health::v1::HealthCheckResponse::ServingStatus want,
                 double timeout_s) {
  const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (Clock::now() < end) {
    if (health(ch) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST_CASE("server: a cancelled Prefill releases only the sequences it still owns", "[server][reliability]") {
  // Call A prefills X (short) and Y1..Y4 (long); X finishes, another caller releases
  // X and creates a new X; then A is cancelled. The new X is not A's to release.
  auto engine = Engine::create(test_config({"max_batch_tokens=16"}));
  REQUIRE(engine.ok());
  Scheduler sched(**engine);
  const SeqId x = 1;
  v1::PrefillRequest req;
  add_prefill(req, x, test_prompt(1, 4));
  for (SeqId y = 2; y <= 5; ++y) add_prefill(req, y, test_prompt(int(y), 200));
  v1::PrefillResponse resp;
  auto call = server::BatchCall::prefill(sched, **engine, req, &resp, true, 100);
  auto x_running = [&] {
    const auto ids = call->running();
    return std::find(ids.begin(), ids.end(), x) != ids.end();
  };
  for (int guard = 0; x_running() && guard < 100; ++guard) {
    REQUIRE(sched.step().ok());
    for (const RouterResult& r : sched.take_router_results()) call->on_result(r);
  }
  REQUIRE(!x_running());
  REQUIRE(!call->done());  // the Y's are still being prefilled

  REQUIRE(sched.router_release(x).ok());
  REQUIRE(sched.router_prefill(x, test_prompt(7, 4), SamplingParams{}, false, true).ok());
  call->cancel(sched, absl::CancelledError("call cancelled"));
  CHECK(sched.is_router_sequence(x));
  for (SeqId y = 2; y <= 5; ++y) CHECK(!sched.is_router_sequence(y));

  // The new X's own task runs to its end.
  std::optional<absl::Status> x_status;
  for (int guard = 0; guard < 100 && !x_status; ++guard) {
    for (const RouterResult& r : sched.take_router_results()) {
      if (r.id == x) x_status = r.status;
    }
    if (!x_status) REQUIRE(sched.step().ok());
  }
  REQUIRE(x_status.has_value());
  CHECK(x_status->ok());
  CHECK(sched.router_release(x).ok());
}

TEST_CASE("server: a timed-out Prefill extend retried with expected_len is not appended twice",
          "[server][reliability]") {
  StepStall stall;
  auto t = TestServer::start({"max_batch_tokens=16"},
                             [&](server::ServerOptions& o) { o.loop.result_hook = stall.hook(); });
  const auto prompt = test_prompt(1, 8);
  const auto chunk = test_prompt(2, 64);
  v1::PrefillRequest create;
  add_prefill(create, 1, prompt);
  v1::PrefillResponse created;
  REQUIRE(t.prefill(create, &created).ok());
  REQUIRE(created.results(0).status().code() == 0);
  const uint32_t len = created.results(0).seq_len();  // the prompt and its sampled token
  REQUIRE(len == prompt.size() + 1);

  // The reference: the same tokens in one prefill.
  std::vector<int32_t> whole = prompt;
  whole.push_back(created.results(0).token_id());
  whole.insert(whole.end(), chunk.begin(), chunk.end());
  v1::PrefillRequest one_shot;
  add_prefill(one_shot, 2, whole);
  v1::PrefillResponse reference;
  REQUIRE(t.prefill(one_shot, &reference).ok());
  REQUIRE(reference.results(0).status().code() == 0);

  v1::PrefillRequest extend;
  add_prefill(extend, 1, chunk, /*extend=*/true)->set_expected_len(len);
  // The first attempt: its chunk is appended, then the step stalls past the deadline.
  stall.set(true);
  v1::PrefillResponse first;
  CHECK(t.prefill(extend, &first, 0.5).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  // (On a very slow machine the cancel may even come before the first step: the retry
  // then finds all of the chunk pending, which it handles alike.)
  stall.set(false);

  // The retry finishes the first attempt's work (ABORTED while the cancelled task is
  // still being ended: a client retries that).
  v1::PrefillResponse retry;
  for (int attempt = 0; attempt < 200; ++attempt) {
    retry.Clear();
    REQUIRE(t.prefill(extend, &retry).ok());
    if (code_of(retry.results(0).status()) != grpc::StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  INFO(retry.results(0).status().message());
  REQUIRE(code_of(retry.results(0).status()) == grpc::StatusCode::OK);
  CHECK(retry.results(0).seq_len() == whole.size() + 1);
  CHECK(retry.results(0).token_id() == reference.results(0).token_id());

  // Once more: the extend is done; the same result, nothing appended.
  v1::PrefillResponse again;
  REQUIRE(t.prefill(extend, &again).ok());
  CHECK(code_of(again.results(0).status()) == grpc::StatusCode::OK);
  CHECK(again.results(0).seq_len() == whole.size() + 1);
  CHECK(again.results(0).token_id() == reference.results(0).token_id());

  // Any other length is a caller's mistake.
  v1::PrefillRequest stale;
  add_prefill(stale, 1, chunk, /*extend=*/true)->set_expected_len(len + 1);
  v1::PrefillResponse refused;
  REQUIRE(t.prefill(stale, &refused).ok());
  CHECK(code_of(refused.results(0).status()) == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(t.release({1, 2}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a port in use is refused with an error naming it", "[server][reliability]") {
  auto first = TestServer::start({}, [](server::ServerOptions& o) { o.metrics_port = 0; });
  const std::string grpc_port = std::to_string(first.server->port());
  const std::string metrics_port = std::to_string(first.server->metrics_port());

  server::ServerOptions same_grpc;
  same_grpc.loop.config = test_config();
  same_grpc.listen = "127.0.0.1:" + grpc_port;
  same_grpc.metrics_port = -1;
  auto second = server::KvfuseServer::start(std::move(same_grpc));
  REQUIRE(!second.ok());
  CHECK(second.status().message().find("127.0.0.1:" + grpc_port) != std::string::npos);

  server::ServerOptions same_metrics;
  same_metrics.loop.config = test_config();
  same_metrics.listen = "127.0.0.1:0";
  same_metrics.metrics_port = first.server->metrics_port();
  auto third = server::KvfuseServer::start(std::move(same_metrics));
  REQUIRE(!third.ok());
  CHECK(third.status().message().find("127.0.0.1:" + metrics_port) != std::string::npos);

  // The first server still serves everything.
  CHECK(generate(*first.stub, generate_request(test_prompt(1, 4), 3)).status.ok());
}

TEST_CASE("server: the watchdog turns health NOT_SERVING while a step is stuck, and back after",
          "[server][reliability]") {
  using Status = grpc::health::v1::HealthCheckResponse;
  StepStall stall;
  auto t = TestServer::start({}, [&](server::ServerOptions& o) {
    o.loop.result_hook = stall.hook();
    o.loop.watchdog_s = 0.2;
  });
  REQUIRE(health(*t.channel) == Status::SERVING);
  stall.set(true);
  auto stream = std::async(std::launch::async, [&] {
    return generate(*t.stub, generate_request({1, 2, 3}, 20));
  });
  REQUIRE(stall.wait_held(30));
  CHECK(wait_health(*t.channel, Status::NOT_SERVING, 30));
  CHECK(t.server->loop().stalled());
  stall.set(false);
  const StreamResult r = stream.get();
  CHECK(r.status.ok());
  CHECK(r.tokens.size() == 20);
  CHECK(wait_health(*t.channel, Status::SERVING, 30));
  CHECK(!t.server->loop().stalled());
}

TEST_CASE("server: the watchdog stays quiet on an idle server", "[server][reliability]") {
  auto t = TestServer::start({}, [&](server::ServerOptions& o) { o.loop.watchdog_s = 0.05; });
  // Idle: no work pending, so no progress is no stall.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(!t.server->loop().stalled());
  CHECK(health(*t.channel) == grpc::health::v1::HealthCheckResponse::SERVING);
}
