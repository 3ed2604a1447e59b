// Death tests without a framework: runs a function in a forked child and reports how the
// child ended. Used where a caller's bug must abort (a pool or kernel reference that
// checks its arguments) rather than return an error.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <functional>

namespace kvfuse::test {

// Whether fn, run in a child process, died of SIGABRT. The child's stderr goes to
// /dev/null (the expected message is noise in the test's output).
inline bool aborts(const std::function<void()>& fn) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    std::signal(SIGABRT, SIG_DFL);           // Catch2's handler would report a failure
    std::freopen("/dev/null", "w", stderr);
    fn();
    std::_Exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

}  // namespace kvfuse::test
