// The reference tables of docs/configuration.md, rendered from the code's own tables
// (config_key_docs, config_to_json(Config{}), config_env_name, env_switches), so that the
// page cannot drift from what the programs accept. kvfuse-server --config-keys=markdown
// prints it; tests/loading/test_config.cc checks that the page carries exactly this text.
#pragma once

#include <string>

namespace kvfuse {

// Two markdown tables, each under a level-3 heading: every config key (key, values,
// default, environment variable, meaning) and every KVFUSE_* switch (name, values,
// default, meaning, read by). Ends with a newline.
std::string config_keys_markdown();

}  // namespace kvfuse
