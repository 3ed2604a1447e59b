// A model directory in the Hugging Face layout: config.json and either model.safetensors
// or model.safetensors.index.json with its shards, memory-mapped.
//
// Opening validates everything before a byte of weights is converted: the config
// (src/loading/hf_config.h), each file's header (src/loading/safetensors.h), the index against the
// shards, and every tensor's name, shape and dtype against the architecture. Errors
// name the file and the tensor.
//
// Tensors (Llama, Mistral and Qwen2 names; N is the layer):
//   model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent or ignored when
//   tie_word_embeddings), model.layers.N.{input_layernorm,post_attention_layernorm}.weight,
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ q/k/v_proj.bias for Qwen2),
//   model.layers.N.mlp.{gate,up,down}_proj.weight.
// Weights may be BF16, F16, F32 or F64 (converted to bf16, round to nearest even).
// FP8 checkpoints, by their config.json's quantization_config (src/loading/quant_config.h;
// block-wise scales are refused):
//   - every q/k/v/o_proj and gate/up/down_proj the config does not ignore must be F8_E4M3
//     with a `<name minus "weight">weight_scale` tensor, per tensor ([] or [1]) or per
//     output channel ([n] or [n, 1]), finite and > 0; it loads in HostLinear's FP8 form
//     (src/loading/host_weights.h): the e4m3fn codes as stored (a NaN code is an error),
//     one scale per output row (a fused q/k/v or gate/up keeps each shard's own), and the
//     activation scheme: none, static per tensor, or dynamic per token (dynamic per-tensor
//     configs are served per token: finer, and a row's result does not depend on the
//     batch). Static schemes need `input_scale` (one value, F32/BF16/F16, finite, > 0) on
//     every quantized projection; a fused projection takes its shards' largest. Other
//     schemes tolerate and ignore input_scale tensors;
//   - ignored projections, lm_head, the embeddings, norms and biases must be BF16, F16,
//     F32 or F64 and load as bf16; the shards of a fused projection must all be quantized
//     or all not;
//   - Quark's self_attn.q_proj.output_scale (a query scale) is checked and ignored.
// Without a quantization_config, F8_E4M3 projections with a weight_scale (per tensor or
// per output channel) are dequantized to bf16, and input_scale tensors are ignored:
// nothing declares how to compute in FP8. The FP8 checks and loading are in
// src/loading/checkpoint_fp8.cc. `*.rotary_emb.inv_freq` buffers of old checkpoints are
// ignored. Any other tensor is an error.
//
// KV scales (scalars, finite and > 0, e4m3fn units; every layer or none):
//   model.layers.N.self_attn.k_scale / v_scale      (vLLM, llm-compressor, ModelOpt)
//   model.layers.N.self_attn.kv_scale                (older AutoFP8: one scale for both)
//   model.layers.N.self_attn.{k,v}_proj.output_scale (older vLLM naming; Quark's)
// A layer with two forms of the same scale is an error.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "src/loading/host_weights.h"
#include "src/loading/kv_scales.h"
#include "src/loading/model_spec.h"
#include "src/loading/safetensors.h"

namespace kvfuse {

struct CheckpointTensor {
  const SafetensorsFile* file = nullptr;
  const StTensorInfo* info = nullptr;
};

class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // From config.json, without config overrides; spec().quant is its quantization_config.
  const ModelSpec& spec() const { return spec_; }
  const std::optional<KvScales>& kv_scales() const { return kv_scales_; }
  size_t num_files() const { return files_.size(); }
  const CheckpointTensor* find(absl::string_view name) const;

  // The weights, converted to bf16 on demand (FP8 projections of a checkpoint with a
  // quantization_config stay FP8, see above). The Checkpoint must outlive the source.
  std::unique_ptr<HostWeightSource> weights() const;
  // INVALID_ARGUMENT unless `spec` has the checkpoint's shapes: the checkpoint's spec
  // with config overrides (the sliding window) applied.
  absl::Status check_shapes(const ModelSpec& spec) const;

 private:
  Checkpoint() = default;
  absl::Status map_files();
  absl::Status validate();

  std::string dir_;
  ModelSpec spec_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, CheckpointTensor> tensors_;  // ordered: the first error is deterministic
  std::optional<KvScales> kv_scales_;
};

// Writing checkpoints: the config.json of a spec, and a whole model directory from
// host weights (used to export the synthetic models for tests and the reference check).
nlohmann::json hf_config_json(const ModelSpec& spec);
struct ExportOptions {
  StDtype dtype = StDtype::BF16;      // BF16, F16 or F32
  int num_shards = 1;                 // > 1 writes model-0000i-of-0000n.safetensors and the index
  std::optional<KvScales> kv_scales;  // written as self_attn.k_scale / v_scale (F32 scalars)
};
absl::Status export_checkpoint(const std::string& dir, const ModelSpec& spec, HostWeightSource& weights,
                               const ExportOptions& opts = {});

}  // namespace kvfuse
