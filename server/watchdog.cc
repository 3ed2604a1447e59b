#include "server/watchdog.h"

#include <algorithm>
#include <chrono>

namespace kvfuse::server {

namespace {
using Clock = std::chrono::steady_clock;
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
}  // namespace

Watchdog::Watchdog(double limit_s, std::function<void(bool, double)> on_change)
    : limit_s_(limit_s), on_change_(std::move(on_change)) {}

Watchdog::~Watchdog() { stop(); }

void Watchdog::start() {
  last_beat_ns_ = now_ns();
  if (limit_s_ > 0) thread_ = std::thread([this] { watch(); });
}

void Watchdog::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Watchdog::beat(bool working) {
  // The time first: the watchdog reads `working_`, then the time it goes with.
  last_beat_ns_ = now_ns();
  working_ = working;
  // Any mark is progress, also the one of a loop going idle after its last step.
  if (stalled_.exchange(false)) on_change_(false, 0);
}

void Watchdog::watch() {
  const auto limit = std::chrono::duration<double>(limit_s_);
  const auto period = std::min<std::chrono::duration<double>>(limit / 4, std::chrono::seconds(1));
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
    if (!working_.load() || stalled_.load()) continue;
    const double idle_s = double(now_ns() - last_beat_ns_.load()) * 1e-9;
    if (idle_s < limit_s_) continue;
    if (!stalled_.exchange(true)) on_change_(true, idle_s);
  }
}

}  // namespace kvfuse::server
