// kvfuse-cli and kvfuse-bench-serve against an in-process server on a loopback port.
#include <sys/wait.h>

#include <cstdio>

#include "tests/run_command.h"
#include "tests/test_server_util.h"

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
  std::tie(rc, out) = run(cli + "load");
  CHECK(rc == 0);
  CHECK(out.find("\"numRouterSequences\":1") != std::string::npos);
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
