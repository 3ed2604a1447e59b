// A thread that runs one tensor-parallel rank's work in order: a GPU rank's device stays
// current on it, and the collectives of the ranks of a group run at the same time, as they
// must (one thread driving several NCCL communicators would wait on itself).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "absl/status/status.h"

namespace kvfuse {

class RankThread {
 public:
  RankThread() : thread_([this] { loop(); }) {}
  ~RankThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();  // runs what was posted before it stops
  }
  RankThread(const RankThread&) = delete;
  RankThread& operator=(const RankThread&) = delete;

  // Runs `task` on the thread after the tasks posted before it.
  std::future<absl::Status> post(std::function<absl::Status()> task) {
    std::packaged_task<absl::Status()> job(std::move(task));
    std::future<absl::Status> done = job.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
    return done;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<absl::Status()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<absl::Status()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace kvfuse
