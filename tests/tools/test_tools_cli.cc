// kvfuse-run and kvfuse-eval as a user runs them: the same checks as the server, config
// keys from the environment and in either spelling; and the benchmarks on an FP8 preset.
#include <fstream>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "tests/util/checkpoint_test_util.h"
#include "tests/util/run_command.h"

#include "src/loading/config.h"

using kvfuse::testing::run_command;
using kvfuse::testing::TempDir;

namespace {
const std::string kRun = std::string(KVFUSE_RUN_BIN) + " --set device=cpu --set model=tiny -q ";
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Whether `help` (a program's --help) shows `value` as option `opt`'s default, on the
// option's line: "--reps INT=5" (CLI11 2.1) or "--reps INT [5]" (later CLI11).
bool shows_default(const std::string& help, const std::string& opt, const std::string& value) {
  const size_t at = help.find(opt + " ");
  REQUIRE(at != std::string::npos);
  const std::string line = help.substr(at, help.find('\n', at) - at);
  INFO(line);
  return has(line, "=" + value) || has(line, "[" + value + "]");
}

// The page count kvfuse-run's banner names ("..., 4096 pages x 16 tokens, ...").
long long pages_in_banner(const std::string& out) {
  const size_t at = out.find(" pages x ");
  REQUIRE(at != std::string::npos);
  const size_t from = out.rfind(' ', at - 1);
  return std::stoll(out.substr(from + 1, at - from - 1));
}
}  // namespace

TEST_CASE("kvfuse-run: prompt ids and max tokens are checked as the server checks them", "[tools][cli]") {
  // The tiny model's vocabulary is 1024: 1023 shifted by one is outside it, not wrapped.
  auto [rc, out] = run_command(kRun + "--prompt-ids 1,1023 -n 2 -m 2");
  INFO(out);
  CHECK(rc != 0);
  CHECK(has(out, "prompt 1"));
  CHECK(has(out, "outside the vocabulary"));
  // More tokens than max_seq_len: refused, not capped.
  std::tie(rc, out) = run_command(kRun + "--set max_seq_len=64 -n 1 -m 100");
  CHECK(rc != 0);
  CHECK(has(out, "exceeds max_seq_len 64"));
  std::tie(rc, out) = run_command(kRun + "-n 1 -m 3");
  CHECK(rc == 0);
  CHECK(has(out, "generated 3 tokens"));
}

TEST_CASE("kvfuse-run: config keys from the environment, dashes or underscores, flags win",
          "[tools][cli][config]") {
  auto [rc, out] = run_command("KVFUSE_KV_WRITE=unfused " + kRun + "-n 1 -m 1");
  INFO(out);
  CHECK(rc == 0);
  CHECK(has(out, "(unfused write)"));
  std::tie(rc, out) = run_command("KVFUSE_KV_WRITE=unfused " + kRun + "--set kv-write=fused -n 1 -m 1");
  CHECK(rc == 0);
  CHECK(has(out, "(fused write)"));
  std::tie(rc, out) = run_command("KVFUSE_KV_WRITE=sideways " + kRun + "-n 1 -m 1");
  CHECK(rc != 0);
  CHECK(has(out, "kv_write"));
}

TEST_CASE("kvfuse-eval: takes a bare list of prompts, as kvfuse-calibrate does", "[tools][cli]") {
  TempDir dir;
  {
    std::ofstream(dir / "bare.json") << "[[1, 2, 3], [4, 5]]";
    std::ofstream(dir / "object.json") << R"({"prompts": [[1, 2, 3], [4, 5]], "steps": 2})";
  }
  const std::string eval = std::string(KVFUSE_EVAL_BIN) + " --set device=cpu --set model=tiny --input ";
  auto [rc, out] = run_command(eval + (dir / "bare.json") + " --output " + (dir / "bare.out.json"));
  INFO(out);
  REQUIRE(rc == 0);
  std::tie(rc, out) = run_command(eval + (dir / "object.json") + " --output " + (dir / "object.out.json"));
  REQUIRE(rc == 0);
  const auto bare = nlohmann::json::parse(std::ifstream(dir / "bare.out.json"));
  const auto object = nlohmann::json::parse(std::ifstream(dir / "object.out.json"));
  REQUIRE(bare["results"].size() == 2);
  CHECK(bare["results"][1]["greedy"][0] == object["results"][1]["greedy"][0]);
}

// `program --help` runs and shows each (option, default) pair on the option's line.
static void check_help_defaults(const std::string& program,
                         const std::vector<std::pair<std::string, std::string>>& defaults) {
  auto [rc, out] = run_command(program + " --help");
  INFO(out);
  REQUIRE(rc == 0);
  for (const auto& [opt, value] : defaults) {
    CAPTURE(opt, value);
    CHECK(shows_default(out, opt, value));
  }
}

TEST_CASE("kvfuse-run and kvfuse-ab: --help shows the defaults", "[tools][cli]") {
  check_help_defaults(KVFUSE_RUN_BIN, {{"--num-prompts", "4"},
                                       {"--max-tokens", "32"},
                                       {"--prompt-ids", "1,2,3,4,5,6,7,8"},
                                       {"--temperature", "0"}});
  check_help_defaults(KVFUSE_AB_BIN, {{"--batch", "1,8,32"},
                                      {"--context", "512,2048"},
                                      {"--reps", "5"},
                                      {"--warmup", "1"},
                                      {"--steps", "16"}});
}

// One default: kvfuse-run without --config, kvfuse-server without --config and the
// default config file the server ships with (config/cpu-default.json: scripts/serve.sh,
// the CPU image) give the same KV pool, the built-in default's.
TEST_CASE("kvfuse-run: the default KV pool is the default config's", "[tools][cli][config]") {
  auto [rc, out] = run_command(std::string(KVFUSE_RUN_BIN) + " --set device=cpu -q -n 1 -m 1");
  INFO(out);
  REQUIRE(rc == 0);
  const long long built_in = pages_in_banner(out);
  CHECK(built_in == kvfuse::Config{}.num_pages);
  const std::string default_config = KVFUSE_SOURCE_DIR "/config/cpu-default.json";
  std::tie(rc, out) =
      run_command(std::string(KVFUSE_RUN_BIN) + " --config " + default_config + " -q -n 1 -m 1");
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(pages_in_banner(out) == built_in);
}

// The benchmarks take FP8-weight models as any other (issue 46's presets), and say which
// weights they ran in their header and JSON.
TEST_CASE("kvfuse-ab and kvfuse-bench-engine: an FP8-weight preset runs and is named as such", "[tools][fp8]") {
  TempDir dir;
  const std::string fp8 = "weights preset fp8_e4m3 W8A8";
  for (const auto& [bin, extra] : std::vector<std::pair<std::string, std::string>>{
           {KVFUSE_AB_BIN, " --reps 5 --json "}, {KVFUSE_BENCH_ENGINE_BIN, " --reps 3 --warmup 1 --json "}}) {
    const std::string json_path = dir / "out.json";
    auto [rc, out] = run_command(bin + " --set device=cpu --set model=tiny-fp8 --batch 1 --context 32 --steps 2" +
                                 extra + json_path);
    INFO(bin << ": " << out);
    REQUIRE(rc == 0);
    CHECK(has(out, "model tiny-fp8 (" + fp8));
    std::ifstream in(json_path);
    const nlohmann::json j = nlohmann::json::parse(in);
    CHECK(j["meta"]["model"] == "tiny-fp8");
    CHECK(j["meta"]["weights"].get<std::string>().find(fp8.substr(8)) == 0);
  }
}
