// Every KVFUSE_* environment variable kvfuse knows, in one table: the config keys'
// KVFUSE_<KEY> variables (config_key_docs) and the switches below, which select an A/B
// variant of a kernel path, a library or a file, or steer a script. kvfuse-server
// --help-env lists them, and the server warns about a KVFUSE_* variable that is in
// neither table (a misspelling would otherwise change nothing without a word).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kvfuse {

struct EnvSwitch {
  const char* name;     // KVFUSE_...
  const char* values;   // what it takes
  const char* dflt;     // what applies when it is unset
  const char* meaning;
  const char* read_by;  // engine (server, tools, benchmarks) | benchmarks | tests | scripts
};

const std::vector<EnvSwitch>& env_switches();

// A KVFUSE_* variable of `environ` (NAME=value entries, as the C runtime's) that names
// neither a config key nor a switch, with the closest known name to suggest.
struct UnknownEnv {
  std::string name;
  std::string closest;
};
std::vector<UnknownEnv> unknown_kvfuse_env(char** environ_entries);

// The --help-env text: every config key's variable, then every switch.
std::string env_help();

}  // namespace kvfuse
