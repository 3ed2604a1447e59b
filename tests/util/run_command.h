// Runs a shell command for tests of the command-line programs.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

#include "tests/util/catch.h"

namespace kvfuse::testing {

// Runs `cmd` through the shell; returns its exit status (-1 if it did not exit) and what
// it printed on stdout and stderr.
inline std::pair<int, std::string> run_command(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace kvfuse::testing
