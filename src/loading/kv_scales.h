// Per-layer KV cache scales: where they come from, and what reaches the device.
//
// Units. Every scale kvfuse reads (config k_scale/v_scale, a kv_scales_file, checkpoint
// tensors) is in e4m3fn units, the convention of FP8 checkpoints and of calibration:
// scale = amax / 448, so that x / scale fits e4m3fn. The cache contract is
// stored = fp8(x / scale), x ~ float(stored) * scale, with float() the concrete format's
// own decoding. On e4m3fnuz (gfx942) the same scale would clip everything above
// 240 * scale, so the engine stores 2 * scale there (kv_scale_on_device): x / (2 scale)
// then lands on the e4m3fnuz code whose bits equal the e4m3fn code of x / scale (the
// FNUZ grid is exactly half the OCP grid), so both devices hold the same bytes and
// dequantize to the same values, and the range is the calibrated one. vLLM makes the
// same choice (it doubles k_scale/v_scale on FNUZ platforms).
//
// Precedence, per tensor kind (K and V separately):
//   1. the config's k_scale / v_scale, when the key is given;
//   2. the file named by the config's kv_scales_file;
//   3. the checkpoint's per-layer scale tensors (model_path);
//   4. 1.0.
#pragma once

#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "kernels/common/kv_types.h"
#include "src/loading/config.h"

namespace kvfuse {

struct KvScales {
  std::vector<float> k, v;         // [num_layers], e4m3fn units
  std::string k_source, v_source;  // e.g. "config", "kv_scales_file /x.json", "checkpoint", "default"
};

// Largest finite e4m3fn value: the reference range of every scale (scale = amax / 448).
constexpr float kKvScaleReferenceMax = 448.0f;

// The scale written to the device for a scale in e4m3fn units (see the header).
float kv_scale_on_device(float scale, KvFormat dtype);

// A scales file: {"k_scale": x | [x, ...], "v_scale": ..., and optionally the keys
// calibration writes (format, fp8_reference, fp8_max, k_amax, v_amax, num_layers,
// num_tokens, num_prompts, model)}. One value applies to every layer.
absl::StatusOr<KvScales> kv_scales_from_json(const nlohmann::json& j, absl::string_view source,
                                             int32_t num_layers);
absl::StatusOr<KvScales> load_kv_scales_file(const std::string& path, int32_t num_layers);

// The scales an engine uses, in e4m3fn units, by the precedence above.
absl::StatusOr<KvScales> resolve_kv_scales(const Config& cfg, const std::optional<KvScales>& checkpoint,
                                           int32_t num_layers);

}  // namespace kvfuse
