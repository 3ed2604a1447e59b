// The Prometheus endpoint: GET /metrics on its own HTTP port (cpp-httplib), so that
// scraping never competes with gRPC traffic. Also GET /health (200 or 503) for
// probes that do not speak gRPC.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace kvfuse::server {

class MetricsHttpServer {
 public:
  MetricsHttpServer(const ServerMetrics& metrics, std::function<bool()> serving);
  ~MetricsHttpServer();
  // Binds host:port (port 0: a free port) and serves on a thread. Returns the port.
  absl::StatusOr<int> start(const std::string& host, int port);
  void stop();

 private:
  const ServerMetrics& metrics_;
  std::function<bool()> serving_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
};

}  // namespace kvfuse::server
