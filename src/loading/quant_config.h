// The `quantization_config` of a Hugging Face config.json for FP8 checkpoints, parsed,
// validated and normalised into one QuantConfig: the scheme every quantized linear layer
// uses, the modules left unquantized, and whether the checkpoint carries KV scales.
// Nothing here reads tensors; the loader (src/loading/checkpoint.cc) checks those.
//
// Accepted, by `quant_method`:
//
// "compressed-tensors" (llm-compressor):
//   format "float-quantized" or "naive-quantized" (a group's own `format`, when given,
//   wins; top-level "mixed-precision" needs one on every group); quantization_status
//   "compressed", "frozen" or absent; `config_groups` {name: {targets, weights,
//   input_activations, output_activations}} or the preset form
//   {"FP8" | "FP8_DYNAMIC": [targets]}. Each
//   QuantizationArgs takes compressed-tensors' defaults for absent keys (num_bits 8,
//   type "int", symmetric true, dynamic false, strategy from group_size: none -> tensor,
//   -1 -> channel, > 0 -> group).
//     weights: num_bits 8, type "float", strategy "tensor" | "channel", symmetric,
//       static;
//     input_activations: null (W8A16), static per tensor (`input_scale` tensors),
//       dynamic per token, or dynamic per tensor; 8-bit float, symmetric;
//     output_activations: null.
//   Every group must describe the same scheme (kvfuse serves one for all linear layers);
//   their `targets` are kept ("Linear" = every linear layer, "re:" regexes, names).
//   `kv_cache_scheme` null, or 8-bit float, per tensor, static, symmetric -> the
//   checkpoint carries k_scale / v_scale. `sparsity_config` and `transform_config` must
//   be empty.
//
// "quark" (AMD Quark):
//   `global_quant_config` {weight, input_tensors, output_tensors, bias}:
//     weight: dtype "fp8_e4m3", qscheme "per_tensor" | "per_channel" (ch_axis 0),
//       is_dynamic false, symmetric true (or null);
//     input_tensors: null, fp8_e4m3 static "per_tensor", dynamic "per_channel" (= per
//       token, as vLLM reads it) or dynamic "per_tensor";
//     output_tensors and bias: null.
//   `layer_quant_config` / `layer_type_quant_config` / `kv_cache_quant_config` entries
//   must repeat the global weight and input scheme; output_tensors (fp8_e4m3, static,
//   per tensor) are allowed only on patterns matching `export.kv_cache_group` (e.g.
//   "*k_proj", "*v_proj": the KV scales, written as k_proj/v_proj.output_scale) and on
//   "*q_proj" (vLLM drops that one too). A non-empty `export.kv_cache_group` -> KV scales.
//   `exclude` lists the unquantized modules; `export.weight_format` must be
//   "real_quantized" when given; an `algo_config` "rotation" with online rotation
//   layers is refused (it needs a transform at inference).
//
// "fp8" (vLLM, AutoFP8, transformers' FP8, DeepSeek / Qwen FP8):
//   `activation_scheme` "static" | "dynamic" (required, as vLLM requires it);
//   `ignored_layers` and/or `modules_to_not_convert` (both are kept); `fmt` "e4m3" when
//   given; `kv_cache_scheme` null or "static" (AutoFP8: KV scales in the checkpoint);
//   `weight_block_size` [n, k] -> weight_scale block with `weight_scale_inv` tensors,
//   which needs dynamic activations. Without blocks, weight scales are per tensor.
//
// Refused: any other method (gptq, awq, bitsandbytes, ...: UNIMPLEMENTED naming it);
// integer, 4-bit, MX, e5m2 or asymmetric weights; group / block strategies of
// compressed-tensors; dynamic weights; several schemes across layers. Supported-but-
// refused cases are UNIMPLEMENTED, malformed ones (a string where a number belongs, a
// missing key, ...) INVALID_ARGUMENT; parse_quant_config never throws. Every message
// names the file and the key path, e.g. "/m/config.json:
// quantization_config.config_groups.group_0.weights.num_bits: 4 is not supported
// (kvfuse serves 8-bit float weights)".
//
// Module names are the checkpoint's, without ".weight" ("lm_head",
// "model.layers.0.self_attn.q_proj"). An ignore / exclude entry matches a name when it
//   - starts with "re:": the rest, an ECMAScript regex, matches from the start of the
//     name (Python's re.match, as compressed-tensors and vLLM match; it need not reach
//     the end);
//   - contains '*', '?' or '[': it matches the whole name as a glob (fnmatch: '*' any
//     run of characters, dots included, '?' one character, [seq] / [!seq]), as Quark;
//   - otherwise: it equals the name, or the name ends with "." + entry ("lm_head"
//     matches "model.lm_head"; transformers' suffix rule, at a dot boundary).
// The same rules hold for every method's list. Fused shards: kvfuse, like vLLM, needs
// q/k/v_proj of a layer all quantized or all not, and gate/up_proj the same;
// check_fused_shards says which layer breaks that.
//
// The fp8 parser and the matching are in src/loading/quant_config.cc, the
// compressed-tensors and Quark parsers in src/loading/quant_config_formats.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/common/fp8.h"

