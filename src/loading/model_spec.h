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

}  // namespace kvfuse
