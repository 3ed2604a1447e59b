// The FP8 part of the checkpoint loader (src/loading/checkpoint.h has the rules): which
// tensors of a checkpoint with a quantization_config (src/loading/quant_config.h) must be
// FP8, the checks of those tensors and of their scales, and loading a projection's FP8
// shards into HostLinear's FP8 form (src/loading/host_weights.h). Checkpoint::validate
// and the weight source in src/loading/checkpoint.cc call these.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "kernels/common/fp8.h"
#include "src/loading/checkpoint.h"
#include "src/loading/host_weights.h"
#include "src/loading/quant_config.h"

namespace kvfuse {

// Names and dtypes, for checkpoint.cc and checkpoint_fp8.cc.
inline bool is_float_dtype(StDtype d) {
  return d == StDtype::BF16 || d == StDtype::F16 || d == StDtype::F32 || d == StDtype::F64;
}
inline bool is_projection(absl::string_view name) {
  return absl::EndsWith(name, "_proj.weight") || name == "lm_head.weight";
}
inline std::string strip_suffix(absl::string_view name, absl::string_view suffix) {
  return std::string(name.substr(0, name.size() - suffix.size()));
}


// True when the weight tensor `weight` (e.g. "model.layers.0.self_attn.q_proj.weight") is
// a projection of a decoder layer (q/k/v/o_proj, gate/up/down_proj) that `q` quantizes:
// not ignored, with FP8 weights. lm_head, the embeddings, the norms and biases never are.
bool fp8_quantized(const QuantConfig& q, absl::string_view weight);

// Checkpoint::validate under a quantization_config, for a tensor the architecture expects
// (its shape already checked): a quantized projection must be F8_E4M3 with its
// `<base><weight_scale_suffix>` tensor (and `<base>input_scale` under static activation
// scales); any other tensor must be BF16, F16, F32 or F64. Errors name the file and tensor.
absl::Status check_fp8_expected(const Checkpoint& c, const QuantConfig& q, const CheckpointTensor& t);

// Checkpoint::validate for a tensor named `<base>weight_scale` (or the config's suffix) or
// `<base>input_scale`; `quant` is the checkpoint's quantization_config, if any. Weight
// scales: of an F8_E4M3 projection, per tensor ([] or [1]) or per output channel ([n] or
// [n, 1]), floating point, finite and > 0. Input scales: of a projection, floating point;
// under static activation scales, for a quantized projection, also one value, F32, BF16 or
// F16, finite and > 0 (otherwise they are unused). Sets `handled` false, and checks
// nothing, for a tensor with neither suffix.
absl::Status check_scale_tensor(const Checkpoint& c, const std::optional<QuantConfig>& quant,
                                const std::map<std::string, std::vector<int64_t>>& expected,
                                const CheckpointTensor& t, bool& handled);

// Whether the projection whose shards (weight tensor names, in row order) are `shards`
// loads in FP8: under a quantization_config, when its shards are F8_E4M3. Shards stored
// differently (one F8_E4M3, one not) are an error naming both.
absl::StatusOr<bool> fp8_projection(const Checkpoint& c, const std::vector<std::string>& shards);

// Appends one FP8 shard `weight` to out's FP8 form: its e4m3fn codes as stored, its scale
// expanded to one per output row (each shard keeps its own), out.act from the config, and
// under static activation scales out.input_scale raised to the shard's input_scale. A NaN
// code is an error naming the tensor and the element.
absl::Status append_fp8_shard(const Checkpoint& c, const std::string& weight, HostLinear& out);

}  // namespace kvfuse
