#include "tools/tool_util.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse::tools {

using nlohmann::json;

absl::StatusOr<json> read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be opened"));
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  return j;
}

absl::StatusOr<json> config_json(const std::string& path, const std::vector<std::string>& overrides) {
  json j = json::object();
  if (!path.empty()) {
    auto f = read_json_file(path);
    if (!f.ok()) return f.status();
    j = std::move(*f);
    if (!j.is_object())
      return absl::InvalidArgumentError(absl::StrCat(path, ": the config must be a JSON object"));
  }
  KVFUSE_RETURN_IF_ERROR(apply_config_env(j));
  for (const auto& o : overrides) {
    KVFUSE_RETURN_IF_ERROR(apply_config_override(j, o));
  }
  return j;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> token_lists(const json& j, const std::string& what) {
  if (!j.is_array() || j.empty())
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a non-empty list of lists"));
  std::vector<std::vector<int32_t>> out;
  for (const json& p : j) {
    if (!p.is_array())
      return absl::InvalidArgumentError(absl::StrCat(what, ": entry ", out.size(), " is not a list"));
    std::vector<int32_t> ids;
    for (const json& t : p) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": entry ", out.size(), " holds a value that is not a token id"));
      }
      ids.push_back(int32_t(t.get<int64_t>()));
    }
    out.push_back(std::move(ids));
  }
  return out;
}

absl::Status write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  f.close();
  if (!f) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

int fail(const char* tool, const absl::Status& st) {
  std::fprintf(stderr, "%s: %s\n", tool, st.ToString().c_str());
  return 2;
}

}  // namespace kvfuse::tools
