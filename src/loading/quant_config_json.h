// Checked JSON access for the quantization_config parsers (src/loading/quant_config.cc,
// src/loading/quant_config_formats.cc); not an API of its own. Every getter reads an
// optional member, reports a wrong JSON type as INVALID_ARGUMENT naming the key path,
// and never throws.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "src/loading/quant_config.h"

namespace kvfuse::quant_json {

inline constexpr char kFp8Hint[] = "kvfuse serves FP8 e4m3 weights with per-tensor or per-channel scales";

// The file, and the error forms: "<source>: <key path>: <what>".
struct Ctx {
  const std::string& source;
  absl::Status invalid(const std::string& path, absl::string_view what) const;      // INVALID_ARGUMENT
  absl::Status unsupported(const std::string& path, absl::string_view what) const;  // UNIMPLEMENTED
};

std::string shown(const nlohmann::json& v);  // compact JSON, at most 80 characters
std::string in_quotes(absl::string_view s);
std::string lower(std::string s);
// path.name for identifier-like names, path['name'] for patterns and module paths.
std::string child(const std::string& path, const std::string& name);

// The member `key` of `obj`, or nullptr when absent or null (or obj is not an object).
const nlohmann::json* get(const nlohmann::json& obj, const char* key);
// Absent or null leave `out` nullopt (nullptr, empty).
absl::Status get_string(const Ctx& c, const nlohmann::json& obj, const std::string& path, const char* key,
                        std::optional<std::string>& out);
absl::Status get_bool(const Ctx& c, const nlohmann::json& obj, const std::string& path, const char* key,
                      std::optional<bool>& out);
absl::Status get_int(const Ctx& c, const nlohmann::json& obj, const std::string& path, const char* key,
                     std::optional<int64_t>& out);
absl::Status get_object(const Ctx& c, const nlohmann::json& obj, const std::string& path, const char* key,
                        const nlohmann::json*& out);
// A list of strings, appended to `out`.
absl::Status get_strings(const Ctx& c, const nlohmann::json& obj, const std::string& path, const char* key,
                         std::vector<std::string>& out);
// Absent, null or {}.
bool empty_or_null(const nlohmann::json* v);
// Every "re:" entry of `list` (at `path`) compiles as an ECMAScript regex.
absl::Status check_regexes(const Ctx& c, const std::string& path, const std::vector<std::string>& list);
// "A and B describe different schemes (...): kvfuse serves one scheme for all linear layers".
std::string different_schemes(const LinearQuant& a, const LinearQuant& b);

// The method parsers: `q` is the quantization_config object at `path`; they fill
// out.linear, ignore, targets, kv_cache_scales (src/loading/quant_config_formats.cc).
absl::Status parse_compressed_tensors(const Ctx& c, const nlohmann::json& q, const std::string& path,
                                      QuantConfig& out);
absl::Status parse_quark(const Ctx& c, const nlohmann::json& q, const std::string& path, QuantConfig& out);

}  // namespace kvfuse::quant_json
