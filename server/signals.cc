#include "server/signals.h"

#include <semaphore.h>
#include <signal.h>
#include <time.h>

#include <atomic>
#include <cerrno>

namespace kvfuse::server {

namespace {
sem_t g_signalled;
std::atomic<int> g_last_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");

void on_signal(int sig) {
  g_last_signal.store(sig);
  sem_post(&g_signalled);
}
}  // namespace

void install_shutdown_handlers() {
  sem_init(&g_signalled, 0, 0);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int wait_shutdown_signal(int timeout_ms) {
  timespec deadline{};
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += long(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  while (sem_timedwait(&g_signalled, &deadline) != 0) {
    if (errno != EINTR) return 0;  // timed out
  }
  return g_last_signal.load();
}

}  // namespace kvfuse::server
