#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

std::string listen_host(const std::string& listen) {
  if (listen.rfind("unix:", 0) == 0) return "";
  const auto colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

absl::StatusOr<std::unique_ptr<KvfuseServer>> KvfuseServer::start(ServerOptions opts) {
  std::unique_ptr<KvfuseServer> s(new KvfuseServer());
  s->opts_ = opts;
  s->metrics_ = std::make_unique<ServerMetrics>();
  s->health_ = std::make_unique<HealthService>();
  HealthService* health = s->health_.get();
  ServerMetrics* metrics = s->metrics_.get();
  // Logged on changes only: the loop reports its state whenever it may have changed.
  auto last = std::make_shared<std::atomic<int>>(-1);
  s->loop_ =
      std::make_unique<EngineLoop>(std::move(opts.loop), *s->metrics_, [health, metrics, last](bool serving) {
        health->set_serving(serving);
        metrics->set_serving(serving);
        if (last->exchange(serving) != int(serving)) {
          spdlog::info("event=health status={}", serving ? "SERVING" : "NOT_SERVING");
        }
      });
  s->service_ = std::make_unique<DecodeServiceImpl>(*s->loop_, opts.service);
  s->sglang_ = std::make_unique<SglangServiceImpl>(*s->loop_, *s->metrics_, s->opts_.loop.config,
                                                   opts.service.stream_queue_messages,
                                                   [health] { return health->serving(); });

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(opts.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->sglang_.get());
  builder.RegisterService(s->health_.get());
  builder.SetMaxReceiveMessageSize(opts.max_message_bytes);
  builder.SetMaxSendMessageSize(opts.max_message_bytes);
  // gRPC sets SO_REUSEPORT by default on Linux: a second server on a busy port would
  // bind too and silently take half of the connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  s->grpc_ = builder.BuildAndStart();
  if (!s->grpc_ || (s->port_ == 0 && opts.listen.rfind("unix:", 0) != 0)) {
    s->grpc_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", opts.listen,
                                               " (gRPC): the port is in use or the address is not local"));
  }
  spdlog::info("event=listening addr={} port={}", opts.listen, s->port_);

  if (opts.metrics_port >= 0) {
    s->http_ = std::make_unique<MetricsHttpServer>(*s->metrics_, [health] { return health->serving(); });
    std::string host = listen_host(opts.listen);
    if (host.empty()) host = "127.0.0.1";
    auto port = s->http_->start(host, opts.metrics_port);
    if (!port.ok()) return port.status();  // the destructor stops what was started
    s->metrics_port_ = *port;
    spdlog::info("event=metrics_listening url=http://{}:{}/metrics", host, s->metrics_port_);
  }
  s->loop_->start();
  return s;
}

KvfuseServer::~KvfuseServer() { drain(0); }

std::string KvfuseServer::address() const {
  std::string host = listen_host(opts_.listen);
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return absl::StrCat(host, ":", port_);
}

void KvfuseServer::drain(double grace_s) {
  if (drained_) return;
  drained_ = true;
  const auto t0 = std::chrono::steady_clock::now();
  loop_->begin_drain();
  const auto deadline = t0 + std::chrono::duration<double>(grace_s);
  while (loop_->in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // A second signal stops the loop during the wait, which ends the work in flight and
  // empties in_flight(): what it ended is what the drain left unfinished.
  const bool cut = loop_->state() == LoopState::stopped;
  const int64_t left = cut ? loop_->ended_by_stop() : loop_->in_flight();
  spdlog::info("event=drain_done in_flight_left={} cut_short={} waited_s={:.3f}", left, cut,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  loop_->stop(absl::UnavailableError("server is shutting down"));
  health_->shutdown();
  // Every call has been finished by now; the deadline only bounds a stuck network.
  if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (http_) http_->stop();
  spdlog::info("event=stopped");
}

}  // namespace kvfuse::server
