#include "server/health_service.h"

#include <optional>

#include "server/status_codes.h"

namespace kvfuse::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream. Latest-value semantics: a status that changes while a write is in
// flight is sent once the write completes, and only if it differs from the last sent.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* svc, std::string service) : svc_(svc), service_(std::move(service)) {}
  const std::string& service() const { return service_; }

  void update(ServingStatus s) {
    std::unique_lock lock(mu_);
    pending_ = s;
    pump(lock);
  }
  void end(grpc::Status st) {
    std::unique_lock lock(mu_);
    if (!finishing_) finish_status_ = std::move(st);
    finishing_ = true;
    pump(lock);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    writing_ = false;
    if (!ok && !finishing_) {
      finishing_ = true;
      finish_status_ = to_grpc(absl::CancelledError("write failed"));
    }
    pump(lock);
  }
  void OnCancel() override { end(grpc::Status::CANCELLED); }
  void OnDone() override {
    svc_->remove(this);
    delete this;
  }

 private:
  // Starts the next write or the Finish. Called with mu_ held; the gRPC call itself is
  // made without it, because a reaction may run inline and take mu_ again.
  void pump(std::unique_lock<std::mutex>& lock) {
    if (writing_ || finished_) return;
    if (pending_ && (!last_sent_ || *pending_ != *last_sent_) && !finishing_) {
      msg_.set_status(*pending_);
      last_sent_ = pending_;
      pending_.reset();
      writing_ = true;
      lock.unlock();
      StartWrite(&msg_);
      return;
    }
    if (finishing_) {
      finished_ = true;
      lock.unlock();
      Finish(finish_status_);
    }
  }

  HealthService* svc_;
  std::string service_;
  std::mutex mu_;
  std::optional<ServingStatus> pending_, last_sent_;
  HealthCheckResponse msg_;
  bool writing_ = false, finishing_ = false, finished_ = false;
  grpc::Status finish_status_;
};

HealthService::HealthService() {
  status_[""] = HealthCheckResponse::NOT_SERVING;
  status_["kvfuse.v1.DecodeService"] = HealthCheckResponse::NOT_SERVING;
  status_["sglang.grpc.scheduler.SglangScheduler"] = HealthCheckResponse::NOT_SERVING;
}

HealthService::ServingStatus HealthService::status_locked(const std::string& service) const {
  auto it = status_.find(service);
  return it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

bool HealthService::serving() const {
  std::lock_guard lock(mu_);
  return status_locked("") == HealthCheckResponse::SERVING;
}

void HealthService::set_serving(bool serving) {
  std::lock_guard lock(mu_);
  if (shut_down_) return;
  for (auto& [name, st] : status_)
    st = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  for (Watcher* w : watchers_) w->update(status_locked(w->service()));
}

void HealthService::shutdown() {
  std::lock_guard lock(mu_);
  shut_down_ = true;
  for (auto& [name, st] : status_) st = HealthCheckResponse::NOT_SERVING;
  for (Watcher* w : watchers_) {
    w->update(HealthCheckResponse::NOT_SERVING);
    w->end(to_grpc(absl::UnavailableError("server is shutting down")));
  }
}

void HealthService::remove(Watcher* w) {
  std::lock_guard lock(mu_);
  watchers_.erase(w);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const HealthCheckRequest* req, HealthCheckResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  std::lock_guard lock(mu_);
  const ServingStatus st = status_locked(req->service());
  if (st == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(to_grpc(absl::NotFoundError("unknown service '" + req->service() + "'")));
  } else {
    resp->set_status(st);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                    const HealthCheckRequest* req) {
  auto* w = new Watcher(this, req->service());
  std::lock_guard lock(mu_);
  watchers_.insert(w);
  w->update(status_locked(req->service()));
  if (shut_down_) w->end(to_grpc(absl::UnavailableError("server is shutting down")));
  return w;
}

}  // namespace kvfuse::server
