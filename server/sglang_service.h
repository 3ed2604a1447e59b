// smg's worker protocol for SGLang (sglang.grpc.scheduler.SglangScheduler,
// proto/smg/sglang_scheduler.proto), served on the same port as kvfuse.v1 so that a
// kvfuse worker sits behind smg's gateway as an SGLang worker does (docs/sglang.md).
//
// Generate runs through the engine loop exactly as kvfuse.v1 Generate does: the request
// becomes a kvfuse.v1 GenerateRequest (server/sglang_request.h) and its stream a
// GenerateSink (server/sglang_generate.h), so the same prompt, seed and parameters give
// the same tokens on both. The other calls answer from kvfuse's own (GetInfo, GetLoad,
// FlushCache, the KV event log, health). What kvfuse does not have is refused by name:
// INVALID_ARGUMENT for a request field, UNIMPLEMENTED for a call.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "server/engine_loop.h"
#include "server/metrics.h"
#include "server/sglang_generate.h"
#include "server/sglang_info.h"
#include "smg/sglang_scheduler.grpc.pb.h"

namespace kvfuse::server {

class SglangServiceImpl final : public sgl::SglangScheduler::CallbackService {
 public:
  // `serving`: kvfuse's health (the server's SERVING status).
  SglangServiceImpl(EngineLoop& loop, const ServerMetrics& metrics, const Config& config, size_t stream_queue_messages,
                    std::function<bool()> serving);

  grpc::ServerWriteReactor<sgl::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                            const sgl::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Embed(grpc::CallbackServerContext* ctx, const sgl::EmbedRequest* req,
                                  sgl::EmbedResponse* resp) override;
  grpc::ServerUnaryReactor* HealthCheck(grpc::CallbackServerContext* ctx, const sgl::HealthCheckRequest* req,
                                        sgl::HealthCheckResponse* resp) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* ctx, const sgl::AbortRequest* req,
                                  sgl::AbortResponse* resp) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const sgl::GetModelInfoRequest* req,
                                         sgl::GetModelInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx, const sgl::GetServerInfoRequest* req,
                                          sgl::GetServerInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetLoads(grpc::CallbackServerContext* ctx, const sgl::GetLoadsRequest* req,
                                     sgl::GetLoadsResponse* resp) override;
  grpc::ServerUnaryReactor* FlushCache(grpc::CallbackServerContext* ctx, const smg::FlushCacheRequest* req,
                                       smg::FlushCacheResponse* resp) override;
  grpc::ServerUnaryReactor* StartProfile(grpc::CallbackServerContext* ctx, const smg::StartProfileRequest* req,
                                         smg::ProfileResponse* resp) override;
  grpc::ServerUnaryReactor* StopProfile(grpc::CallbackServerContext* ctx, const smg::StopProfileRequest* req,
                                        smg::ProfileResponse* resp) override;
  grpc::ServerWriteReactor<smg::GetTokenizerChunk>* GetTokenizer(grpc::CallbackServerContext* ctx,
                                                                 const smg::GetTokenizerRequest* req) override;
  grpc::ServerWriteReactor<smg::KvEventBatch>* SubscribeKvEvents(grpc::CallbackServerContext* ctx,
                                                                 const smg::SubscribeKvEventsRequest* req) override;
  grpc::ServerUnaryReactor* LoadLoRAAdapter(grpc::CallbackServerContext* ctx, const sgl::LoadLoRAAdapterRequest* req,
                                            sgl::LoadLoRAAdapterResponse* resp) override;
  grpc::ServerUnaryReactor* UnloadLoRAAdapter(grpc::CallbackServerContext* ctx,
                                              const sgl::UnloadLoRAAdapterRequest* req,
                                              sgl::UnloadLoRAAdapterResponse* resp) override;
  grpc::ServerUnaryReactor* ListLoadedLoRAAdapters(grpc::CallbackServerContext* ctx,
                                                   const sgl::ListLoadedLoRAAdaptersRequest* req,
                                                   sgl::ListLoadedLoRAAdaptersResponse* resp) override;

 private:
  EngineLoop& loop_;
  const ServerMetrics& metrics_;
  const SglangServerFacts facts_;
  const size_t stream_queue_messages_;
  std::function<bool()> serving_;
  std::shared_ptr<SglangRequestTable> requests_ = std::make_shared<SglangRequestTable>();
  GenThroughput throughput_;
  std::atomic<double> last_receive_s_{0};
};

}  // namespace kvfuse::server
