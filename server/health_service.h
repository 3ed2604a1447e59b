// grpc.health.v1.Health, implemented here rather than with gRPC's default service so
// that the status is NOT_SERVING from the first moment the port accepts calls (the
// default service starts SERVING) and Watch streams see every change.
//
// Statuses exist for "" (the server as a whole), kvfuse.v1.DecodeService and smg's
// sglang.grpc.scheduler.SglangScheduler (server/sglang_service.h); all move together: NOT_SERVING while the engine warms up, SERVING once it answers,
// NOT_SERVING again while draining or after an internal error.
#pragma once

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"

namespace kvfuse::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  HealthService();
  void set_serving(bool serving);
  bool serving() const;
  // NOT_SERVING for good, and every Watch stream ends (UNAVAILABLE): the server is
  // going away.
  void shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

 private:
  class Watcher;
  ServingStatus status_locked(const std::string& service) const;
  void remove(Watcher* w);

  mutable std::mutex mu_;
  std::map<std::string, ServingStatus> status_;
  std::set<Watcher*> watchers_;
  bool shut_down_ = false;
};

}  // namespace kvfuse::server
