// A watchdog for the engine loop. A step stuck in a device call or a deadlock cannot
// report itself, so a thread of its own watches the loop's progress marks: when the
// loop has work in hand and makes no progress for `limit_s`, it reports a stall
// (health turns NOT_SERVING); the next progress mark ends it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace kvfuse::server {

class Watchdog {
 public:
  // `on_change(stalled, idle_s)` runs on the watchdog's thread when a stall begins and on
  // the thread calling beat() when it ends. limit_s <= 0: never reports a stall.
  Watchdog(double limit_s, std::function<void(bool stalled, double idle_s)> on_change);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void start();
  void stop();
  // A progress mark; `working`: the loop has work in hand from now on (false: it waits
  // for work, and no progress is then no stall).
  void beat(bool working);
  bool stalled() const { return stalled_.load(); }

 private:
  void watch();

  const double limit_s_;
  std::function<void(bool, double)> on_change_;
  std::atomic<bool> stalled_{false};
  std::atomic<bool> working_{false};
  std::atomic<int64_t> last_beat_ns_{0};  // steady clock
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace kvfuse::server
