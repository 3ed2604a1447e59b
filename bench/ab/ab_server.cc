#include "bench/ab/ab_server.h"

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/ab/progress.h"
#include "clients/client_util.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "src/common/status_macros.h"

namespace kvfuse::ab {

namespace {

namespace v1 = kvfuse::v1;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

std::chrono::system_clock::time_point in_seconds(double s) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(s));
}

struct Server {
  char side = 'A';
  std::string addr;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::DecodeService::Stub> stub;
  v1::GetInfoResponse info;

  std::string label() const { return absl::StrCat("server ", std::string(1, side), " (", addr, ")"); }
};

// A gRPC failure as an absl::Status with the same code, naming the server and the RPC.
absl::Status rpc_error(const Server& s, const std::string& what, const grpc::Status& st) {
  return absl::Status(absl::StatusCode(int(st.error_code())),
                      absl::StrCat(s.label(), ": ", what, ": ", client::describe(st)));
}

std::string cell_name(int batch, int context) {
  return absl::StrCat("cell batch ", batch, " x context ", context);
}

json summary(const v1::GetInfoResponse& i) {
  return {{"model", i.model()},
          {"arch", i.arch()},
          {"device", i.device()},
          {"kv_cache_dtype", i.kv_cache_dtype()},
          {"kv_format", i.kv_format()},
          {"kv_write", i.kv_write()},
          {"attention", i.attention()},
          {"page_size", i.page_size()},
          {"num_pages", i.num_pages()},
          {"swa_num_pages", i.swa_num_pages()},
          {"sliding_window", i.sliding_window()},
          {"max_seq_len", i.max_seq_len()},
          {"max_running_seqs", i.max_running_seqs()},
          {"max_batch_tokens", i.max_batch_tokens()},
          {"version", i.version()}};
}

std::string describe_info(const v1::GetInfoResponse& i) {
  return absl::StrCat("model ", i.model(), " on ", i.device(), ", kv ", i.kv_format(), " (",
                      i.kv_cache_dtype(), "), ", i.kv_write(), " write, ", i.attention(), " attention");
}

// Connects and reads GetInfo, waiting while the server warms up (UNAVAILABLE).
absl::Status connect(Server& s, const ServerAbOptions& o) {
  s.channel = client::make_channel(s.addr);
  s.stub = v1::DecodeService::NewStub(s.channel);
  if (!s.channel->WaitForConnected(in_seconds(10))) {
    return absl::UnavailableError(
        absl::StrCat(s.label(), ": cannot connect (is a kvfuse-server listening there?)"));
  }
  const auto end = Clock::now() + std::chrono::duration<double>(o.wait_serving_s);
  bool noted = false;
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(10));
    const grpc::Status st = s.stub->GetInfo(&ctx, {}, &s.info);
    if (st.ok()) return absl::OkStatus();
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE || Clock::now() >= end) {
      return rpc_error(s, "GetInfo", st);
    }
    if (!noted && o.progress_out) {
      std::fprintf(o.progress_out, "kvfuse-ab: waiting for %s: %s\n", s.label().c_str(),
                   st.error_message().c_str());
    }
    noted = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

absl::StatusOr<v1::GetLoadResponse> get_load(const Server& s) {
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(30));
  v1::GetLoadResponse resp;
  const grpc::Status st = s.stub->GetLoad(&ctx, {}, &resp);
  if (!st.ok()) return rpc_error(s, "GetLoad", st);
  return resp;
}

// The sequences of one cell on both sides. Whatever happens, they are released: by
// release() on the normal path, by the destructor on an error path (Release is
// idempotent, so ids that were never created are harmless).
class CellSequences {
 public:
  CellSequences(Server* a, Server* b, FILE* warn) : servers_{a, b}, warn_(warn) {}
  CellSequences(const CellSequences&) = delete;
  CellSequences& operator=(const CellSequences&) = delete;
  ~CellSequences() {
    if (auto st = release(); !st.ok() && warn_) {
      std::fprintf(warn_, "\nkvfuse-ab: warning: %s\n", std::string(st.message()).c_str());
    }
  }

  std::vector<uint64_t>& ids(int side) { return ids_[side]; }

