#include "server/sglang_info.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvfuse::server {

namespace {

google::protobuf::Timestamp to_timestamp(std::chrono::system_clock::time_point t) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  google::protobuf::Timestamp ts;
  ts.set_seconds(us / 1000000);
  ts.set_nanos(int32_t((us % 1000000) * 1000));
  return ts;
}

absl::Status json_to_struct(const nlohmann::json& j, google::protobuf::Struct* out) {
  const auto st = google::protobuf::util::JsonStringToMessage(j.dump(), out);
  if (!st.ok()) return absl::InternalError(absl::StrCat("server info as a Struct: ", st.ToString()));
  return absl::OkStatus();
}

int32_t clamp_i32(uint64_t v) { return int32_t(std::min<uint64_t>(v, uint64_t(INT32_MAX))); }

}  // namespace

SglangServerFacts SglangServerFacts::of(const Config& cfg) {
  SglangServerFacts f;
  f.config = cfg;
  if (!cfg.model_path.empty()) {
    std::ifstream in(std::filesystem::path(cfg.model_path) / "config.json");
    if (in) f.hf_config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (f.hf_config.is_discarded()) f.hf_config = nullptr;
  }
  return f;
}

void fill_model_info(const v1::GetInfoResponse& info, const SglangServerFacts& facts, sgl::GetModelInfoResponse* out) {
  const Config& cfg = facts.config;
  const std::string path = cfg.model_path.empty() ? cfg.model : cfg.model_path;
  out->set_model_path(path);
  out->set_tokenizer_path(cfg.model_path);  // GetTokenizer serves its files
  out->set_is_generation(true);
  out->set_served_model_name(info.model());
  out->set_max_context_length(int32_t(info.max_seq_len()));
  out->set_vocab_size(int32_t(info.vocab_size()));
  out->set_supports_vision(false);
  out->set_model_type(info.arch());
  const nlohmann::json& hf = facts.hf_config;
  if (hf.is_object()) {
    if (auto it = hf.find("model_type"); it != hf.end() && it->is_string()) out->set_model_type(it->get<std::string>());
    if (auto it = hf.find("architectures"); it != hf.end() && it->is_array()) {
      for (const auto& a : *it) {
        if (a.is_string()) out->add_architectures(a.get<std::string>());
      }
    }
  }
  for (int32_t id : info.eos_token_ids()) out->add_eos_token_ids(id);
  if (info.has_pad_token_id()) out->set_pad_token_id(info.pad_token_id());  // unset: 0, as smg reads it
  if (info.has_bos_token_id()) out->set_bos_token_id(info.bos_token_id());
  out->set_max_req_input_len(int32_t(info.max_seq_len()) - 1);  // one token must fit after the prompt
}

absl::Status fill_server_info(const v1::GetInfoResponse& info, const SglangServerFacts& facts,
                              int64_t active_requests, double last_receive_s, sgl::GetServerInfoResponse* out) {
  // kvfuse's config, and the keys smg reads from an SGLang worker's server_args under
  // SGLang's names (model_gateway/src/routers/grpc/client.rs in smg).
  nlohmann::json args = config_to_json(facts.config);
  args["model_path"] = facts.config.model_path.empty() ? facts.config.model : facts.config.model_path;
  args["tokenizer_path"] = facts.config.model_path;
  args["served_model_name"] = info.model();
  args["tp_size"] = info.tensor_parallel();
  args["dp_size"] = 1;
  args["pp_size"] = 1;
  args["context_length"] = info.max_seq_len();
  args["max_total_tokens"] = info.num_pages() * info.page_size();
  args["max_running_requests"] = info.max_running_seqs();
  args["vocab_size"] = info.vocab_size();
  args["is_embedding"] = false;
  if (auto st = json_to_struct(args, out->mutable_server_args()); !st.ok()) return st;
  const nlohmann::json sched = {{"page_size", info.page_size()},
                                {"num_pages", info.num_pages()},
                                {"max_total_num_tokens", info.num_pages() * info.page_size()},
                                {"max_running_requests", info.max_running_seqs()},
                                {"max_batch_tokens", info.max_batch_tokens()},
                                {"max_seq_len", info.max_seq_len()},
                                {"kv_cache_dtype", info.kv_cache_dtype()},
                                {"kv_format", info.kv_format()},
                                {"device", info.device()},
                                {"tensor_parallel", info.tensor_parallel()},
                                {"weight_format", info.weight_format()}};
  if (auto st = json_to_struct(sched, out->mutable_scheduler_info()); !st.ok()) return st;
  out->set_active_requests(clamp_i32(uint64_t(std::max<int64_t>(0, active_requests))));
  out->set_is_paused(false);
  out->set_last_receive_timestamp(last_receive_s);
  out->set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - facts.start_clock).count());
  out->set_sglang_version(absl::StrCat("kvfuse ", info.version()));
  out->set_server_type("grpc");
  *out->mutable_start_time() = to_timestamp(facts.start_time);
  out->set_max_total_num_tokens(clamp_i32(info.num_pages() * info.page_size()));
  return absl::OkStatus();
}

