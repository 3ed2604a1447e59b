// Shared by kvfuse-eval and kvfuse-calibrate: the config from --config and --set (read
// the way kvfuse-run reads it), JSON files, and prompts as lists of token ids.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "src/loading/config.h"

namespace kvfuse::tools {

absl::StatusOr<nlohmann::json> read_json_file(const std::string& path);
// The config JSON: the file (if any), then each key=value override. Not yet validated,
// so that a tool can add its own keys before config_from_json.
absl::StatusOr<nlohmann::json> config_json(const std::string& path,
                                           const std::vector<std::string>& overrides);
// A list of non-empty lists of token ids.
absl::StatusOr<std::vector<std::vector<int32_t>>> token_lists(const nlohmann::json& j,
                                                              const std::string& what);
absl::Status write_text_file(const std::string& path, const std::string& text);
// Prints "tool: message" to stderr and returns the exit code 2.
int fail(const char* tool, const absl::Status& st);

}  // namespace kvfuse::tools
