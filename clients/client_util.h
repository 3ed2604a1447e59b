// Client-side helpers shared by kvfuse-cli, kvfuse-bench-serve and the tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"

namespace kvfuse::client {

// An insecure channel with message limits that fit large batches.
std::shared_ptr<grpc::Channel> make_channel(const std::string& addr, int max_message_bytes = 64 << 20);
// One-line JSON of a message (proto3 JSON mapping, fields with default values included).
std::string to_json(const google::protobuf::Message& m);
// The p-th percentile (0..100) of `v`, by nearest rank; sorts `v`. 0 if empty.
double percentile(std::vector<double>& v, double p);
// "CODE: message".
std::string describe(const grpc::Status& st);

}  // namespace kvfuse::client
