#include "server/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

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
  // httplib's default sets SO_REUSEPORT, with which a second server binds the same
  // port and the two split the scrapes. SO_REUSEADDR alone still allows a restart
  // while old connections linger in TIME_WAIT.
  http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int bound = port == 0 ? http_->bind_to_any_port(host) : (http_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port,
                                               " (metrics): the port is in use or the address is not local"));
  }
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return bound;
}

void MetricsHttpServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvfuse::server