namespace kvfuse {

struct QuantPatterns;  // src/loading/quant_config.cc

enum class WeightQuantFormat { none, fp8_e4m3 };
// block: one scale per block_n x block_k tile of the weight ([out, in]).
enum class ScaleGranularity { tensor, channel, block };
// none: weight-only (W8A16). static_tensor: calibrated `input_scale` tensors. dynamic_*:
// computed at run time (for "fp8" configs, which do not say how, dynamic_token; with
// block scales, per token and per block_k group, as DeepSeek-V3).
enum class ActivationScheme { none, static_tensor, dynamic_tensor, dynamic_token };

struct LinearQuant {
  WeightQuantFormat format = WeightQuantFormat::none;
  ScaleGranularity weight_scale = ScaleGranularity::tensor;
  int32_t block_n = 0, block_k = 0;  // weight_scale == block only
  ActivationScheme activation = ActivationScheme::none;
  bool operator==(const LinearQuant&) const = default;
};

struct QuantConfig {
  std::string source;  // the file, for messages
  std::string method;  // "compressed-tensors" | "quark" | "fp8"
  LinearQuant linear;  // the one scheme every quantized projection uses
  // Unquantized modules as written (compressed-tensors `ignore`, Quark `exclude`, fp8
  // `ignored_layers` then `modules_to_not_convert`).
  std::vector<std::string> ignore;
  // compressed-tensors: the groups' targets; a module no target matches is not
  // quantized. Empty (Quark, fp8) or containing "Linear": every linear layer is.
  std::vector<std::string> targets;
  bool kv_cache_scales = false;  // the config declares KV scales in the checkpoint
  // The weight-scale tensor beside each FP8 `weight`: "weight_scale", or
  // "weight_scale_inv" for "fp8" with weight_block_size (a multiplier despite the name).
  std::string weight_scale_suffix = "weight_scale";
  // Where block scales were declared, for require_tensor_or_channel_scales
  // (e.g. "quantization_config.weight_block_size").
  std::string block_key;

  // True when the module is left unquantized: an ignore entry matches it, or targets
  // are given and none matches it.
  bool ignored(absl::string_view module_name) const;
  // INVALID_ARGUMENT naming the file, the layer and the shards when, in a layer of
  // model.layers.N (N < num_layers), some but not all of self_attn.{q,k,v}_proj, or of
  // mlp.{gate,up}_proj, are ignored.
  absl::Status check_fused_shards(int32_t num_layers) const;
  // UNIMPLEMENTED, naming the file and block_key, when weight scales are per block;
  // OK otherwise. For a loader that dequantizes per-tensor / per-channel scales only.
  absl::Status require_tensor_or_channel_scales() const;
  // One line for logs and GetInfo, e.g. "compressed-tensors fp8_e4m3 W8A8 (weights per
  // channel, activations dynamic per token), 1 ignore entry" (", KV scales in the
  // checkpoint" before the count when kv_cache_scales).
  std::string describe() const;

  // Compiled ignore and target patterns, filled by parse_quant_config; when absent or
  // stale (fields set by hand), ignored() compiles them itself.
  std::shared_ptr<const QuantPatterns> patterns;
};

// How a projection's input activations are quantized, from the checkpoint's scheme:
// none -> none, static_tensor -> static_tensor, dynamic_token -> dynamic_token, and
// dynamic_tensor -> dynamic_token. kvfuse scales dynamic activations per token row: finer
// than one scale for the whole tensor, and a row's result does not depend on the other
// rows of the batch (one scale per tensor would make it depend on them).
Fp8Act fp8_act(ActivationScheme a);

// config_json is the whole config.json object; nullopt when it has no
// quantization_config (or null). `source` names the file in errors.
absl::StatusOr<std::optional<QuantConfig>> parse_quant_config(const nlohmann::json& config_json,
                                                              const std::string& source);

// fnmatch-style glob over the whole name ('*', '?', [seq], [!seq]); exposed for tests.
bool glob_match(absl::string_view pattern, absl::string_view name);

}  // namespace kvfuse
