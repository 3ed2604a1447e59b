// kvfuse-ab --server: the A/B against two running kvfuse servers over gRPC instead of
// two in-process engines. Side A is the first server, side B the second (typically two
// kvfuse-server processes on one device, started with --set kv_write=fused and
// --set kv_write=unfused). Each cell creates its sequences through the router RPCs
// (Prefill), times whole-batch Decode calls interleaved A B / B A, and releases the
// sequences. The results feed ab_stats exactly as the in-process mode does.
//
// Built only with the gRPC client (KVFUSE_AB_WITH_SERVER); this header itself needs no
// gRPC.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/ab/ab_stats.h"

namespace kvfuse::ab {

struct ServerAbOptions {
  std::vector<std::string> servers;  // exactly two: side A, side B
  std::vector<int> batches, contexts;
  int reps = 5, warmup = 1, steps = 16;
  // How long to wait for a server that is still warming up (GetInfo UNAVAILABLE).
  double wait_serving_s = 120;
  double rpc_timeout_s = 600;
  // Check each cell's pages against GetLoad before prefilling. Off: let the server's
  // admission decide (Prefill answers RESOURCE_EXHAUSTED); the tests use it.
  bool precheck_pages = true;
  // The first sequence id; 0 picks a random one (ids of other router clients on the
  // same servers are then unlikely to collide).
  uint64_t first_id = 0;
  FILE* info_out = stdout;      // the two servers' summaries; nullptr: quiet
  FILE* progress_out = stderr;  // the progress line and warnings; nullptr: quiet
};

struct ServerAbResult {
  std::vector<Cell> cells;
  std::string a_name, b_name;         // the write paths when they differ, else "A" and "B"
  nlohmann::json meta;                // servers, both GetInfo summaries, reps, ...
  std::vector<std::string> warnings;  // also printed to progress_out
  std::string default_title;          // for the SVG
};

// The server mode needs exactly one server per side, and no --a/--b config files (those
// configure in-process engines). InvalidArgument with a message saying how to start
// the two servers otherwise.
absl::Status check_server_args(const std::vector<std::string>& servers, bool config_files_given);

// Runs the whole grid. Fails (after releasing every sequence it created) with a message
// naming the server and the cell: a cell that cannot fit (max_seq_len,
// max_running_seqs, max_batch_tokens, KV pages) or any RPC error.
absl::StatusOr<ServerAbResult> run_server_ab(const ServerAbOptions& opts);

}  // namespace kvfuse::ab
