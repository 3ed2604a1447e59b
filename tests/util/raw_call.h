// One gRPC call with its request as raw bytes (a malformed message, or a service with no
// .proto to generate a client from): the status and the first reply message, if any.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/util/test_server_util.h"

namespace kvfuse::testing {

struct RawReply {
  grpc::Status status;
  bool got_message = false;
  std::string bytes;  // the first reply message
};

// `method` is "/package.Service/Method"; the request is written and the stream half-closed.
inline RawReply raw_call(const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
                         const std::string& body, int deadline_s) {
  grpc::GenericStub stub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(deadline_s));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, method, &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t id) {
    REQUIRE(cq.Next(&tag, &ok));
    REQUIRE(tag == reinterpret_cast<void*>(id));
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  grpc::Slice slice(body);
  grpc::ByteBuffer out(&slice, 1);
  call->WriteLast(out, grpc::WriteOptions(), reinterpret_cast<void*>(2));
  step(2);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  RawReply r;
  r.got_message = step(3);
  call->Finish(&r.status, reinterpret_cast<void*>(4));
  step(4);
  if (r.got_message) {
    std::vector<grpc::Slice> slices;
    REQUIRE(in.Dump(&slices).ok());
    for (const auto& s : slices) r.bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return r;
}

}  // namespace kvfuse::testing