  absl::Status release() {
    absl::Status first;
    for (int side = 0; side < 2; ++side) {
      const Server& s = *servers_[side];
      std::vector<uint64_t>& ids = ids_[side];
      const size_t chunk = std::max<size_t>(1, s.info.max_batch_sequences());
      while (!ids.empty()) {
        const size_t n = std::min(chunk, ids.size());
        v1::ReleaseRequest req;
        for (size_t i = ids.size() - n; i < ids.size(); ++i) req.add_ids(ids[i]);
        v1::ReleaseResponse resp;
        grpc::ClientContext ctx;
        ctx.set_deadline(in_seconds(60));
        const grpc::Status st = s.stub->Release(&ctx, req, &resp);
        if (!st.ok()) {
          if (first.ok()) {
            first = rpc_error(
                s, absl::StrCat("Release of ", ids.size(), " sequences (their KV pages may stay held)"), st);
          }
          break;
        }
        ids.resize(ids.size() - n);
      }
      ids.clear();
    }
    return first;
  }

 private:
  Server* servers_[2];
  FILE* warn_;
  std::vector<uint64_t> ids_[2];
};

// The synthetic prompt of sequence `i` of a cell: deterministic, inside the vocabulary,
// the same on both sides.
std::vector<int32_t> prompt(int i, int context, int32_t vocab) {
  std::vector<int32_t> p(static_cast<size_t>(context));
  for (int t = 0; t < context; ++t) p[size_t(t)] = int32_t((int64_t(t) * 31 + int64_t(i) * 7 + 1) % vocab);
  return p;
}

// Creates the cell's `batch` sequences on one side: Prefill of `context` tokens each, so
// that every sequence holds `context` tokens of KV and a sampled token to decode from.
absl::Status prefill_cell(Server& s, std::vector<uint64_t>& ids, uint64_t first_id, int batch, int context,
                          double timeout_s) {
  const int32_t vocab = int32_t(s.info.vocab_size());
  const size_t max_seqs = std::max<size_t>(1, s.info.max_batch_sequences());
  // Keep each message well under the 64 MiB default limit.
  const size_t max_tokens_per_call = size_t(1) << 21;
  int i = 0;
  while (i < batch) {
    v1::PrefillRequest req;
    size_t tokens = 0;
    while (i < batch && size_t(req.sequences_size()) < max_seqs &&
           (req.sequences_size() == 0 || tokens + size_t(context) <= max_tokens_per_call)) {
      v1::PrefillSequence* seq = req.add_sequences();
      const uint64_t id = first_id + uint64_t(i);
      seq->set_id(id);
      seq->mutable_stop()->set_ignore_eos(true);  // every sequence decodes every step
      for (int32_t t : prompt(i, context, vocab)) seq->add_token_ids(t);
      ids.push_back(id);  // before the call: released on any failure
      tokens += size_t(context);
      ++i;
    }
    v1::PrefillResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(timeout_s));
    const grpc::Status st = s.stub->Prefill(&ctx, req, &resp);
    if (!st.ok()) return rpc_error(s, absl::StrCat(cell_name(batch, context), ": Prefill"), st);
    for (int k = 0; k < resp.results_size(); ++k) {
      const v1::PrefillResult& r = resp.results(k);
      const int index = i - req.sequences_size() + k;
      if (r.status().code() != v1::SequenceStatus::OK) {
        const auto code = absl::StatusCode(int(r.status().code()));
        const grpc::Status gs(grpc::StatusCode(int(r.status().code())), r.status().message());
        std::string msg =
            absl::StrCat(s.label(), ": ", cell_name(batch, context),
                         code == absl::StatusCode::kResourceExhausted ? " does not fit" : " failed",
                         ": Prefill of sequence ", index + 1, " of ", batch, ": ", client::describe(gs));
        if (code == absl::StatusCode::kResourceExhausted) {
          absl::StrAppend(&msg,
                          " (the KV pool cannot hold the cell: drop it, free the server, or restart it with "
                          "a larger --set num_pages=...)");
        }
        return absl::Status(code, msg);
      }
      if (!r.has_token_id() || r.seq_len() != uint32_t(context) + 1) {
        return absl::InternalError(absl::StrCat(
            s.label(), ": ", cell_name(batch, context), ": Prefill of sequence ", index + 1,
            " returned seq_len ", r.seq_len(), ", expected ", context + 1, " with a sampled token"));
      }
    }
  }
  return absl::OkStatus();
}

