// Wall-clock timing of host-side phases (step timings, set-up, benchmarks' progress).
#pragma once

#include <chrono>

namespace kvfuse {

using Clock = std::chrono::steady_clock;

// Milliseconds from t0 to now.
inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace kvfuse
