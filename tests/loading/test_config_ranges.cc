// Integer config keys beyond what 64 bits hold: refused as written, with the key's
// range, from a JSON file, an override and the environment — never wrapped around.
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "src/loading/config.h"
#include "tests/util/catch.h"

using namespace kvfuse;
using nlohmann::json;

namespace {

std::string error_of(const json& j) {
  auto c = config_from_json(j);
  REQUIRE(!c.ok());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

}  // namespace

TEST_CASE("config: integers past int64 are out of range as written, from JSON, overrides and env",
          "[config][errors]") {
  // JSON holds 2^64 - 1 as an unsigned integer and larger ones as doubles.
  CHECK_THAT(error_of(json::parse(R"({"sliding_window": 18446744073709551615})")),
             Catch::Matchers::ContainsSubstring("'sliding_window': 18446744073709551615 is out of range [-1, 16777216]"));
  CHECK_THAT(error_of(json::parse(R"({"tensor_parallel": 9223372036854775808})")),
             Catch::Matchers::ContainsSubstring("9223372036854775808 is out of range [1, 64]"));
  CHECK_THAT(error_of(json::parse(R"({"num_pages": 1e30})")),
             Catch::Matchers::ContainsSubstring("'num_pages': 1e+30 is out of range [0, 2147483647]"));
  // A fraction is not an integer; int32's maximum is the pools' limit.
  CHECK_THAT(error_of(json::parse(R"({"num_pages": 2.5})")), Catch::Matchers::ContainsSubstring("is not an integer"));
  CHECK_THAT(error_of(json::parse(R"({"num_pages": 2147483648})")),
             Catch::Matchers::ContainsSubstring("2147483648 is out of range [0, 2147483647]"));
  CHECK(config_from_json(json::parse(R"({"num_pages": 2147483647})")).ok());

  // Overrides keep what was typed, also past 2^64.
  for (const auto& [text, want] :
       {std::pair<std::string, std::string>{"seed=18446744073709551615",
                                            "18446744073709551615 is out of range [0, 9223372036854775807]"},
        {"max_seq_len=123456789012345678901234567890", "123456789012345678901234567890 is out of range [2, 1048576]"},
        {"page_size=-99999999999999999999", "-99999999999999999999 is out of range [1, 1024]"}}) {
    json j = json::object();
    REQUIRE(apply_config_override(j, text).ok());
    INFO(text);
    CHECK_THAT(error_of(j), Catch::Matchers::ContainsSubstring(want));
  }
  // A string that only looks like a small integer is still not one.
  CHECK_THAT(error_of(json::parse(R"({"page_size": "16"})")), Catch::Matchers::ContainsSubstring("is not an integer"));

  // The environment.
  REQUIRE(setenv("KVFUSE_TENSOR_PARALLEL", "18446744073709551615", 1) == 0);
  json j = json::object();
  const absl::Status env = apply_config_env(j);
  unsetenv("KVFUSE_TENSOR_PARALLEL");
  REQUIRE(env.ok());
  CHECK_THAT(error_of(j), Catch::Matchers::ContainsSubstring("18446744073709551615 is out of range [1, 64]"));
}

TEST_CASE("config: a config file's integer past int64 is refused naming the file and the key", "[config][errors]") {
  const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") +
                           "/kvfuse_test_config_ranges.json";
  {
    std::ofstream out(path);
    out << R"({"model": "tiny", "max_running_seqs": 18446744073709551615})";
  }
  auto c = load_config_file(path);
  std::remove(path.c_str());
  REQUIRE(!c.ok());
  CHECK_THAT(std::string(c.status().message()),
             Catch::Matchers::ContainsSubstring("'max_running_seqs': 18446744073709551615 is out of range [1, 4096]"));
}

TEST_CASE("config: a KV scale a float cannot hold as a normal number is refused, not stored as 0",
          "[config][errors]") {
  // 1e-50 rounds to 0.0f; 1e-40 is subnormal, and its reciprocal overflows to inf.
  for (const char* key : {"k_scale", "v_scale"}) {
    for (double tiny : {1e-50, 1e-46, 1e-40, 1e-39}) {
      CAPTURE(key, tiny);
      CHECK_THAT(error_of({{key, tiny}}), Catch::Matchers::ContainsSubstring(std::string("'") + key + "'"));
      CHECK_THAT(error_of({{key, {1.0, tiny}}}), Catch::Matchers::ContainsSubstring("from 1.2e-38 to 3e38"));
    }
    auto c = config_from_json({{key, 1.2e-38}});
    REQUIRE(c.ok());
  }
}