// One repetition on one side: `steps` decode steps of the whole batch. Timed: the
// client's wall time of the Decode RPC(s), gRPC and the server's queueing included. One
// Decode call carries all the cell's sequences for n steps, so the server runs them in
// the same engine steps; a single call per repetition unless `steps` exceeds the
// server's max_decode_steps (then the fewest calls that cover it).
absl::StatusOr<Sample> decode_rep(Server& s, const std::vector<uint64_t>& ids, int steps, int batch,
                                  int context, uint32_t& seq_len, double timeout_s) {
  const int per_call = std::max<int>(1, int(s.info.max_decode_steps()));
  std::vector<v1::DecodeRequest> reqs;
  for (int done = 0; done < steps; done += per_call) {
    v1::DecodeRequest& req = reqs.emplace_back();
    for (uint64_t id : ids) req.add_sequences()->set_id(id);
    req.set_steps(uint32_t(std::min(per_call, steps - done)));
  }
  double ms = 0;
  for (const v1::DecodeRequest& req : reqs) {
    v1::DecodeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(timeout_s));
    const auto t0 = Clock::now();
    const grpc::Status st = s.stub->Decode(&ctx, req, &resp);
    ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!st.ok()) return rpc_error(s, absl::StrCat(cell_name(batch, context), ": Decode"), st);
    seq_len += req.steps();
    if (resp.results_size() != req.sequences_size()) {
      return absl::InternalError(absl::StrCat(s.label(), ": Decode returned ", resp.results_size(),
                                              " results for ", req.sequences_size(), " sequences"));
    }
    for (const v1::DecodeResult& r : resp.results()) {
      if (r.status().code() != v1::SequenceStatus::OK) {
        const grpc::Status gs(grpc::StatusCode(int(r.status().code())), r.status().message());
        return absl::Status(absl::StatusCode(int(r.status().code())),
                            absl::StrCat(s.label(), ": ", cell_name(batch, context), ": Decode of sequence ",
                                         r.id(), ": ", client::describe(gs)));
      }
      // Every step ran: one token per step, and the length the server reports.
      if (r.token_ids_size() != int(req.steps()) || r.seq_len() != seq_len) {
        return absl::InternalError(absl::StrCat(s.label(), ": ", cell_name(batch, context),
                                                ": Decode of sequence ", r.id(), " returned ",
                                                r.token_ids_size(), " tokens and seq_len ", r.seq_len(),
                                                "; expected ", req.steps(), " and ", seq_len));
      }
    }
  }
  if (ms <= 0) ms = 1e-6;
  return Sample{ms / steps, 1000.0 * batch * steps / ms};
}

// A cell that the server cannot run as one batch: fail before creating anything.
absl::Status check_cell_limits(const Server& s, int batch, int context, int grow) {
  const v1::GetInfoResponse& i = s.info;
  const std::string where = absl::StrCat(cell_name(batch, context), " on ", s.label());
  const int64_t need_len = int64_t(context) + grow;
  if (need_len > int64_t(i.max_seq_len())) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": sequences need up to ", need_len, " tokens (context ", context,
                     " + (warm-up + reps) x steps + 2)", " but max_seq_len is ", i.max_seq_len(),
                     "; lower --context, --reps, --warmup or --steps, or start ",
                     "the server with --set max_seq_len=", need_len));
  }
  // Server limits that a --set at the server's start raises.
  struct Limit {
    const char* key;
    uint32_t value;
    const char* why;
  };
  for (const Limit& l :
       {Limit{"max_running_seqs", i.max_running_seqs(), "its sequences would not share engine steps"},
        Limit{"max_batch_tokens", i.max_batch_tokens(), "a decode step of the whole batch would be split"}}) {
    if (uint32_t(batch) > l.value) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": batch ", batch, " exceeds ", l.key, " ", l.value, " (", l.why,
                       "); start the server with --set ", l.key, "=", batch));
    }
  }
  if (uint32_t(batch) > i.max_batch_sequences()) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": batch ", batch, " exceeds the ",
                                                      i.max_batch_sequences(),
                                                      " sequences one Decode call may carry"));
  }
  return absl::OkStatus();
}

// KV pages of the full pool one sequence of the cell holds at the end.
int64_t pages_per_seq(const Server& s, int context, int grow) {
  const int64_t ps = std::max<int64_t>(1, s.info.page_size());
  return (int64_t(context) + grow + ps - 1) / ps;
}

absl::Status check_cell_pages(const Server& s, int batch, int context, int grow) {
  const int64_t need = int64_t(batch) * pages_per_seq(s, context, grow);
  auto load = get_load(s);
  if (!load.ok()) return load.status();
  for (const v1::PoolLoad& p : load->pools()) {
    if (p.pool() != "full") continue;
    if (need > int64_t(p.free_pages())) {
      return absl::ResourceExhaustedError(
          absl::StrCat(cell_name(batch, context), " on ", s.label(), ": needs ", need, " KV pages but only ",
                       p.free_pages(), " of ", p.total_pages(),
                       " are free; drop the cell, free the server, or restart it with a larger "
                       "--set num_pages=..."));
    }
  }
  return absl::OkStatus();
}

