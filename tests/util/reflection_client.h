// A client of gRPC server reflection for the server tests, with its requests encoded by
// hand: Debian ships no reflection .proto to generate a client from.
#pragma once

#include <memory>
#include <string>

#include "tests/util/raw_call.h"

namespace kvfuse::testing {

// One request/response exchange on the reflection service (v1alpha, what grpcurl
// uses with this gRPC version), with the request encoded by hand: Debian ships no
// reflection .proto to generate a client from.
inline std::string reflection_exchange(const std::shared_ptr<grpc::Channel>& ch, const std::string& request) {
  const RawReply r = raw_call(ch, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", request, 10);
  REQUIRE(r.status.ok());
  REQUIRE(r.got_message);
  return r.bytes;
}

inline std::string string_field(int field, const std::string& value) {
  std::string out;
  out += char((field << 3) | 2);
  out += char(value.size());  // short values only
  return out + value;
}

}  // namespace kvfuse::testing
