// Shapes of the Llama-family models kvfuse serves, and the presets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/loading/config.h"

namespace kvfuse {

struct ModelSpec {
  std::string name;
  std::string arch;  // llama | qwen2 | mistral | hybrid
  int32_t vocab = 0;
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool qkv_bias = false;
  bool tie_embeddings = false;
  int32_t sliding_window = 0;      // 0: none
  std::vector<bool> layer_is_swa;  // [num_layers]
  int32_t max_position = 4096;
  // Special tokens, from config.json and generation_config.json (presets: the declared
  // values of the model they mimic; none for tiny). -1: not declared.
  std::vector<int32_t> eos_token_ids;  // all of them (Llama 3 instruct models have several)
  int32_t bos_token_id = -1;
  int32_t pad_token_id = -1;

  int64_t q_dim() const { return int64_t(num_q_heads) * head_dim; }
  int64_t kv_dim() const { return int64_t(num_kv_heads) * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  bool any_swa() const;
  int64_t num_params() const;
};

// The named shape, with the preset's own sliding-window settings.
absl::StatusOr<ModelSpec> model_preset(const std::string& name);
// The preset, or the config.json of `model_path` when set, with the config's
// sliding_window / swa_layers overrides applied, validated.
absl::StatusOr<ModelSpec> resolve_model_spec(const Config& cfg);

// A model's shapes on one rank of a tensor-parallel group of `tp` ranks (Megatron-style):
// QKV and gate_up split by columns (q and KV heads, intermediate rows) per rank, O and down
// by rows followed by an all-reduce, the lm_head by vocabulary rows followed by a gather.
// The vocabulary need not divide: it is padded up to a multiple of tp, the padding rows of
// the last rank are zero and their logits are dropped after the gather (as Megatron and
// vLLM pad). Heads and the intermediate size must divide: a KV head is never split or
// replicated across ranks.
struct TensorParallelShard {
  int32_t tp = 1;
  int32_t num_q_heads = 0;   // per rank
  int32_t num_kv_heads = 0;  // per rank
  int32_t intermediate = 0;  // per rank
  int32_t vocab = 0;         // per rank: padded_vocab / tp
  int32_t padded_vocab = 0;  // the vocabulary rounded up to a multiple of tp
};

// INVALID_ARGUMENT naming every one of num_q_heads, num_kv_heads and intermediate that tp
// does not divide (and tp itself when it is < 1).
absl::Status check_tensor_parallel(const ModelSpec& spec, int tp);
absl::StatusOr<TensorParallelShard> tensor_parallel_shard(const ModelSpec& spec, int tp);

}  // namespace kvfuse