// What differs between the two servers besides the write path (and the model, which is
// reported on its own): one line per difference, empty when none.
std::string other_differences(const v1::GetInfoResponse& a, const v1::GetInfoResponse& b) {
  v1::GetInfoResponse x = a, y = b;
  for (v1::GetInfoResponse* m : {&x, &y}) {
    m->clear_kv_write();
    m->clear_model();
    // Measured, not configured: two servers on one device see different free memory
    // (the pools' pages, which the config sets, are compared).
    m->clear_memory();
  }
  std::string report;
  google::protobuf::util::MessageDifferencer diff;
  diff.ReportDifferencesToString(&report);
  diff.Compare(x, y);
  return report;
}

}  // namespace

absl::Status check_server_args(const std::vector<std::string>& servers, bool config_files_given) {
  const char* how =
      "start one server per side, e.g. on one GPU:\n"
      "  kvfuse-server --listen 127.0.0.1:50051 --metrics-port -1 --set kv_write=fused &\n"
      "  kvfuse-server --listen 127.0.0.1:50052 --metrics-port -1 --set kv_write=unfused &\n"
      "  kvfuse-ab --server 127.0.0.1:50051 --server 127.0.0.1:50052";
  if (servers.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("the server mode needs one server per side: --server given ", servers.size(),
                     " time(s), expected twice (A, then B); ", how));
  }
  if (config_files_given) {
    return absl::InvalidArgumentError(
        absl::StrCat("--a/--b configure in-process engines and cannot be combined with --server: each "
                     "server's config is the "
                     "one it was started with; ",
                     how));
  }
  for (const std::string& s : servers) {
    if (s.empty()) return absl::InvalidArgumentError("--server needs an address host:port");
  }
  return absl::OkStatus();
}

