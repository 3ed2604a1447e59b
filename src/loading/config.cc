#include "src/loading/config.h"

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/common/enum_name.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"
#include "src/loading/int_list.h"
#include "src/parallel/rendezvous.h"

namespace kvfuse {

using nlohmann::json;

const char* to_string(Device d) { return enum_name(d, {"auto", "cpu", "cuda", "hip"}); }
const char* to_string(KvCacheDtype d) { return enum_name(d, {"bf16", "fp8_e4m3", "fp8_e5m2"}); }
const char* to_string(KvWritePath p) { return enum_name(p, {"fused", "unfused", "fused_rope"}); }
const char* to_string(AttentionPath p) { return p == AttentionPath::unified ? "unified" : "split"; }
const char* to_string(GraphsMode g) { return g == GraphsMode::on ? "on" : "off"; }
const char* to_string(TpAllReduce a) {
  switch (a) {
    case TpAllReduce::nccl:
      return "nccl";
    case TpAllReduce::push:
      return "push";
    default:
      return "auto";
  }
}

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v = {"tiny", "llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b", "hybrid-swa"};
    const size_t n = v.size();
    for (size_t i = 0; i < n; ++i) v.push_back(v[i] + "-fp8");
    return v;
  }();
  return names;
}

const std::vector<ConfigKeyDoc>& config_key_docs() {
  static const std::vector<ConfigKeyDoc> docs = {
      {"model", "tiny | llama3-8b | llama3-70b | qwen2.5-7b | mistral-7b | hybrid-swa, each also as <name>-fp8",
       "model preset (default tiny); <name>-fp8: the same shapes with FP8 weights (a scale per output channel, "
       "activations quantized per token)"},
      {"model_path", "directory path, or \"\"",
       "Hugging Face model directory (config.json + safetensors); when set, model and seed are unused"},
      {"seed", "integer >= 0", "seed of the synthetic weights (default 0)"},
      {"device", "auto | cpu | cuda | hip", "backend; auto takes a built-in GPU if present, else the CPU"},
      {"kv_cache_dtype", "bf16 | fp8_e4m3 | fp8_e5m2",
       "KV cache element type; fp8_e4m3 is stored as e4m3fn, or e4m3fnuz on gfx942 (default fp8_e4m3)"},
      {"kv_write", "fused | unfused | fused_rope",
       "KV write path: one fused kernel, scale/cast/scatter stages, or the fused kernel with RoPE in it"},
      {"attention", "unified | split",
       "attention path (default unified; on a GPU a decode-only batch too small to fill it takes the "
       "split-KV "
       "kernel)"},
      {"graphs", "on | off",
       "decode steps replay a CUDA/HIP graph captured per batch bucket (default on; no effect on the CPU)"},
      {"page_size", "1 .. 1024", "tokens per KV page (default 16)"},
      {"num_pages", "0 .. 2147483647",
       "pages in the full pool (default 4096); 0: as many as fit in the device memory left after weights and "
       "workspaces, less memory_headroom_mib"},
      {"memory_headroom_mib", "0 .. 1048576",
       "device memory (MiB) that stays free after the KV pool, for graphs, libraries and scratch that grows while "
       "serving (default 2048); on a GPU a num_pages that leaves less is refused at start"},
      {"swa_num_pages", "0 .. 2147483647", "pages in the SWA pool; 0 sizes it from the window and batch limits"},
      {"sliding_window", "-1 | 0 | W > 0", "-1 keeps the preset's window, 0 disables SWA, W sets it"},
      {"swa_layers", "preset | none | all | alternate | [layer, ...]",
       "which layers use the window; alternate marks even layers"},
      {"k_scale", "null, number > 0, or one per layer",
       "per-tensor K scale in e4m3fn units: stored = fp8(k / k_scale); null: kv_scales_file, checkpoint or "
       "1.0"},
      {"v_scale", "null, number > 0, or one per layer", "per-tensor V scale, as k_scale"},
      {"kv_scales_file", "file path, or \"\"",
       "JSON file with k_scale/v_scale per layer (kvfuse-calibrate writes it); overrides checkpoint scales"},
      {"max_batch_tokens", "1 .. 65536", "per-step token budget; longer prompts are prefilled in chunks"},
      {"max_running_seqs", "1 .. 4096", "sequences decoded together in one step"},
      {"max_seq_len", "2 .. 1048576", "longest sequence (prompt plus generated tokens)"},
      {"prefix_cache", "on | off",
       "full KV pages stay cached after their sequence ends, and a new sequence whose prompt begins with cached "
       "pages takes them instead of computing them (default on; models without SWA layers)"},
      {"prefix_reuse", "on | off", "the former name of prefix_cache"},
      {"kv_events_history", "1 .. 1048576",
       "batches of prefix-cache events kept for SubscribeKvEvents subscribers that reconnect"},
      {"overlap_fanout", "on | off",
       "the server sends a step's tokens to their streams while the device runs the next step "
       "(default on; off: after the step, before the next one is planned)"},
      {"tensor_parallel", "1 .. 64", "ranks (GPUs, or CPU threads) a model is sharded over (default 1)"},
      {"devices", "[ordinal, ...], \"0,1,...\" or one ordinal",
       "GPU ordinals, one per rank this process holds, no duplicates; empty (default): 0 .. "
       "tensor_parallel-1 (with tp_rendezvous: one GPU, 0; a list of n: ranks tp_rank .. tp_rank+n-1)"},
      {"tp_rendezvous", "host:port, or \"\"",
       "rank 0's address when the ranks span processes or nodes; \"\" (default): all ranks in this process"},
      {"tp_rank", "0 .. tensor_parallel-1",
       "with tp_rendezvous: the first rank this process holds (default 0); rank 0's process serves, the "
       "others follow it"},
      {"tp_rendezvous_timeout_s", "1 .. 3600",
       "how long ranks wait for each other at the rendezvous, and in NCCL's set-up after it (default 120)"},
      {"tp_allreduce", "auto | nccl | push",
       "GPU ranks' all-reduce: auto (default) runs small ones as one kernel over peer memory when every "
       "pair of GPUs has peer access, nccl sends all through NCCL/RCCL, push is auto with each row-parallel "
       "projection pushing its partial sums into the peers' next norm instead"},
  };
  return docs;
}