double GenThroughput::update(int64_t generation_tokens) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  const double dt = std::chrono::duration<double>(now - last_).count();
  const double rate = dt > 0 ? double(generation_tokens - last_tokens_) / dt : 0.0;
  last_ = now;
  last_tokens_ = generation_tokens;
  return std::max(0.0, rate);
}

absl::Status check_loads_request(const sgl::GetLoadsRequest& req) {
  for (const std::string& s : req.include()) {
    if (s != "core" && s != "memory" && s != "queues" && s != "all" && s != "spec" && s != "lora" && s != "disagg") {
      return absl::InvalidArgumentError(absl::StrCat(
          "include: unknown section \"", s, "\" (core, memory, spec, lora, disagg, queues or all)"));
    }
  }
  return absl::OkStatus();
}

void fill_loads(const sgl::GetLoadsRequest& req, const v1::GetInfoResponse& info, const v1::GetLoadResponse& load,
                const LoadGauges& gauges, double gen_throughput, sgl::GetLoadsResponse* out) {
  out->set_timestamp(absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()));
  out->set_version(absl::StrCat("kvfuse ", info.version()));
  out->set_dp_rank_count(1);
  const uint64_t page = info.page_size();
  uint64_t used_pages = 0, total_pages = 0;
  for (const v1::PoolLoad& p : load.pools()) {
    if (p.pool() == "full") {
      used_pages = p.used_pages();
      total_pages = p.total_pages();
    }
  }
  const int32_t running = int32_t(load.num_running());
  const int32_t waiting = int32_t(load.num_waiting());
  const int32_t max_running = int32_t(info.max_running_seqs());
  const double utilization = max_running > 0 ? double(running) / double(max_running) : 0.0;
  // Rank 0 is kvfuse's one rank: asking for another gets no load.
  if (!req.has_dp_rank() || req.dp_rank() == 0) {
    auto has = [&](const char* s) {
      return std::find(req.include().begin(), req.include().end(), s) != req.include().end() ||
             std::find(req.include().begin(), req.include().end(), "all") != req.include().end();
    };
    sgl::SchedulerLoad* l = out->add_loads();
    l->set_dp_rank(0);
    l->set_num_running_reqs(running);
    l->set_num_waiting_reqs(waiting);
    l->set_num_total_reqs(running + waiting);
    l->set_num_used_tokens(clamp_i32(used_pages * page));
    l->set_max_total_num_tokens(clamp_i32(total_pages * page));
    l->set_token_usage(load.kv_usage());
    l->set_gen_throughput(gen_throughput);
    l->set_cache_hit_rate(gauges.cache_query_tokens > 0
                              ? double(gauges.cache_hit_tokens) / double(gauges.cache_query_tokens)
                              : 0.0);
    l->set_utilization(utilization);
    l->set_max_running_requests(max_running);
    if (has("memory")) {
      sgl::MemoryMetrics* m = l->mutable_memory();
      m->set_weight_gb(double(info.weight_bytes()) / double(1ull << 30));
      m->set_token_capacity(clamp_i32(total_pages * page));
    }
    if (has("queues")) l->mutable_queues()->set_waiting(waiting);
  }
  sgl::AggregateMetrics* a = out->mutable_aggregate();
  a->set_total_running_reqs(running);
  a->set_total_waiting_reqs(waiting);
  a->set_total_reqs(running + waiting);
  a->set_avg_token_usage(load.kv_usage());
  a->set_avg_throughput(gen_throughput);
  a->set_avg_utilization(utilization);
}

void to_smg(const v1::KvEventBatch& b, smg::KvEventBatch* out) {
  // smg's block hashes are int64: the same 64 bits.
  auto as_i64 = [](uint64_t h) {
    int64_t v;
    std::memcpy(&v, &h, sizeof v);
    return v;
  };
  out->set_sequence_number(b.sequence_number());
  out->set_timestamp(b.timestamp());
  out->set_dp_rank(0);
  uint64_t event_id = b.sequence_number() << 20;
  for (const v1::KvEvent& e : b.events()) {
    smg::KvCacheEvent* o = out->add_events();
    o->set_event_id(event_id++);
    switch (e.event_case()) {
      case v1::KvEvent::kBlockStored: {
        const v1::BlockStored& s = e.block_stored();
        smg::KvBlocksStored* st = o->mutable_stored();
        if (s.has_parent_block_hash()) st->set_parent_block_hash(as_i64(s.parent_block_hash()));
        const int n = int(s.block_size());
        for (int i = 0; i < s.block_hashes_size(); ++i) {
          smg::KvBlock* blk = st->add_blocks();
          blk->set_block_hash(as_i64(s.block_hashes(i)));
          blk->set_block_size(int32_t(n));
          for (int j = i * n; j < (i + 1) * n && j < s.token_ids_size(); ++j) blk->add_token_ids(uint32_t(s.token_ids(j)));
        }
        break;
      }
      case v1::KvEvent::kBlockRemoved:
        for (uint64_t h : e.block_removed().block_hashes()) o->mutable_removed()->add_block_hashes(as_i64(h));
        break;
      case v1::KvEvent::kAllBlocksCleared:
        o->mutable_cleared();
        break;
      case v1::KvEvent::EVENT_NOT_SET:
        break;
    }
  }
}

}  // namespace kvfuse::server