absl::StatusOr<ServerAbResult> run_server_ab(const ServerAbOptions& o) {
  KVFUSE_RETURN_IF_ERROR(check_server_args(o.servers, false));
  if (o.batches.empty() || o.contexts.empty()) {
    return absl::InvalidArgumentError("the grid needs at least one batch size and one context length");
  }
  for (int b : o.batches) {
    if (b < 1) return absl::InvalidArgumentError("batch sizes must be >= 1");
  }
  for (int c : o.contexts) {
    if (c < 1) return absl::InvalidArgumentError("context lengths must be >= 1");
  }
  if (o.reps < 2 || o.warmup < 0 || o.steps < 1) {
    return absl::InvalidArgumentError("need reps >= 2, warmup >= 0 and steps >= 1");
  }

  Server servers[2];
  for (int i = 0; i < 2; ++i) {
    servers[i].side = char('A' + i);
    servers[i].addr = o.servers[size_t(i)];
    KVFUSE_RETURN_IF_ERROR(connect(servers[i], o));
  }
  const v1::GetInfoResponse &ia = servers[0].info, &ib = servers[1].info;

  ServerAbResult res;
  auto warn = [&](const std::string& w) {
    res.warnings.push_back(w);
    if (o.progress_out) std::fprintf(o.progress_out, "kvfuse-ab: warning: %s\n", w.c_str());
  };
  if (o.info_out) {
    for (const Server& s : servers) {
      std::fprintf(o.info_out, "kvfuse-ab: %s: %s\n", s.label().c_str(), describe_info(s.info).c_str());
    }
  }
  if (ia.model() != ib.model()) {
    warn(absl::StrCat("the servers run different models (A: ", ia.model(), ", B: ", ib.model(),
                      "): the ratio compares more than the write path"));
  }
  if (const std::string d = other_differences(ia, ib); !d.empty()) {
    warn(absl::StrCat("the servers differ in more than the write path:\n", d));
  }
  const bool same_write = ia.kv_write() == ib.kv_write();
  if (same_write) {
    warn(absl::StrCat("both servers use the ", ia.kv_write(), " write path: this is an A/A comparison"));
  }
  // (Built as new strings: GCC 12 warns falsely on assigning a literal here.)
  res.a_name = same_write ? std::string(1, 'A') : ia.kv_write();
  res.b_name = same_write ? std::string(1, 'B') : ib.kv_write();

  // Up front, for every cell: the server limits (static; nothing is created if any cell
  // cannot run).
  const int grow = (o.warmup + o.reps) * o.steps + 2;
  for (int b : o.batches) {
    for (int c : o.contexts) {
      for (const Server& s : servers) {
        KVFUSE_RETURN_IF_ERROR(check_cell_limits(s, b, c, grow));
        if (o.precheck_pages && int64_t(b) * pages_per_seq(s, c, grow) > int64_t(s.info.num_pages())) {
          return absl::ResourceExhaustedError(absl::StrCat(
              cell_name(b, c), " on ", s.label(), ": needs ", int64_t(b) * pages_per_seq(s, c, grow),
              " KV pages; the pool has ", s.info.num_pages(),
              " in all; drop the cell or restart the server with "
              "a larger --set num_pages=..."));
        }
      }
    }
  }

  const int calls_per_rep = [&] {
    const int per_call = std::max<int>(1, int(std::min(ia.max_decode_steps(), ib.max_decode_steps())));
    return (o.steps + per_call - 1) / per_call;
  }();
  if (o.info_out) {
    std::fprintf(o.info_out,
                 "kvfuse-ab: %s vs %s over gRPC, %d reps (+%d warm-up) of %d decode steps per cell "
                 "(%d Decode call%s of the whole batch per repetition, timed on the client)\n",
                 res.a_name.c_str(), res.b_name.c_str(), o.reps, o.warmup, o.steps, calls_per_rep,
                 calls_per_rep == 1 ? "" : "s");
  }

  uint64_t next_id = o.first_id;
  if (next_id == 0) {
    std::random_device rd;
    next_id = (uint64_t(rd()) << 20) + 1;  // the lower half of the id space: server-picked ids are above
  }
  const size_t total = o.batches.size() * o.contexts.size();
  bench::Progress progress(o.progress_out);
  for (int b : o.batches) {
    for (int c : o.contexts) {
      const std::string unit = absl::StrFormat("kvfuse-ab: cell %zu/%zu (batch %d, context %d)",
                                               res.cells.size() + 1, total, b, c);
      progress.update(unit, "prefill");
      if (o.precheck_pages) {
        for (const Server& s : servers) {
          KVFUSE_RETURN_IF_ERROR(check_cell_pages(s, b, c, grow));
        }
      }
      CellSequences seqs(&servers[0], &servers[1], o.progress_out);
      uint32_t seq_len[2] = {uint32_t(c) + 1, uint32_t(c) + 1};
      for (int i = 0; i < 2; ++i) {
        if (auto st = prefill_cell(servers[i], seqs.ids(i), next_id, b, c, o.rpc_timeout_s); !st.ok())
          return st;
        next_id += uint64_t(b);  // distinct ids per side: A and B may even be one server
      }
      Cell cell{b, c, {}, {}};
      for (int r = 0; r < o.warmup + o.reps; ++r) {
        progress.update(unit, absl::StrFormat("repetition %d/%d", r + 1, o.warmup + o.reps));
        for (int k = 0; k < 2; ++k) {
          // Alternate which side goes first, so drift over time affects both alike.
          const int side = (r % 2) ^ k;
          auto sample =
              decode_rep(servers[side], seqs.ids(side), o.steps, b, c, seq_len[side], o.rpc_timeout_s);
          if (!sample.ok()) return sample.status();
          if (r >= o.warmup) (side == 0 ? cell.a : cell.b).push_back(*sample);
        }
      }
      KVFUSE_RETURN_IF_ERROR(seqs.release());
      res.cells.push_back(std::move(cell));
    }
  }
  progress.finish();

  res.meta = {{"mode", "server"},
              {"servers", absl::StrCat("server A ", servers[0].addr, " / server B ", servers[1].addr)},
              {"server_a", servers[0].addr},
              {"server_b", servers[1].addr},
              {"info_a", summary(ia)},
              {"info_b", summary(ib)},
              {"model", ia.model()},
              {"device", ia.device()},
              {"kv_dtype", ia.kv_format()},
              {"reps", o.reps},
              {"warmup", o.warmup},
              {"steps", o.steps},
              {"decode_calls_per_rep", calls_per_rep},
              {"timed", "client wall time of the Decode RPCs stepping the whole batch, gRPC included"},
              {"warnings", res.warnings}};
  res.default_title = absl::StrCat("kvfuse ", res.a_name, " vs ", res.b_name, " (servers): ", ia.model(),
                                   " on ", ia.device());
  return res;
}

}  // namespace kvfuse::ab