namespace {

absl::Status key_error(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config key '", key, "': ", what));
}

// A value for an error message. Structured values are summarised, not printed: the
// printer recurses, and an invalid UTF-8 string (an override that is not JSON) would
// make it throw.
std::string dump(const json& v) {
  if (v.is_array()) return absl::StrCat("a list of ", v.size());
  if (v.is_object()) return "an object";
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

template <class E>
absl::Status parse_enum(const json& j, const std::string& key, const std::map<std::string, E>& values,
                        E& out) {
  std::vector<std::string> names;
  for (const auto& [name, _] : values) names.push_back(name);
  if (!j.is_string()) {
    return key_error(key, absl::StrCat(dump(j), " is not a string; allowed: ", absl::StrJoin(names, ", ")));
  }
  auto it = values.find(j.get<std::string>());
  if (it == values.end()) {
    return key_error(key, absl::StrCat(dump(j), " is not one of ", absl::StrJoin(names, ", ")));
  }
  out = it->second;
  return absl::OkStatus();
}

// Optional '-' and one or more digits: how an integer is written.
bool is_integer_literal(absl::string_view text) {
  absl::ConsumePrefix(&text, "-");
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// An integer key's value within [lo, hi]. A value no 64-bit integer holds is out of
// range as written (an unsigned one above INT64_MAX, or a whole number the JSON reader
// could only hold as a double), never wrapped around.
template <class T>
absl::Status parse_int(const json& j, const std::string& key, int64_t lo, int64_t hi, T& out) {
  const auto out_of_range = [&](const std::string& v) {
    return key_error(key, absl::StrCat(v, " is out of range [", lo, ", ", hi, "]"));
  };
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(INT64_MAX)) return out_of_range(dump(j));
  if (int64_t unused = 0; j.is_string() && is_integer_literal(j.get_ref<const std::string&>()) &&
                          !absl::SimpleAtoi(j.get_ref<const std::string&>(), &unused)) {
    return out_of_range(j.get<std::string>());  // beyond 64 bits, as typed (apply_config_override)
  }
  if (j.is_number_float() && std::isfinite(j.get<double>()) && std::trunc(j.get<double>()) == j.get<double>() &&
      std::fabs(j.get<double>()) >= 0x1p63) {
    return out_of_range(dump(j));
  }
  if (!j.is_number_integer()) return key_error(key, absl::StrCat(dump(j), " is not an integer"));
  const int64_t v = j.get<int64_t>();
  if (v < lo || v > hi) return out_of_range(absl::StrCat(v));
  out = T(v);
  return absl::OkStatus();
}

absl::Status parse_scales(const json& j, const std::string& key, std::vector<float>& out) {
  out.clear();
  if (j.is_null()) return absl::OkStatus();  // not set
  std::vector<const json*> items;
  if (j.is_array()) {
    if (j.empty()) return key_error(key, "empty list");
    for (const json& v : j) items.push_back(&v);
  } else {
    items.push_back(&j);
  }
  for (const json* pv : items) {
    const json& v = *pv;
    if (!v.is_number()) return key_error(key, absl::StrCat(dump(v), " is not a number"));
    // A float, and a normal one: a subnormal scale's reciprocal overflows, and one below
    // that rounds to 0.
    const double d = v.get<double>();
    if (!std::isfinite(d) || d <= 0.0 || d > 3.0e38 || d < double(FLT_MIN)) {
      return key_error(key, absl::StrCat(dump(v), " must be a finite number > 0, from 1.2e-38 to 3e38"));
    }
    out.push_back(float(d));
  }
  return absl::OkStatus();
}

// A path: a string without NUL bytes ("" means unset). Whether it exists is checked
// where it is used, so that configs stay portable between machines.
absl::Status parse_path(const json& j, const std::string& key, std::string& out) {
  if (!j.is_string()) return key_error(key, absl::StrCat(dump(j), " is not a string"));
  const std::string& s = j.get_ref<const std::string&>();
  if (s.find('\0') != std::string::npos) return key_error(key, "contains a NUL byte");
  out = s;
  return absl::OkStatus();
}

absl::Status parse_devices(const json& j, std::vector<int32_t>& out) {
  out.clear();
  if (j.is_number()) {  // --set devices=1 and KVFUSE_DEVICES=1 (one GPU) read as a number
    int32_t d = 0;
    KVFUSE_RETURN_IF_ERROR(parse_int(j, "devices", 0, 1023, d));
    out.push_back(d);
  } else if (j.is_string()) {  // --set devices=0,1 and KVFUSE_DEVICES=0,1
    const std::string& text = j.get_ref<const std::string&>();
    // "" is the default; otherwise every item is an ordinal ("0,,1" is a typo, not [0, 1]).
    if (!absl::StripAsciiWhitespace(text).empty()) {
      for (absl::string_view item : absl::StrSplit(text, ',')) {
        if (absl::StripAsciiWhitespace(item).empty()) {
          return key_error("devices",
                           absl::StrCat("'", text, "' has an empty item; list GPU ordinals as 0,1"));
        }
      }
    }
    auto list = parse_int_list(text);
    if (!list.ok()) return key_error("devices", std::string(list.status().message()));
    out = *list;
  } else if (j.is_array()) {
    for (const json& e : j) {
      int32_t d = 0;
      KVFUSE_RETURN_IF_ERROR(parse_int(e, "devices", 0, 1023, d));
      out.push_back(d);
    }
  } else {
    return key_error("devices", absl::StrCat(dump(j), " is not a list of GPU ordinals"));
  }
  std::set<int32_t> seen;
  for (int32_t d : out) {
    if (d < 0 || d > 1023) return key_error("devices", absl::StrCat(d, " is out of range [0, 1023]"));
    if (!seen.insert(d).second) return key_error("devices", absl::StrCat("GPU ", d, " is listed twice"));
  }
  return absl::OkStatus();
}

// The keys that depend on each other: devices and tp_rank against tensor_parallel.
absl::Status check_tensor_parallel_keys(const Config& c) {
  const int32_t tp = c.tensor_parallel;
  if (c.tp_rendezvous.empty()) {
    if (!c.devices.empty() && int32_t(c.devices.size()) != tp) {
      return key_error("devices", absl::StrCat(c.devices.size(), " GPU(s) listed for tensor_parallel ", tp,
                                               "; list one per rank, or none for 0 .. ", tp - 1));
    }
    if (c.tp_rank != 0)
      return key_error("tp_rank", "set only with tp_rendezvous (ranks in several processes)");
    return absl::OkStatus();
  }
  if (auto hp = parse_host_port(c.tp_rendezvous); !hp.ok()) {
    return key_error("tp_rendezvous", std::string(hp.status().message()));
  } else if (hp->second == 0) {
    return key_error("tp_rendezvous", absl::StrCat("'", c.tp_rendezvous, "' needs a port other than 0"));
  }
  if (tp < 2) return key_error("tp_rendezvous", "needs tensor_parallel >= 2");
  if (c.tp_rank >= tp)
    return key_error("tp_rank", absl::StrCat(c.tp_rank, " is not below tensor_parallel ", tp));
  if (c.tp_rank + c.tp_local_ranks() > tp) {
    return key_error("devices", absl::StrCat(c.tp_local_ranks(), " GPU(s) from tp_rank ", c.tp_rank,
                                             " go past tensor_parallel ", tp));
  }
  return absl::OkStatus();
}

}  // namespace

int32_t Config::tp_local_ranks() const {
  if (tp_rank_alone) return 1;
  if (tp_share_gpu) return tensor_parallel;
  if (!devices.empty()) return int32_t(devices.size());
  return tp_rendezvous.empty() ? tensor_parallel : 1;
}

int32_t Config::tp_device(int32_t local_rank) const {
  if (tp_share_gpu) return devices.empty() ? 0 : devices[0];
  return devices.empty() ? local_rank : devices[size_t(local_rank)];
}

std::string config_key_name(std::string key) {
  std::replace(key.begin(), key.end(), '-', '_');
  return key;
}

absl::StatusOr<Config> config_from_json(const json& spelled) {
  if (!spelled.is_object()) return absl::InvalidArgumentError("config: the top level must be a JSON object");
  // kv-write and kv_write are one key, as on the command line.
  json j = json::object();
  for (const auto& [key, value] : spelled.items()) {
    const std::string name = config_key_name(key);
    if (j.contains(name))
      return absl::InvalidArgumentError(absl::StrCat("config: key '", name, "' is set twice"));
    j[name] = value;
  }
  std::set<std::string> known;
  for (const auto& d : config_key_docs()) known.insert(d.key);
  for (const auto& [key, _] : j.items()) {
    if (!known.count(key)) {
      std::vector<std::string> names(known.begin(), known.end());
      return absl::InvalidArgumentError(
          absl::StrCat("config: unknown key '", key, "'; known keys: ", absl::StrJoin(names, ", ")));
    }
  }

  Config c;
  auto has = [&](const char* k) { return j.contains(k); };
  if (has("model")) {
    static const std::map<std::string, std::string> presets = [] {
      std::map<std::string, std::string> m;
      for (const std::string& name : preset_names()) m.emplace(name, name);
      return m;
    }();
    KVFUSE_RETURN_IF_ERROR(parse_enum(j["model"], "model", presets, c.model));
  }
  if (has("model_path")) KVFUSE_RETURN_IF_ERROR(parse_path(j["model_path"], "model_path", c.model_path));
  if (has("kv_scales_file")) KVFUSE_RETURN_IF_ERROR(parse_path(j["kv_scales_file"], "kv_scales_file", c.kv_scales_file));
  if (has("seed")) KVFUSE_RETURN_IF_ERROR(parse_int(j["seed"], "seed", 0, INT64_MAX, c.seed));
  if (has("device")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(
        j["device"], "device",
        std::map<std::string, Device>{
            {"auto", Device::auto_}, {"cpu", Device::cpu}, {"cuda", Device::cuda}, {"hip", Device::hip}},
        c.device));
  }
  if (has("kv_cache_dtype")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(j["kv_cache_dtype"], "kv_cache_dtype",
                          std::map<std::string, KvCacheDtype>{{"bf16", KvCacheDtype::bf16},
                                                              {"fp8_e4m3", KvCacheDtype::fp8_e4m3},
                                                              {"fp8_e5m2", KvCacheDtype::fp8_e5m2}},
                          c.kv_cache_dtype));
  }
  if (has("kv_write")) {
    KVFUSE_RETURN_IF_ERROR(
        parse_enum(j["kv_write"], "kv_write",
                   std::map<std::string, KvWritePath>{{"fused", KvWritePath::fused},
                                                      {"unfused", KvWritePath::unfused},
                                                      {"fused_rope", KvWritePath::fused_rope}},
                   c.kv_write));
  }
  if (has("attention")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(j["attention"], "attention",
                          std::map<std::string, AttentionPath>{{"unified", AttentionPath::unified},
                                                               {"split", AttentionPath::split}},
                          c.attention));
  }
  if (has("graphs")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(j["graphs"], "graphs",
                          std::map<std::string, GraphsMode>{{"on", GraphsMode::on}, {"off", GraphsMode::off}},
                          c.graphs));
  }
  for (const char* key : {"prefix_cache", "prefix_reuse"}) {
    if (has(key)) {
      KVFUSE_RETURN_IF_ERROR(
          parse_enum(j[key], key, std::map<std::string, bool>{{"on", true}, {"off", false}}, c.prefix_cache));
    }
  }
  if (has("prefix_cache") && has("prefix_reuse") && j["prefix_cache"] != j["prefix_reuse"]) {
    return absl::InvalidArgumentError("config: prefix_cache and prefix_reuse (its former name) disagree");
  }
  if (has("overlap_fanout")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(j["overlap_fanout"], "overlap_fanout",
                                      std::map<std::string, bool>{{"on", true}, {"off", false}}, c.overlap_fanout));
  }
  if (has("page_size")) KVFUSE_RETURN_IF_ERROR(parse_int(j["page_size"], "page_size", 1, 1024, c.page_size));
  if (has("num_pages")) KVFUSE_RETURN_IF_ERROR(parse_int(j["num_pages"], "num_pages", 0, INT32_MAX, c.num_pages));
  if (has("memory_headroom_mib")) {
    KVFUSE_RETURN_IF_ERROR(
        parse_int(j["memory_headroom_mib"], "memory_headroom_mib", 0, 1 << 20, c.memory_headroom_mib));
  }
  if (has("swa_num_pages")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["swa_num_pages"], "swa_num_pages", 0, INT32_MAX, c.swa_num_pages));
  }
  if (has("sliding_window")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["sliding_window"], "sliding_window", -1, 1 << 24, c.sliding_window));
  }
  if (has("swa_layers")) {
    const json& v = j["swa_layers"];
    if (v.is_array()) {
      c.swa_layers = "list";
      for (const auto& e : v) {
        int32_t layer = 0;
        KVFUSE_RETURN_IF_ERROR(parse_int(e, "swa_layers", 0, 4096, layer));
        c.swa_layer_list.push_back(layer);
      }
    } else {
      KVFUSE_RETURN_IF_ERROR(
          parse_enum(v, "swa_layers",
                     std::map<std::string, std::string>{
                         {"preset", "preset"}, {"none", "none"}, {"all", "all"}, {"alternate", "alternate"}},
                     c.swa_layers));
    }
  }
  if (has("k_scale")) KVFUSE_RETURN_IF_ERROR(parse_scales(j["k_scale"], "k_scale", c.k_scale));
  if (has("v_scale")) KVFUSE_RETURN_IF_ERROR(parse_scales(j["v_scale"], "v_scale", c.v_scale));
  if (has("max_batch_tokens")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["max_batch_tokens"], "max_batch_tokens", 1, 65536, c.max_batch_tokens));
  }
  if (has("kv_events_history")) {
    KVFUSE_RETURN_IF_ERROR(
        parse_int(j["kv_events_history"], "kv_events_history", 1, 1048576, c.kv_events_history));
  }
  if (has("max_running_seqs")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["max_running_seqs"], "max_running_seqs", 1, 4096, c.max_running_seqs));
  }
  if (has("max_seq_len")) KVFUSE_RETURN_IF_ERROR(parse_int(j["max_seq_len"], "max_seq_len", 2, 1 << 20, c.max_seq_len));
  if (has("tensor_parallel")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["tensor_parallel"], "tensor_parallel", 1, 64, c.tensor_parallel));
  }
  if (has("devices")) KVFUSE_RETURN_IF_ERROR(parse_devices(j["devices"], c.devices));
  if (has("tp_rendezvous")) {
    KVFUSE_RETURN_IF_ERROR(parse_path(j["tp_rendezvous"], "tp_rendezvous", c.tp_rendezvous));
  }
  if (has("tp_rank")) KVFUSE_RETURN_IF_ERROR(parse_int(j["tp_rank"], "tp_rank", 0, 63, c.tp_rank));
  if (has("tp_rendezvous_timeout_s")) {
    KVFUSE_RETURN_IF_ERROR(parse_int(j["tp_rendezvous_timeout_s"], "tp_rendezvous_timeout_s", 1, 3600,
                                     c.tp_rendezvous_timeout_s));
  }
  if (has("tp_allreduce")) {
    KVFUSE_RETURN_IF_ERROR(parse_enum(
        j["tp_allreduce"], "tp_allreduce",
        std::map<std::string, TpAllReduce>{
            {"auto", TpAllReduce::auto_}, {"nccl", TpAllReduce::nccl}, {"push", TpAllReduce::push}},
        c.tp_allreduce));
  }
  KVFUSE_RETURN_IF_ERROR(check_tensor_parallel_keys(c));
  return c;
}

