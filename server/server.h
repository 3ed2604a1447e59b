// The kvfuse server as a library: the gRPC server (kvfuse.v1 DecodeService, smg's SGLang
// worker protocol on the same port, health, reflection),
// the engine loop and the metrics endpoint, started and drained together. The
// kvfuse-server binary is a thin main around this; the tests start it in-process.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "server/decode_service.h"
#include "server/engine_loop.h"
#include "server/health_service.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/sglang_service.h"

namespace kvfuse::server {

struct ServerOptions {
  LoopOptions loop;  // the engine config and the loop's limits
  ServiceOptions service;
  std::string listen = "0.0.0.0:50051";
  // The metrics endpoint binds the host of `listen`; port 0 picks a free one, -1 turns
  // it off.
  int metrics_port = 9464;
  // Large enough for a Prefill of max_running_seqs full-length prompts.
  int max_message_bytes = 64 << 20;
};

class KvfuseServer {
 public:
  // Listens at once (health NOT_SERVING) and warms the engine up in the background.
  static absl::StatusOr<std::unique_ptr<KvfuseServer>> start(ServerOptions opts);
  ~KvfuseServer();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  // host:port a client on this machine can dial.
  std::string address() const;
  absl::Status wait_until_serving(double timeout_s) { return loop_->wait_until_ready(timeout_s); }
  EngineLoop& loop() { return *loop_; }
  const ServerMetrics& metrics() const { return *metrics_; }

  // Graceful shutdown: stop admitting (UNAVAILABLE, health NOT_SERVING), let in-flight
  // work finish for up to `grace_s` seconds, end what is left with UNAVAILABLE, then
  // stop the gRPC server and the metrics endpoint. Idempotent.
  void drain(double grace_s);

 private:
  KvfuseServer() = default;

  ServerOptions opts_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<EngineLoop> loop_;
  std::unique_ptr<DecodeServiceImpl> service_;
  std::unique_ptr<SglangServiceImpl> sglang_;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<MetricsHttpServer> http_;
  int port_ = 0;
  int metrics_port_ = -1;
  bool drained_ = false;
};

// The host part of "host:port", "[v6]:port" or "unix:..." (empty for the latter).
std::string listen_host(const std::string& listen);

}  // namespace kvfuse::server
