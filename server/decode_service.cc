#include "server/decode_service.h"

#include "server/loop_unary.h"
#include "server/request_validation.h"
#include "server/status_codes.h"

namespace kvfuse::server {

grpc::ServerUnaryReactor* DecodeServiceImpl::Prefill(grpc::CallbackServerContext* ctx,
                                                     const v1::PrefillRequest* req,
                                                     v1::PrefillResponse* resp) {
  return start_unary(
      ctx, loop_, [&] { return validate(*req, loop_.limits()); },
      [&](LoopUnaryReactor& r) { loop_.prefill(req, resp, r.cancelled(), r.done()); });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::Decode(grpc::CallbackServerContext* ctx,
                                                    const v1::DecodeRequest* req, v1::DecodeResponse* resp) {
  return start_unary(
      ctx, loop_, [&] { return validate(*req, loop_.limits()); },
      [&](LoopUnaryReactor& r) { loop_.decode(req, resp, r.cancelled(), r.done()); });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::Release(grpc::CallbackServerContext* ctx,
                                                     const v1::ReleaseRequest* req,
                                                     v1::ReleaseResponse* resp) {
  return start_unary(
      ctx, loop_, [&] { return validate(*req, loop_.limits()); },
      [&](LoopUnaryReactor& r) { loop_.release(req, resp, r.done()); });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::Abort(grpc::CallbackServerContext* ctx,
                                                   const v1::AbortRequest* req, v1::AbortResponse*) {
  return start_unary(
      ctx, loop_, [&] { return validate(*req); },
      [&](LoopUnaryReactor& r) { loop_.abort(req->id(), r.done()); });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::GetLoad(grpc::CallbackServerContext* ctx,
                                                     const v1::GetLoadRequest*, v1::GetLoadResponse* resp) {
  return start_unary(
      ctx, loop_, [] { return absl::OkStatus(); },
      [&](LoopUnaryReactor& r) { loop_.get_load(resp, r.done()); });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::FlushCache(grpc::CallbackServerContext* ctx,
                                                        const v1::FlushCacheRequest*, v1::FlushCacheResponse* resp) {
  return start_unary(
      ctx, loop_, [] { return absl::OkStatus(); },
      [&](LoopUnaryReactor& r) { loop_.flush_cache(resp, r.done()); });
}

grpc::ServerWriteReactor<v1::KvEventBatch>* DecodeServiceImpl::SubscribeKvEvents(
    grpc::CallbackServerContext* ctx, const v1::SubscribeKvEventsRequest* req) {
  return start_kv_events<v1::KvEventBatch>(
      ctx, loop_.kv_events(), loop_.check_available(),
      req->has_start_sequence_number() ? std::optional<uint64_t>(req->start_sequence_number()) : std::nullopt,
      [](const v1::KvEventBatch& b, v1::KvEventBatch* out) { *out = b; });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::GetInfo(grpc::CallbackServerContext* ctx,
                                                     const v1::GetInfoRequest*, v1::GetInfoResponse* resp) {
  // Static once warm: answered here, without waiting for a step to end.
  auto* r = ctx->DefaultReactor();
  if (auto st = loop_.check_available(); !st.ok()) {
    r->Finish(to_grpc(st, ctx));
  } else {
    *resp = loop_.info();
    r->Finish(grpc::Status::OK);
  }
  return r;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* DecodeServiceImpl::Generate(grpc::CallbackServerContext* ctx,
                                                                            const v1::GenerateRequest* req) {
  EngineLoop& loop = loop_;
  auto call = GenerateCall::create(ctx, opts_.stream_queue_messages, [&loop] { loop.wake(); });
  if (auto st = loop_.check_accepting(); !st.ok()) {
    call->finish_error(st);
  } else if (auto st = validate(*req, loop_.limits()); !st.ok()) {
    call->finish_error(st);
  } else {
    loop_.generate(req, call);
  }
  return call.get();
}

}  // namespace kvfuse::server
