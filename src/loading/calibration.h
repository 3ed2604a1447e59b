// KV scale calibration: per-layer scale = amax(|K|) / 448 and amax(|V|) / 448 over a
// prefill of given prompts, in the e4m3fn units of src/loading/kv_scales.h (the engine doubles
// them on e4m3fnuz devices).
//
// The amax is read from a bf16 KV cache: the cache then holds exactly the bf16 K (after
// RoPE) and V that an FP8 write would quantize, so no hook into the forward pass is
// needed and every backend calibrates the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "src/runtime/engine.h"
#include "src/loading/kv_scales.h"

namespace kvfuse {

struct KvAmax {
  std::vector<float> k, v;  // [num_layers]
  int64_t num_tokens = 0;
  int32_t num_prompts = 0;
};

// Prefills every prompt (in chunks of max_batch_tokens) on `engine`, which must have a
// bf16 KV cache and no live sequences, and returns the per-layer absolute maxima. The
// cache is cleared first. Cost: after each step the whole cache is scanned, so size
// the pool to the longest prompt (kvfuse-calibrate does).
absl::StatusOr<KvAmax> measure_kv_amax(Engine& engine, const std::vector<std::vector<int32_t>>& prompts);

// scale = amax / 448; a layer whose amax is 0 gets 1.0 (any scale is exact for zeros).
KvScales scales_from_amax(const KvAmax& amax);

// The kv_scales_file contents (read back by load_kv_scales_file).
nlohmann::json kv_scales_file_json(const KvAmax& amax, const KvScales& scales, const std::string& model);

}  // namespace kvfuse
