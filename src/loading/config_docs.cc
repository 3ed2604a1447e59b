#include "src/loading/config_docs.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "src/loading/config.h"
#include "src/loading/env_switches.h"

namespace kvfuse {

namespace {

// Text for a table cell: a '|' would end the cell.
std::string cell(const std::string& text) { return absl::StrReplaceAll(text, {{"|", "\\|"}}); }

// A default as one would write it in a config file: a string without its quotes (the
// empty string as ""), numbers, null and lists as JSON.
std::string default_cell(const nlohmann::json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    return s.empty() ? "`\"\"`" : absl::StrCat("`", cell(s), "`");
  }
  return absl::StrCat("`", cell(v.dump()), "`");
}

}  // namespace

std::string config_keys_markdown() {
  const nlohmann::json defaults = config_to_json(Config{});
  std::string out =
      "### Keys\n\n"
      "| key | values (type/range) | default | env var | meaning |\n"
      "|---|---|---|---|---|\n";
  for (const ConfigKeyDoc& d : config_key_docs()) {
    const std::string key = config_key_name(d.key);
    const std::string dflt = defaults.contains(key) ? default_cell(defaults.at(key)) : "";
    absl::StrAppend(&out, "| `", key, "` | ", cell(d.values), " | ", dflt, " | `", config_env_name(key),
                    "` | ", cell(d.meaning), " |\n");
  }
  absl::StrAppend(&out,
                  "\n### Switches\n\n"
                  "| variable | values | default | meaning | read by |\n"
                  "|---|---|---|---|---|\n");
  for (const EnvSwitch& s : env_switches()) {
    absl::StrAppend(&out, "| `", s.name, "` | ", cell(s.values), " | ", *s.dflt ? cell(s.dflt) : "unset",
                    " | ", cell(s.meaning), " | ", s.read_by, " |\n");
  }
  return out;
}

}  // namespace kvfuse
