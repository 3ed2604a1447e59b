// kvfuse.v1.DecodeService on gRPC's callback API: no thread waits per call. Each
// handler checks that the server can take the call, validates the request (both
// without the engine loop), then hands it to the loop, which finishes it.
#pragma once

#include "kvfuse/v1/decode.grpc.pb.h"
#include "server/engine_loop.h"
#include "server/generate_stream.h"

namespace kvfuse::server {

struct ServiceOptions {
  size_t stream_queue_messages = 64;  // per Generate stream, see GenerateCall
};

class DecodeServiceImpl final : public v1::DecodeService::CallbackService {
 public:
  DecodeServiceImpl(EngineLoop& loop, ServiceOptions opts) : loop_(loop), opts_(opts) {}

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx, const v1::PrefillRequest* req,
                                    v1::PrefillResponse* resp) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* ctx, const v1::DecodeRequest* req,
                                   v1::DecodeResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* resp) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* ctx, const v1::AbortRequest* req,
                                  v1::AbortResponse* resp) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* req,
                                    v1::GetInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* ctx, const v1::GetLoadRequest* req,
                                    v1::GetLoadResponse* resp) override;
  grpc::ServerUnaryReactor* FlushCache(grpc::CallbackServerContext* ctx, const v1::FlushCacheRequest* req,
                                       v1::FlushCacheResponse* resp) override;
  grpc::ServerWriteReactor<v1::KvEventBatch>* SubscribeKvEvents(grpc::CallbackServerContext* ctx,
                                                                const v1::SubscribeKvEventsRequest* req) override;

 private:
  EngineLoop& loop_;
  ServiceOptions opts_;
};

}  // namespace kvfuse::server
