// Engine configuration: one flat JSON object, every key validated at load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "kernels/common/kernel_select.h"

namespace kvfuse {

enum class Device { auto_, cpu, cuda, hip };
enum class KvCacheDtype { bf16, fp8_e4m3, fp8_e5m2 };
// KvWritePath and AttentionPath: kernels/common/kernel_select.h, with the rules that
// turn them into kernels.
enum class GraphsMode { off, on };
// How GPU ranks all-reduce: auto takes the one-shot kernel over peer memory where it
// applies (src/parallel/peer_allreduce.h), nccl sends every collective through NCCL/RCCL,
// push is auto with the row-parallel projections' partial sums pushed into the norms after
// them where that applies (peer_allreduce.h, "Pushed partial sums").
enum class TpAllReduce { auto_, nccl, push };

// Every model preset name (config key `model`, src/loading/model_spec.h): the bf16
// models, then each as <name>-fp8 (FP8 weights).
const std::vector<std::string>& preset_names();

const char* to_string(Device d);
const char* to_string(KvCacheDtype d);
const char* to_string(KvWritePath p);
const char* to_string(AttentionPath p);
const char* to_string(GraphsMode g);
const char* to_string(TpAllReduce a);

struct Config {
  std::string model = "tiny";  // preset name
  std::string model_path;      // Hugging Face model directory; when set, `model` and `seed` are unused
  uint64_t seed = 0;           // synthetic weights
  Device device = Device::auto_;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::fp8_e4m3;
  KvWritePath kv_write = KvWritePath::fused;
  AttentionPath attention = AttentionPath::unified;
  // Decode-only steps replay a CUDA/HIP graph captured per batch bucket (no effect on the CPU).
  GraphsMode graphs = GraphsMode::on;
  int32_t page_size = 16;
  int64_t num_pages = 4096;  // 0: as many as fit (src/runtime/memory_plan.h)
  // Device memory left free after the KV pool: graphs, libraries, scratch growth.
  int64_t memory_headroom_mib = 2048;
  int64_t swa_num_pages = 0;            // 0: sized from the window and the batch limits
  int32_t sliding_window = -1;          // -1: the preset's; 0: none; W > 0: window of W keys
  std::string swa_layers = "preset";    // preset | none | all | alternate | list
  std::vector<int32_t> swa_layer_list;  // when swa_layers == "list"
  // One value for every layer, or one per layer; empty when the config does not set the
  // key (JSON null), so that a kv_scales_file or checkpoint scales apply (src/loading/kv_scales.h).
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  std::string kv_scales_file;      // JSON file of per-layer scales (calibration output)
  int32_t max_batch_tokens = 512;  // per-step token budget (chunked prefill)
  int32_t max_running_seqs = 64;
  int32_t max_seq_len = 4096;
  // Full KV pages stay cached past their sequence, and a new sequence takes the cached
  // pages its prompt begins with (no SWA layers; not with prompt logprobs).
  bool prefix_cache = true;
  // Batches of prefix-cache events the server keeps for subscribers that reconnect.
  int32_t kv_events_history = 4096;
  // Server: a step's tokens go out to their streams while the device runs the next step
  // (off: between the two, on the step's critical path; for A/B).
  bool overlap_fanout = true;
  // Tensor parallelism (src/parallel; docs/tensor-parallel.md): the ranks in one
  // process, or, with tp_rendezvous, spread over processes (one or several ranks each).
  int32_t tensor_parallel = 1;   // ranks in the group (the world size)
  std::vector<int32_t> devices;  // this process's GPU ordinals, one per rank it holds; empty: 0 .. n-1
  std::string tp_rendezvous;     // host:port of rank 0 when the group spans processes; empty: one process
  int32_t tp_rank = 0;           // with tp_rendezvous: the first rank this process holds
  int32_t tp_rendezvous_timeout_s = 120;  // the rendezvous, then NCCL's set-up (each)
  TpAllReduce tp_allreduce = TpAllReduce::auto_;
  // Not a config key (no file or --set reaches it): kvfuse-bench-engine --tp-rank-alone sets
  // it to time rank 0 of a tensor_parallel group on one device with no peers, its shard's
  // own kernels only: every collective is left out (the all-reduces keep this rank's partial
  // sums; the logits gather copies this rank's slice and zeroes the others). Its logits and
  // tokens mean nothing; it measures what a rank computes, for a machine of one GPU.
  bool tp_rank_alone = false;
  // Not a config key either: tests on a machine of one GPU set it to run a tensor_parallel
  // group in one process with every rank on the same GPU (devices empty, or its one
  // ordinal), the all-reduces and the pushed sums over the peer group in its test mode and
  // the logits gather through that group too (SharedGpuCommunicator; NCCL refuses ranks
  // sharing a GPU). The kernels, the collectives' protocol and graphs run as on GPUs of
  // their own; the links do not, and it is no faster than tp 1. Never for serving.
  bool tp_share_gpu = false;
  // Ranks this process holds: len(devices), or tensor_parallel (one process) / 1 (rendezvous).
  int32_t tp_local_ranks() const;
  // GPU ordinal of local rank i: devices[i], or i when devices is empty (with tp_share_gpu:
  // devices[0], or 0).
  int32_t tp_device(int32_t local_rank) const;
};

// Parses and validates. Errors name the key and, for enumerations, the allowed values;
// an unknown key is an error.
absl::StatusOr<Config> config_from_json(const nlohmann::json& j);
absl::StatusOr<Config> load_config_file(const std::string& path);
// Applies "key=value" (the value parsed as JSON, or taken as a string if that fails).
// Keys may be spelled with dashes or underscores (kv-write, kv_write), here and in a file.
absl::Status apply_config_override(nlohmann::json& j, const std::string& assignment);
// The canonical spelling of a key: dashes become underscores.
std::string config_key_name(std::string key);
// KVFUSE_<KEY> (KVFUSE_KV_WRITE=unfused) for a config key.
std::string config_env_name(const std::string& key);
// Applies the KVFUSE_<KEY> environment variables that are set and not empty, as
// overrides. Precedence: command line > environment > config file > default, so call
// this after loading the file and before applying the command line. Logs a warning
// (event=unknown_env) for each KVFUSE_* variable that names neither a config key nor a
// switch of src/loading/env_switches.h, with the closest name.
absl::Status apply_config_env(nlohmann::json& j);
nlohmann::json config_to_json(const Config& c);

// Reference of every key, for --help and docs/configuration.md (config_keys_markdown in src/loading/config_docs.h): key, allowed values, meaning.
struct ConfigKeyDoc {
  const char* key;
  const char* values;
  const char* meaning;
};
const std::vector<ConfigKeyDoc>& config_key_docs();

}  // namespace kvfuse