absl::StatusOr<Config> load_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("config file '", path, "' cannot be opened"));
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat("config file '", path, "' is not valid JSON"));
  auto c = config_from_json(j);
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status apply_config_override(json& j, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(absl::StrCat("override '", assignment, "' is not key=value"));
  }
  const std::string key = config_key_name(assignment.substr(0, eq));
  const std::string text = assignment.substr(eq + 1);
  json v = json::parse(text, nullptr, /*allow_exceptions=*/false);
  // An integer literal beyond 64 bits reads as a double; errors name it as typed.
  if (v.is_number_float() && is_integer_literal(text)) v = json(text);
  // The later assignment wins, whichever spelling the earlier one used.
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end();) {
      it = it.key() != key && config_key_name(it.key()) == key ? j.erase(it) : std::next(it);
    }
  }
  j[key] = v.is_discarded() ? json(text) : v;
  return absl::OkStatus();
}

std::string config_env_name(const std::string& key) {
  std::string name = "KVFUSE_" + config_key_name(key);
  for (char& ch : name) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  return name;
}

absl::Status apply_config_env(json& j) {
  // A misspelled variable would change nothing without a word.
  for (const UnknownEnv& u : unknown_kvfuse_env(environ)) {
    spdlog::warn("event=unknown_env name={} closest={} note=\"no config key or switch of that name: ignored; "
                 "kvfuse-server --help-env lists them\"",
                 u.name, u.closest);
  }
  for (const auto& d : config_key_docs()) {
    const std::string var = config_env_name(d.key);
    const char* value = std::getenv(var.c_str());
    if (value == nullptr || *value == '\0') continue;
    if (auto st = apply_config_override(j, absl::StrCat(d.key, "=", value)); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(var, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

json config_to_json(const Config& c) {
  json j;
  j["model"] = c.model;
  j["model_path"] = c.model_path;
  j["seed"] = c.seed;
  j["device"] = to_string(c.device);
  j["kv_cache_dtype"] = to_string(c.kv_cache_dtype);
  j["kv_write"] = to_string(c.kv_write);
  j["attention"] = to_string(c.attention);
  j["graphs"] = to_string(c.graphs);
  j["page_size"] = c.page_size;
  j["num_pages"] = c.num_pages;
  j["memory_headroom_mib"] = c.memory_headroom_mib;
  j["swa_num_pages"] = c.swa_num_pages;
  j["sliding_window"] = c.sliding_window;
  if (c.swa_layers == "list") {
    j["swa_layers"] = c.swa_layer_list;
  } else {
    j["swa_layers"] = c.swa_layers;
  }
  auto scales = [](const std::vector<float>& v) {
    return v.empty() ? json(nullptr) : v.size() == 1 ? json(v[0]) : json(v);
  };
  j["k_scale"] = scales(c.k_scale);
  j["v_scale"] = scales(c.v_scale);
  j["kv_scales_file"] = c.kv_scales_file;
  j["max_batch_tokens"] = c.max_batch_tokens;
  j["max_running_seqs"] = c.max_running_seqs;
  j["prefix_cache"] = c.prefix_cache ? "on" : "off";
  j["prefix_reuse"] = j["prefix_cache"];  // the former name, kept in step
  j["kv_events_history"] = c.kv_events_history;
  j["overlap_fanout"] = c.overlap_fanout ? "on" : "off";
  j["max_seq_len"] = c.max_seq_len;
  j["tensor_parallel"] = c.tensor_parallel;
  j["devices"] = c.devices;
  j["tp_rendezvous"] = c.tp_rendezvous;
  j["tp_rank"] = c.tp_rank;
  j["tp_rendezvous_timeout_s"] = c.tp_rendezvous_timeout_s;
  j["tp_allreduce"] = to_string(c.tp_allreduce);
  return j;
}

}  // namespace kvfuse
