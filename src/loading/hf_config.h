// A Hugging Face config.json (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)
// read into a ModelSpec, with the defaults transformers itself applies to missing keys.
//
// Sliding window, as transformers decides it:
//   - `layer_types` (newer transformers writes it): "sliding_attention" layers use the
//     window `sliding_window`, "full_attention" layers do not;
//   - Mistral without `layer_types`: every layer uses `sliding_window` (4096 when the
//     key is absent, none when it is null);
//   - Qwen2 without `layer_types`: layers i >= `max_window_layers` use the window when
//     `use_sliding_window` is true and `sliding_window` is not null; otherwise none;
//   - Llama: none.
// RoPE: `rope_theta` (or `rope_parameters.rope_theta`), scaled as `rope_scaling`
// (transformers 4.x) or `rope_parameters` (5) says: rope_type (or the legacy `type`)
// default, linear, llama3 or yarn, with the fields and defaults transformers 5 reads
// (src/loading/rope.h has the formulas; yarn's original_max_position_embeddings falls
// back to the top-level key, then to max_position_embeddings, and a null yarn factor is
// max_position_embeddings / original). yarn raises ModelSpec::max_position to
// original x factor when max_position_embeddings is smaller. dynamic, longrope and
// unknown types are refused with UNIMPLEMENTED: their frequencies differ, so serving
// them as another RoPE would silently give wrong logits. Bad values are
// INVALID_ARGUMENT naming the field (e.g. 'rope_scaling.factor').
// quantization_config: parsed by src/loading/quant_config.h (FP8 checkpoints of
// compressed-tensors, Quark and fp8; other methods are refused) into ModelSpec::quant;
// block-wise weight scales are refused with UNIMPLEMENTED, a config that quantizes some
// shards of a fused q/k/v or gate/up projection but not the others with INVALID_ARGUMENT.
// The tensors are checked against it by src/loading/checkpoint.h.
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "src/loading/model_spec.h"

namespace kvfuse {

// `source` names the file in errors. `name` becomes ModelSpec::name.
absl::StatusOr<ModelSpec> spec_from_hf_config(const nlohmann::json& j, absl::string_view source,
                                              const std::string& name);
// Reads `model_dir`/config.json, then the special tokens of
// `model_dir`/generation_config.json when that file exists (they replace config.json's).
absl::StatusOr<ModelSpec> load_hf_config(const std::string& model_dir);
// The special tokens of a config.json or generation_config.json object into s:
// `bos_token_id`, `pad_token_id` (an id or null) and `eos_token_id` (an id, a list of
// ids, or null), each in [0, s.vocab); keys that are absent leave s as it is.
absl::Status read_special_tokens(const nlohmann::json& j, absl::string_view source, ModelSpec& s);
// The `rope_scaling` value of a config.json that spec_from_hf_config reads back as `sc`
// (transformers 4.x layout, which transformers 5 also reads): null for default RoPE.
nlohmann::json rope_scaling_json(const RopeScaling& sc);

}  // namespace kvfuse
