#include "server/sglang_service.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/loop_unary.h"
#include "server/status_codes.h"
#include "server/stream_writer.h"
#include "server/tokenizer_bundle.h"

namespace kvfuse::server {

namespace {

// A unary call answered on the spot.
grpc::ServerUnaryReactor* answer(grpc::CallbackServerContext* ctx, const absl::Status& st) {
  auto* r = ctx->DefaultReactor();
  r->Finish(to_grpc(st, ctx));
  return r;
}

absl::Status unimplemented(const char* rpc, const char* why) {
  return absl::UnimplementedError(absl::StrCat(rpc, ": ", why));
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// GetTokenizer's stream: the bundle in chunks, the SHA-256 on the last one.
class TokenizerCall final : public StreamWriter<smg::GetTokenizerChunk> {
 public:
  static constexpr size_t kChunkBytes = 1 << 20;

  static TokenizerCall* start(grpc::CallbackServerContext* ctx, const absl::StatusOr<TokenizerBundle>& bundle) {
    const size_t chunks = bundle.ok() ? std::max<size_t>(1, (bundle->zip.size() + kChunkBytes - 1) / kChunkBytes) : 1;
    auto* call = new TokenizerCall(ctx, chunks + 1);  // queue them all: none is merged
    if (!bundle.ok()) {
      call->end_with(bundle.status());
      return call;
    }
    for (size_t i = 0; i < chunks; ++i) {
      smg::GetTokenizerChunk c;
      c.set_data(bundle->zip.substr(i * kChunkBytes, kChunkBytes));
      if (i + 1 < chunks) {
        call->push(std::move(c));
      } else {
        c.set_sha256(bundle->sha256);
        call->push_final(std::move(c));
      }
    }
    return call;
  }
  void OnDone() override { delete this; }

 private:
  TokenizerCall(grpc::CallbackServerContext* ctx, size_t max_queued) : StreamWriter(ctx, max_queued, nullptr) {}
};

}  // namespace

SglangServiceImpl::SglangServiceImpl(EngineLoop& loop, const ServerMetrics& metrics, const Config& config,
                                     size_t stream_queue_messages, std::function<bool()> serving)
    : loop_(loop),
      metrics_(metrics),
      facts_(SglangServerFacts::of(config)),
      stream_queue_messages_(stream_queue_messages),
      serving_(std::move(serving)) {}

// ---- Generate and Abort ---------------------------------------------------------------------

grpc::ServerWriteReactor<sgl::GenerateResponse>* SglangServiceImpl::Generate(grpc::CallbackServerContext* ctx,
                                                                             const sgl::GenerateRequest* req) {
  last_receive_s_ = unix_now();
  EngineLoop& loop = loop_;
  auto call = SglangGenerateCall::create(
      ctx, stream_queue_messages_, [&loop] { loop.wake(); }, requests_,
      [&loop](uint64_t id) { loop.abort(id, [](const absl::Status&) {}); });
  if (auto st = loop_.check_accepting(); !st.ok()) {
    call->finish_error(st);
    return call.get();
  }
  const std::string request_id = req->request_id().empty() ? requests_->make_id() : req->request_id();
  auto g = from_sglang(*req, request_id, loop_.limits());
  if (!g.ok()) {
    call->finish_error(g.status());
    return call.get();
  }
  call->set_reply(std::move(g->reply));
  if (auto st = requests_->add(request_id, call); !st.ok()) {
    call->finish_error(st);
    return call.get();
  }
  loop_.generate(&g->request, call);  // copied before this returns
  return call.get();
}

grpc::ServerUnaryReactor* SglangServiceImpl::Abort(grpc::CallbackServerContext* ctx, const sgl::AbortRequest* req,
                                                   sgl::AbortResponse* resp) {
  auto call = requests_->find(req->request_id());
  if (!call) {
    resp->set_success(false);
    resp->set_message(absl::StrCat("request_id \"", req->request_id(), "\" is not live"));
    return answer(ctx, absl::OkStatus());
  }
  const std::optional<uint64_t> id = call->request_abort();
  if (!id) {
    resp->set_success(true);
    resp->set_message("aborted as it is admitted");
    return answer(ctx, absl::OkStatus());
  }
  auto* r = ctx->DefaultReactor();
  loop_.abort(*id, [r, resp](const absl::Status& st) {
    // NOT_FOUND: it ended meanwhile (its stream has its own finish).
    resp->set_success(st.ok());
    resp->set_message(std::string(st.message()));
    r->Finish(grpc::Status::OK);
  });
  return r;
}

// ---- Info, health and load ------------------------------------------------------------------

grpc::ServerUnaryReactor* SglangServiceImpl::HealthCheck(grpc::CallbackServerContext* ctx,
                                                         const sgl::HealthCheckRequest*,
                                                         sgl::HealthCheckResponse* resp) {
  const bool healthy = serving_();
  resp->set_healthy(healthy);
  resp->set_message(healthy ? "SERVING" : absl::StrCat("NOT_SERVING (", to_string(loop_.state()),
                                                       loop_.healthy() ? "" : ", internal error", ")"));
  return answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* SglangServiceImpl::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                          const sgl::GetModelInfoRequest*,
                                                          sgl::GetModelInfoResponse* resp) {
  if (auto st = loop_.check_available(); !st.ok()) return answer(ctx, st);
  fill_model_info(loop_.info(), facts_, resp);
  return answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* SglangServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                           const sgl::GetServerInfoRequest*,
                                                           sgl::GetServerInfoResponse* resp) {
  if (auto st = loop_.check_available(); !st.ok()) return answer(ctx, st);
  return answer(ctx, fill_server_info(loop_.info(), facts_, loop_.in_flight(), last_receive_s_.load(), resp));
}

grpc::ServerUnaryReactor* SglangServiceImpl::GetLoads(grpc::CallbackServerContext* ctx, const sgl::GetLoadsRequest* req,
                                                      sgl::GetLoadsResponse* resp) {
  return start_unary(
      ctx, loop_, [&] { return check_loads_request(*req); },
      [&](LoopUnaryReactor& r) {
        auto load = std::make_shared<v1::GetLoadResponse>();
        loop_.get_load(load.get(), [this, req, resp, load, done = r.done()](const absl::Status& st) {
          if (st.ok()) {
            fill_loads(*req, loop_.info(), *load, metrics_.load(), throughput_.update(metrics_.generation_tokens()),
                       resp);
          }
          done(st);
        });
      });
}

// ---- Cache and KV events --------------------------------------------------------------------

grpc::ServerUnaryReactor* SglangServiceImpl::FlushCache(grpc::CallbackServerContext* ctx,
                                                        const smg::FlushCacheRequest* req,
                                                        smg::FlushCacheResponse* resp) {
  // kvfuse's flush drops the cached pages no request holds and leaves the held ones, so
  // it never waits for idle nor fails for requests in flight: timeout_s is only checked.
  return start_unary(
      ctx, loop_,
      [&] {
        if (!std::isfinite(req->timeout_s()) || req->timeout_s() < 0) {
          return absl::InvalidArgumentError(absl::StrCat("timeout_s ", req->timeout_s(), " must be at least 0"));
        }
        return absl::OkStatus();
      },
      [&](LoopUnaryReactor& r) {
        auto flushed = std::make_shared<v1::FlushCacheResponse>();
        loop_.flush_cache(flushed.get(), [resp, flushed, done = r.done()](const absl::Status& st) {
          resp->set_success(st.ok());
          resp->set_message(absl::StrCat("flushed ", flushed->pages_flushed(), " cached pages; ",
                                         flushed->pages_cached(), " held by live requests stay cached"));
          done(st);
        });
      });
}

grpc::ServerWriteReactor<smg::KvEventBatch>* SglangServiceImpl::SubscribeKvEvents(
    grpc::CallbackServerContext* ctx, const smg::SubscribeKvEventsRequest* req) {
  // smg: 0 starts from the current state (the next batch), as an absent start does in kvfuse.v1.
  return start_kv_events<smg::KvEventBatch>(
      ctx, loop_.kv_events(), loop_.check_available(),
      req->start_sequence_number() != 0 ? std::optional<uint64_t>(req->start_sequence_number()) : std::nullopt,
      to_smg);
}

grpc::ServerWriteReactor<smg::GetTokenizerChunk>* SglangServiceImpl::GetTokenizer(grpc::CallbackServerContext* ctx,
                                                                                  const smg::GetTokenizerRequest*) {
  if (auto st = loop_.check_available(); !st.ok()) return TokenizerCall::start(ctx, st);
  return TokenizerCall::start(ctx, make_tokenizer_bundle(facts_.config.model_path, loop_.info().model()));
}

// ---- What kvfuse does not have --------------------------------------------------------------

grpc::ServerUnaryReactor* SglangServiceImpl::Embed(grpc::CallbackServerContext* ctx, const sgl::EmbedRequest*,
                                                   sgl::EmbedResponse*) {
  return answer(ctx, unimplemented("Embed", "kvfuse serves generation models only"));
}

grpc::ServerUnaryReactor* SglangServiceImpl::StartProfile(grpc::CallbackServerContext* ctx,
                                                          const smg::StartProfileRequest*, smg::ProfileResponse*) {
  return answer(ctx, unimplemented("StartProfile", "kvfuse has no profiler behind this call"));
}

grpc::ServerUnaryReactor* SglangServiceImpl::StopProfile(grpc::CallbackServerContext* ctx,
                                                         const smg::StopProfileRequest*, smg::ProfileResponse*) {
  return answer(ctx, unimplemented("StopProfile", "kvfuse has no profiler behind this call"));
}

grpc::ServerUnaryReactor* SglangServiceImpl::LoadLoRAAdapter(grpc::CallbackServerContext* ctx,
                                                             const sgl::LoadLoRAAdapterRequest*,
                                                             sgl::LoadLoRAAdapterResponse*) {
  return answer(ctx, unimplemented("LoadLoRAAdapter", "kvfuse serves no LoRA adapters"));
}

grpc::ServerUnaryReactor* SglangServiceImpl::UnloadLoRAAdapter(grpc::CallbackServerContext* ctx,
                                                               const sgl::UnloadLoRAAdapterRequest*,
                                                               sgl::UnloadLoRAAdapterResponse*) {
  return answer(ctx, unimplemented("UnloadLoRAAdapter", "kvfuse serves no LoRA adapters"));
}

grpc::ServerUnaryReactor* SglangServiceImpl::ListLoadedLoRAAdapters(grpc::CallbackServerContext* ctx,
                                                                    const sgl::ListLoadedLoRAAdaptersRequest*,
                                                                    sgl::ListLoadedLoRAAdaptersResponse*) {
  return answer(ctx, absl::OkStatus());  // none loaded
}

}  // namespace kvfuse::server
