// What smg's SGLang service tells about the server, from kvfuse's own answers:
// GetModelInfo and GetServerInfo from GetInfo and the config, GetLoads from GetLoad and
// the load gauges, and the prefix cache's KV event batches in smg's shape.
// docs/sglang.md lists where each field comes from.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "kvfuse/v1/decode.pb.h"
#include "server/metrics.h"
#include "smg/common.pb.h"
#include "smg/sglang_scheduler.pb.h"
#include "src/loading/config.h"

namespace kvfuse::server {

namespace sgl = ::sglang::grpc::scheduler;
namespace smg = ::smg::grpc::common;

// What does not change while the server runs.
struct SglangServerFacts {
  Config config;
  // The checkpoint's config.json (model_type, architectures); null for a preset.
  nlohmann::json hf_config;
  std::chrono::system_clock::time_point start_time = std::chrono::system_clock::now();
  std::chrono::steady_clock::time_point start_clock = std::chrono::steady_clock::now();

  static SglangServerFacts of(const Config& cfg);
};

void fill_model_info(const v1::GetInfoResponse& info, const SglangServerFacts& facts, sgl::GetModelInfoResponse* out);

// `active_requests`: the work in flight; `last_receive_s`: when the last Generate came
// (seconds since the Unix epoch, 0: none yet).
absl::Status fill_server_info(const v1::GetInfoResponse& info, const SglangServerFacts& facts,
                              int64_t active_requests, double last_receive_s, sgl::GetServerInfoResponse* out);

// Tokens generated per second between two GetLoads calls (the first: since the start).
class GenThroughput {
 public:
  double update(int64_t generation_tokens);

 private:
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  int64_t last_tokens_ = 0;
};

// The sections GetLoads may ask for that kvfuse reports ("core" always; "memory",
// "queues"; "all" for every one); INVALID_ARGUMENT names an unknown one.
absl::Status check_loads_request(const sgl::GetLoadsRequest& req);
void fill_loads(const sgl::GetLoadsRequest& req, const v1::GetInfoResponse& info, const v1::GetLoadResponse& load,
                const LoadGauges& gauges, double gen_throughput, sgl::GetLoadsResponse* out);

// A kvfuse.v1 KV event batch in smg's shape (dp_rank 0; event ids count the batch's
// events from sequence_number << 20).
void to_smg(const v1::KvEventBatch& b, smg::KvEventBatch* out);

}  // namespace kvfuse::server
