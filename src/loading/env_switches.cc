#include "src/loading/env_switches.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/loading/config.h"

namespace kvfuse {

const std::vector<EnvSwitch>& env_switches() {
  static const std::vector<EnvSwitch> switches(std::begin(kEnvSwitches), std::end(kEnvSwitches));
  return switches;
}

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> known_names() {
  std::vector<std::string> names;
  for (const auto& d : config_key_docs()) names.push_back(config_env_name(d.key));
  for (const auto& s : env_switches()) names.push_back(s.name);
  return names;
}

}  // namespace

std::vector<UnknownEnv> unknown_kvfuse_env(char** environ_entries) {
  std::vector<UnknownEnv> out;
  if (environ_entries == nullptr) return out;
  const std::vector<std::string> names = known_names();
  const std::set<std::string> known(names.begin(), names.end());
  for (char** e = environ_entries; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    const std::string name = eq ? std::string(*e, size_t(eq - *e)) : std::string(*e);
    if (name.rfind("KVFUSE_", 0) != 0 || known.count(name)) continue;
    UnknownEnv u{name, ""};
    size_t best = SIZE_MAX;
    for (const std::string& k : names) {
      if (const size_t d = edit_distance(name, k); d < best) {
        best = d;
        u.closest = k;
      }
    }
    out.push_back(std::move(u));
  }
  std::sort(out.begin(), out.end(), [](const UnknownEnv& a, const UnknownEnv& b) { return a.name < b.name; });
  return out;
}

std::string env_help() {
  std::string out = "Config keys (precedence: --set/--<key> > KVFUSE_<KEY> > --config file > defaults):\n";
  for (const auto& d : config_key_docs()) {
    absl::StrAppendFormat(&out, "  %-34s %s\n", config_env_name(d.key), d.values);
  }
  out += "\nSwitches (A/B variants, libraries, files; read by the engine unless marked):\n";
  for (const auto& s : env_switches()) {
    absl::StrAppendFormat(&out, "  %-34s %s (default %s)%s\n      %s\n", s.name, s.values,
                          *s.dflt ? s.dflt : "unset",
                          std::strcmp(s.read_by, "engine") == 0 ? "" : absl::StrCat(" [", s.read_by, "]"), s.meaning);
  }
  return out;
}

}  // namespace kvfuse
