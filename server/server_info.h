// What the server tells about itself: GetInfo's answer and the service's limits, built
// once at warm-up, and the load — GetLoad's answer, the load gauges of the metrics
// endpoint and the count of work in flight that a drain waits for.
#pragma once

#include <atomic>
#include <cstdint>

#include "kvfuse/v1/decode.pb.h"
#include "server/loop_work.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "src/loading/config.h"
#include "src/runtime/engine.h"

namespace kvfuse::server {

class ServerInfo {
 public:
  explicit ServerInfo(ServerMetrics& metrics) : metrics_(metrics) {}

  // At the warm-up, on the loop thread, once the engine runs: the limits (`base` with
  // the engine's vocabulary and max_seq_len), GetInfo's answer and the engine_info
  // labels of the metrics.
  void build(Engine& engine, const Config& cfg, const ServiceLimits& base);
  // Any thread, once the loop serves (built before the state turns serving).
  const ServiceLimits& limits() const { return limits_; }
  const v1::GetInfoResponse& info() const { return info_; }

  // GetLoad's answer (loop thread, work started). `serving`: what health reports.
  void fill_load(const LoopWork& work, bool serving, v1::GetLoadResponse* resp) const;
  // The load gauges and in_flight() from the loop's work (loop thread).
  void publish_load(const LoopWork& work);
  // Streams, batch calls, waiting requests and live router sequences, as last published.
  int64_t in_flight() const { return in_flight_.load(); }

 private:
  ServerMetrics& metrics_;
  ServiceLimits limits_;
  v1::GetInfoResponse info_;
  std::atomic<int64_t> in_flight_{0};
};

}  // namespace kvfuse::server
