// A unary call that the engine loop answers, shared by kvfuse.v1's DecodeService
// (server/decode_service.h) and smg's SGLang service (server/sglang_service.h).
#pragma once

#include <atomic>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "server/engine_loop.h"
#include "server/status_codes.h"

namespace kvfuse::server {

// A unary call finished by the engine loop. Cancellation (the client gave up, or its
// deadline passed) raises a flag that the loop reads at the next step boundary.
class LoopUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  LoopUnaryReactor(grpc::CallbackServerContext* ctx, EngineLoop& loop)
      : ctx_(ctx), loop_(loop), cancelled_(std::make_shared<std::atomic<bool>>(false)) {}

  EngineLoop::Flag cancelled() const { return cancelled_; }
  EngineLoop::Done done() {
    return [this](const absl::Status& st) { Finish(to_grpc(st, ctx_)); };
  }
  void reject(const absl::Status& st) { Finish(to_grpc(st, ctx_)); }

  void OnCancel() override {
    cancelled_->store(true);
    loop_.wake();
  }
  void OnDone() override { delete this; }

 private:
  grpc::CallbackServerContext* ctx_;
  EngineLoop& loop_;
  EngineLoop::Flag cancelled_;
};

// A unary call for the loop: UNAVAILABLE while the loop cannot serve, then the
// request's own checks (`check`: INVALID_ARGUMENT names the field); a call that passes
// both is handed to the loop by `post`, and the loop finishes it.
template <class Check, class Post>
grpc::ServerUnaryReactor* start_unary(grpc::CallbackServerContext* ctx, EngineLoop& loop, Check check,
                                      Post post) {
  auto* r = new LoopUnaryReactor(ctx, loop);
  absl::Status st = loop.check_available();
  if (st.ok()) st = check();
  if (st.ok()) {
    post(*r);
  } else {
    r->reject(st);
  }
  return r;
}

}  // namespace kvfuse::server
