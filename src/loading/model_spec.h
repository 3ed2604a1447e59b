// Shapes of the Llama-family models kvfuse serves, and the presets.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/loading/config.h"
#include "src/loading/quant_config.h"

namespace kvfuse {

// How the rotary embedding's frequencies are scaled for long contexts, as a Hugging Face
// config.json's `rope_scaling` (transformers 4.x) or `rope_parameters` (transformers 5)
// describes it. src/loading/rope.h turns it into the frequency table; the formulas are
// transformers' (modeling_rope_utils.py). `dynamic` and `longrope` are not represented:
// their frequencies change with the sequence length, and loading refuses them.
enum class RopeType { kDefault, kLinear, kLlama3, kYarn };

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;  // linear, llama3, yarn
  // llama3 and yarn: the context length the model was pretrained with.
  int32_t original_max_position = 0;
  // llama3: wavelengths above original / low_freq_factor are divided by factor, those
  // below original / high_freq_factor are kept, the band between is interpolated.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // yarn: the ramp between extrapolated and interpolated dimensions (in rotations over
  // the original context), and the attention factor that multiplies cos and sin: the
  // given one, else from mscale / mscale_all_dim, else 0.1 ln(factor) + 1.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> attention_factor;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  bool truncate = true;  // round the ramp's ends to whole dimensions

  bool operator==(const RopeScaling&) const = default;
};

// "default", "linear", "llama3", "yarn": the names transformers uses.
const char* rope_type_name(RopeType t);

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
  RopeScaling rope_scaling;
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
  // FP8 weights: the checkpoint's quantization_config (src/loading/quant_config.h), or the
  // FP8 preset's; none for bf16 models.
  std::optional<QuantConfig> quant;

  int64_t q_dim() const { return int64_t(num_q_heads) * head_dim; }
  int64_t kv_dim() const { return int64_t(num_kv_heads) * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  bool any_swa() const;
  // One layer's projection weights (q/k/v, o, gate/up, down), and their output rows.
  int64_t layer_projection_params() const;
  int64_t layer_projection_rows() const;
  int64_t num_params() const;
  // Bytes of the weights as a backend holds them (all ranks together): bf16 values, and
  // for FP8 projections one byte a value plus an fp32 scale per output channel.
  int64_t weight_bytes() const;
  // "bf16", or the FP8 scheme (QuantConfig::describe).
  std::string weight_format() const;
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
// vLLM pad). Query heads and the intermediate size must divide. KV heads are split when tp
// divides them; when tp is a multiple of their number, each rank holds one KV head, the one
// its query heads read, replicated on tp / num_kv_heads ranks (as vLLM does): no KV head is
// ever split.
struct TensorParallelShard {
  int32_t tp = 1;
  int32_t num_q_heads = 0;   // per rank
  int32_t num_kv_heads = 0;  // per rank
  int32_t kv_replicas = 1;   // ranks holding each KV head (1: split, no copies)
  int32_t intermediate = 0;  // per rank
  int32_t vocab = 0;         // per rank: padded_vocab / tp
  int32_t padded_vocab = 0;  // the vocabulary rounded up to a multiple of tp

  // The first query head, KV head, intermediate row and vocabulary row of rank r.
  int32_t q_head_begin(int32_t r) const { return r * num_q_heads; }
  int32_t kv_head_begin(int32_t r) const { return r / kv_replicas * num_kv_heads; }
  int32_t intermediate_begin(int32_t r) const { return r * intermediate; }
  int32_t vocab_begin(int32_t r) const { return r * vocab; }
};

// INVALID_ARGUMENT naming every one of num_q_heads, num_kv_heads and intermediate that tp
// does not divide (num_kv_heads: neither divides the other), and tp itself when it is < 1.
absl::Status check_tensor_parallel(const ModelSpec& spec, int tp);
absl::StatusOr<TensorParallelShard> tensor_parallel_shard(const ModelSpec& spec, int tp);

}  // namespace kvfuse
