// A client of gRPC server reflection for the server tests, with its requests encoded by
// hand: Debian ships no reflection .proto to generate a client from.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/util/test_server_util.h"

namespace kvfuse::testing {

// One request/response exchange on the reflection service (v1alpha, what grpcurl
// uses with this gRPC version), with the request encoded by hand: Debian ships no
// reflection .proto to generate a client from.
inline std::string reflection_exchange(const std::shared_ptr<grpc::Channel>& ch, const std::string& request) {
  grpc::GenericStub stub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(10));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t id) {
    REQUIRE(cq.Next(&tag, &ok));
    REQUIRE(tag == reinterpret_cast<void*>(id));
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  REQUIRE(step(1));
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  REQUIRE(step(2));
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  REQUIRE(step(3));
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(5));
  step(5);
  REQUIRE(st.ok());
  std::vector<grpc::Slice> slices;
  REQUIRE(in.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

inline std::string string_field(int field, const std::string& value) {
  std::string out;
  out += char((field << 3) | 2);
  out += char(value.size());  // short values only
  return out + value;
}

}  // namespace kvfuse::testing
