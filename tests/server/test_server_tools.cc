// kvfuse-cli and kvfuse-bench-serve against an in-process server on a loopback port.
#include <sys/wait.h>

#include <cstdio>
#include <future>

#include "tests/util/run_command.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::pair<int, std::string> run(const std::string& cmd) { return kvfuse::testing::run_command(cmd); }

}  // namespace

TEST_CASE("kvfuse-cli: info, load, health, generate, prefill, decode, release, abort", "[server][tools]") {
  auto t = TestServer::start();
  const std::string cli = std::string(KVFUSE_CLI_BIN) + " --addr " + t.server->address() + " ";
  const auto prompt = test_prompt(1, 8);
  const auto expected = expected_tokens(test_config(), {prompt}, 5);

  auto [rc, out] = run(cli + "info");
  CHECK(rc == 0);
  CHECK(out.find("\"kvFormat\":\"fp8_e4m3fn\"") != std::string::npos);
  std::tie(rc, out) = run(cli + "health");
  CHECK(rc == 0);
  CHECK(out.find("SERVING") != std::string::npos);

  std::string ids;
  for (int32_t tok : prompt) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(tok);
  }
  std::tie(rc, out) = run(cli + "generate --prompt-ids " + ids + " --max-tokens 5");
  CHECK(rc == 0);
  std::string want;
  for (int32_t tok : expected[0]) {
    want += ' ';
    want += std::to_string(tok);
  }
  CHECK(out.find(want + "\n") != std::string::npos);
  CHECK(out.find("finish_reason=FINISH_REASON_LENGTH prompt_tokens=8 completion_tokens=5") !=
        std::string::npos);

  std::tie(rc, out) = run(cli + "prefill --id 9 --prompt-ids " + ids);
  CHECK(rc == 0);
  CHECK(out.find("\"tokenId\":" + std::to_string(expected[0][0])) != std::string::npos);
  std::tie(rc, out) = run(cli + "decode --id 9 --steps 2 --expected-len 9");
  CHECK(rc == 0);
  CHECK(out.find("\"tokenIds\":[" + std::to_string(expected[0][1]) + "," + std::to_string(expected[0][2]) +
                 "]") != std::string::npos);
  // An extend with --expected-len, then its retry: appended once (11 tokens + 2).
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::tie(rc, out) = run(cli + "prefill --id 9 --extend --no-sample --prompt-ids 1,2 --expected-len 11");
    CHECK(rc == 0);
    CHECK(out.find("\"seqLen\":13") != std::string::npos);
  }
  std::tie(rc, out) = run(cli + "load");
  CHECK(rc == 0);
  CHECK(out.find("\"numRouterSequences\":1") != std::string::npos);
  // Stop rules from the command line: at most 3 sampled tokens, the prefill's included.
  std::tie(rc, out) = run(cli + "prefill --id 10 --prompt-ids " + ids + " --max-new-tokens 3 --stop-ids 1023");
  CHECK(rc == 0);
  std::tie(rc, out) = run(cli + "decode --id 10 --steps 5");
  CHECK(rc == 0);
  CHECK(out.find("\"tokenIds\":[" + std::to_string(expected[0][1]) + "," + std::to_string(expected[0][2]) +
                 "]") != std::string::npos);
  CHECK(out.find("\"finishReason\":\"FINISH_REASON_LENGTH\"") != std::string::npos);
  // Logprobs from the command line: prefill and decode print them in the JSON, generate
  // one line per token after the finish line.
  std::tie(rc, out) = run(cli + "prefill --id 12 --prompt-ids " + ids + " --top-logprobs 2 --prompt-logprobs");
  CHECK(rc == 0);
  CHECK(out.find("\"logprob\":{\"tokenId\":" + std::to_string(expected[0][0])) != std::string::npos);
  CHECK(out.find("\"promptLogprobs\":[") != std::string::npos);
  std::tie(rc, out) = run(cli + "decode --id 12 --steps 2 --logprobs");
  CHECK(rc == 0);
  CHECK(out.find("\"logprobs\":[{\"tokenId\":" + std::to_string(expected[0][1])) != std::string::npos);
  std::tie(rc, out) = run(cli + "release --id 12");
  CHECK(rc == 0);
  std::tie(rc, out) = run(cli + "generate --prompt-ids " + ids + " -m 2 --top-logprobs 1 --prompt-logprobs");
  CHECK(rc == 0);
  CHECK(out.find("\ntoken " + std::to_string(expected[0][0]) + " logprob -") != std::string::npos);
  CHECK(out.find("top " + std::to_string(expected[0][0]) + ":-") != std::string::npos);
  CHECK(out.find("\nprompt token ") != std::string::npos);
  std::tie(rc, out) = run(cli + "generate --prompt-ids 1,2 --top-logprobs 21");
  CHECK(rc == int(grpc::StatusCode::INVALID_ARGUMENT));
  CHECK(out.find("logprobs.top_n 21") != std::string::npos);
  std::tie(rc, out) = run(cli + "prefill --id 11 --prompt-ids 1 --stop-ids 1,x");
  CHECK(rc == 64);  // a wrong command line
  CHECK(out.find("--stop-ids") != std::string::npos);
  std::tie(rc, out) = run(cli + "release --id 10");
  CHECK(rc == 0);
  std::tie(rc, out) = run(cli + "release --id 9");
  CHECK(rc == 0);
  CHECK(out.find("\"released\":[\"9\"]") != std::string::npos);
  // A failed call exits with its gRPC code and says why.
  std::tie(rc, out) = run(cli + "abort --id 9");
  CHECK(rc == int(grpc::StatusCode::NOT_FOUND));
  CHECK(out.find("NOT_FOUND") != std::string::npos);
  std::tie(rc, out) = run(cli + "generate --prompt-ids 1,99999");
  CHECK(rc == int(grpc::StatusCode::INVALID_ARGUMENT));
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("kvfuse-cli: the exit code is 0 only when every result is OK and health is SERVING",
          "[server][tools]") {
  auto t = TestServer::start();
  const std::string cli = std::string(KVFUSE_CLI_BIN) + " --addr " + t.server->address() + " ";
  // A failed sequence of a call that succeeded: its code.
  auto [rc, out] = run(cli + "decode --id 4242 -n 2");
  INFO(out);
  CHECK(rc == int(grpc::StatusCode::NOT_FOUND));
  CHECK(out.find("NOT_FOUND") != std::string::npos);
  std::tie(rc, out) = run(cli + "prefill --id 5 --prompt-ids 1,2,3 --extend");
  CHECK(rc == int(grpc::StatusCode::NOT_FOUND));
  // The first failure in request order.
  std::tie(rc, out) = run(cli + "prefill --id 5 --prompt-ids 1,2,3");
  CHECK(rc == 0);
  std::tie(rc, out) = run(cli + "decode --id 5 --id 4243 -n 1 --expected-len 99");
  CHECK(rc == int(grpc::StatusCode::FAILED_PRECONDITION));
  std::tie(rc, out) = run(cli + "decode --id 4243 --id 5 -n 1");
  CHECK(rc == int(grpc::StatusCode::NOT_FOUND));
  // A service the health service does not know: the call fails NOT_FOUND.
  std::tie(rc, out) = run(cli + "health --service no.such.Service");
  CHECK(rc == int(grpc::StatusCode::NOT_FOUND));
  // A command line CLI11 refuses: 64; --help: 0.
  std::tie(rc, out) = run(cli + "decode -n 2");
  CHECK(rc == 64);
  std::tie(rc, out) = run(cli + "decode --help");
  CHECK(rc == 0);
  REQUIRE(t.release({5}).ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("kvfuse-cli: health NOT_SERVING exits 20", "[server][tools]") {
  // Held before its warm-up, the server answers health NOT_SERVING.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto t = TestServer::start(
      {}, [&](server::ServerOptions& o) { o.loop.before_warmup = [released] { released.wait(); }; },
      /*wait=*/false);
  const std::string cli = std::string(KVFUSE_CLI_BIN) + " --addr " + t.server->address() + " ";
  auto [rc, out] = run(cli + "health");
  INFO(out);
  CHECK(out.find("NOT_SERVING") != std::string::npos);
  CHECK(rc == 20);
  release.set_value();
  REQUIRE(t.server->wait_until_serving(30).ok());
  std::tie(rc, out) = run(cli + "health");
  CHECK(rc == 0);
}

TEST_CASE("kvfuse-bench-serve: concurrent streams, progress, throughput and latency percentiles",
          "[server][tools]") {
  auto t = TestServer::start();
  auto [rc, out] = run(std::string(KVFUSE_BENCH_SERVE_BIN) + " --addr " + t.server->address() +
                       " --concurrency 8 --duration-s 1.5 --prompt-len 16 --max-tokens 8");
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("[   1.0s] done") != std::string::npos);  // the progress line
  CHECK(out.find(" 0 failed") != std::string::npos);
  CHECK(out.find("tok/s") != std::string::npos);
  for (const char* row : {"TTFT  ms   p50", "ITL   ms   p50", "E2E   ms   p50"})
    CHECK(out.find(row) != std::string::npos);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("kvfuse-cli: flush-cache and kv-events", "[server][tools][prefix]") {
  auto t = TestServer::start();
  const std::string cli = std::string(KVFUSE_CLI_BIN) + " --addr " + t.server->address() + " ";
  REQUIRE(generate(*t.stub, generate_request(test_prompt(5, 40), 2)).status.ok());
  REQUIRE(t.wait_all_pages_free());
  auto [rc, out] = run(cli + "--timeout-s 1 kv-events --from 1");
  INFO(out);
  CHECK(rc == 0);  // the deadline ends the stream
  CHECK(out.find("\"sequenceNumber\":\"1\"") != std::string::npos);
  CHECK(out.find("\"blockStored\"") != std::string::npos);
  std::tie(rc, out) = run(cli + "flush-cache");
  CHECK(rc == 0);
  CHECK(out.find("\"pagesFlushed\":\"2\"") != std::string::npos);
  std::tie(rc, out) = run(cli + "--timeout-s 1 kv-events --from 99");
  CHECK(rc == int(grpc::StatusCode::INVALID_ARGUMENT));
  CHECK(out.find("start_sequence_number") != std::string::npos);
}

// Multi-turn conversations after a shared prefix: turns after the first find their history
// cached, and a conversation's first turn the shared prefix; with the cache off, nothing.
TEST_CASE("kvfuse-bench-serve: a multi-turn workload with a shared prefix prints the prefix cache's hit rate",
          "[server][tools][prefix]") {
  for (const bool cache : {true, false}) {
    CAPTURE(cache);
    auto t = TestServer::start({cache ? "prefix_cache=on" : "prefix_cache=off"});
    auto [rc, out] = run(std::string(KVFUSE_BENCH_SERVE_BIN) + " --addr " + t.server->address() +
                         " --concurrency 1 --duration-s 60 --max-requests 6 --prompt-len 8 --max-tokens 8"
                         " --shared-prefix-len 40 --turns 3");
    INFO(out);
    CHECK(rc == 0);
    CHECK(out.find("shared prefix 40, 3 turns") != std::string::npos);
    const size_t at = out.find("prefix cache  ");
    REQUIRE(at != std::string::npos);
    long long cached = -1, prompt = -1;
    REQUIRE(std::sscanf(out.c_str() + at, "prefix cache  %lld of %lld", &cached, &prompt) == 2);
    // One stream: 2 conversations of 3 turns, prompts of 48, 64 and 80 tokens.
    CHECK(prompt == 2 * (48 + 64 + 80));
    if (cache) {
      // Whole pages of 16 before each prompt's last token that an earlier turn computed:
      // turns 2 and 3 find 48 and 64 (the last turn's prompt and all but its last output
      // token); the second conversation's first turn finds the shared 40's 32.
      CHECK(cached == 48 + 64 + 32 + 48 + 64);
    } else {
      CHECK(cached == 0);
    }
    CHECK(t.wait_all_pages_free());
  }
}

TEST_CASE("kvfuse-cli: an error that cuts a stream starts on a line of its own", "[server][tools]") {
  TokenRecord record;
  auto t = TestServer::start({"max_seq_len=4096"},
                             [&](server::ServerOptions& o) { o.loop.result_hook = record.hook(); });
  // A stream long enough to be cut, its stdout and stderr on one pipe as in a terminal log.
  auto cli = std::async(std::launch::async, [&] {
    return run(std::string(KVFUSE_CLI_BIN) + " --addr " + t.server->address() +
               " generate --prompt-ids 1,2,3 --max-tokens 4000");
  });
  const auto end = Clock::now() + std::chrono::seconds(30);
  auto any_token = [&] {
    std::lock_guard<std::mutex> lock(record.mu);
    return !record.tokens.empty();
  };
  while (!any_token() && Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let some tokens reach the client
  t.server->loop().stop(absl::UnavailableError("server is shutting down"));
  const auto [rc, out] = cli.get();
  INFO(out);
  CHECK(rc == int(grpc::StatusCode::UNAVAILABLE));
  const auto at = out.find("kvfuse-cli: ");
  REQUIRE(at != std::string::npos);
  CHECK((at == 0 || out[at - 1] == '\n'));
}

TEST_CASE("kvfuse-server: config key flags take dashes, and KVFUSE_<KEY> variables are read",
          "[server][tools][config]") {
  // A bad value proves where the key was read, without starting a server.
  const std::string srv = std::string(KVFUSE_SERVER_BIN) + " --listen 127.0.0.1:0 --metrics-port -1 ";
  auto [rc, out] = run(srv + "--kv-write sideways");
  INFO(out);
  CHECK(rc != 0);
  CHECK(out.find("event=bad_config") != std::string::npos);
  CHECK(out.find("kv_write") != std::string::npos);
  std::tie(rc, out) = run("KVFUSE_KV_WRITE=sideways " + srv);
  CHECK(rc != 0);
  CHECK(out.find("event=bad_config") != std::string::npos);
  // The command line wins over the environment: only the flag's bad value is reported.
  std::tie(rc, out) = run("KVFUSE_KV_WRITE=unfused " + srv + "--kv_write sideways2");
  CHECK(rc != 0);
  CHECK(out.find("sideways2") != std::string::npos);
}

TEST_CASE("kvfuse-server: a KVFUSE_ variable that names no key or switch is a warning naming the closest",
          "[server][tools][config]") {
  // A bad value of a real key stops the server right after the environment is read.
  const std::string srv = std::string(KVFUSE_SERVER_BIN) + " --listen 127.0.0.1:0 --metrics-port -1 --kv-write x";
  auto [rc, out] = run("KVFUSE_KV_WRTE=unfused " + srv);
  INFO(out);
  CHECK(rc != 0);
  CHECK(out.find("event=unknown_env name=KVFUSE_KV_WRTE closest=KVFUSE_KV_WRITE") != std::string::npos);
  // Known names, a config key's and a switch's, are not warned about.
  std::tie(rc, out) = run("KVFUSE_CPU_GEMM=generic KVFUSE_JOBS=2 " + srv);
  CHECK(out.find("unknown_env") == std::string::npos);
  // --help-env lists both kinds.
  std::tie(rc, out) = run(std::string(KVFUSE_SERVER_BIN) + " --help-env");
  CHECK(rc == 0);
  for (const char* name : {"KVFUSE_KV_WRITE", "KVFUSE_NUM_PAGES", "KVFUSE_CPU_GEMM", "KVFUSE_GEMM_TUNE"}) {
    CHECK(out.find(name) != std::string::npos);
  }
}

TEST_CASE("kvfuse-server: an integer key beyond 64 bits is refused as typed, never wrapped",
          "[server][tools][config]") {
  // Bounded: a value that wraps to a valid one starts a server that would serve forever.
  const std::string srv =
      "timeout 60 " + std::string(KVFUSE_SERVER_BIN) + " --listen 127.0.0.1:0 --metrics-port -1 ";
  for (const auto& [flag, want] :
       {std::pair<std::string, std::string>{"--set sliding_window=18446744073709551615",
                                            "18446744073709551615 is out of range [-1, 16777216]"},
        {"--set tensor_parallel=18446744073709551615", "18446744073709551615 is out of range [1, 64]"},
        {"--set num_pages=99999999999999999999999", "99999999999999999999999 is out of range [0, 2147483647]"},
        {"--set page_size=-9223372036854775809", "-9223372036854775809 is out of range [1, 1024]"}}) {
    auto [rc, out] = run(srv + flag);
    INFO(flag << "\n" << out);
    CHECK(rc != 0);
    CHECK(out.find("event=bad_config") != std::string::npos);
    CHECK(out.find(want) != std::string::npos);
  }
  // The environment likewise.
  auto [rc, out] = run("KVFUSE_SLIDING_WINDOW=18446744073709551615 " + srv);
  INFO(out);
  CHECK(rc != 0);
  CHECK(out.find("18446744073709551615 is out of range [-1, 16777216]") != std::string::npos);
}

TEST_CASE("scripts/ci/router-check.sh: the router path through kvfuse-cli passes and leaves every page free",
          "[server][tools]") {
  auto t = TestServer::start();
  auto [rc, out] = run("timeout 120 " + std::string(KVFUSE_SOURCE_DIR) + "/scripts/ci/router-check.sh " +
                       KVFUSE_CLI_BIN + " " + t.server->address() + " 40");
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("its retry: 256 tokens") != std::string::npos);
  CHECK(out.find("PASS") != std::string::npos);
  CHECK(t.wait_all_pages_free());
}
