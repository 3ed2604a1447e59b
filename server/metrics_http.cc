#include "server/metrics_http.h"

#include <httplib.h>

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

MetricsHttpServer::MetricsHttpServer(const ServerMetrics& metrics, std::function<bool()> serving)
    : metrics_(metrics), serving_(std::move(serving)) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

absl::StatusOr<int> MetricsHttpServer::start(const std::string& host, int port) {
  http_ = std::make_unique<httplib::Server>();
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = serving_();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "SERVING\n" : "NOT_SERVING\n", "text/plain");
  });
  const int bound = port == 0 ? http_->bind_to_any_port(host) : (http_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", host, ":", port));
  }
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return bound;
}

void MetricsHttpServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvfuse::server
