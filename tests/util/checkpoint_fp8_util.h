// Writes FP8 checkpoints for tests: tiny synthetic weights exported in the Hugging Face
// layout, their projections quantized to FP8 as the compressed-tensors, Quark and fp8
// exports store them (tests/loading/test_checkpoint_fp8.cc, tests/engine/test_fp8_weights.cc).
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/common/fp8.h"
#include "tests/util/checkpoint_test_util.h"

namespace kvfuse::testing {

// compressed-tensors (llm-compressor FP8_DYNAMIC): per-channel weights, dynamic per-token
// activations, lm_head left out.
inline const nlohmann::json kCtDynamic = nlohmann::json::parse(R"({
  "config_groups": {"group_0": {
    "input_activations": {"dynamic": true, "num_bits": 8, "strategy": "token", "symmetric": true, "type": "float"},
    "output_activations": null,
    "targets": ["Linear"],
    "weights": {"dynamic": false, "num_bits": 8, "strategy": "channel", "symmetric": true, "type": "float"}}},
  "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": null,
  "quant_method": "compressed-tensors", "quantization_status": "compressed"})");

// How write_fp8 stores a checkpoint: which projections are FP8, their scales' layout,
// and the input scales.
struct Fp8Layout {
  nlohmann::json quant = kCtDynamic;  // quantization_config; null: none in config.json
  bool per_channel = true;  // weight scales [n, 1]; else per tensor, of shape tensor_scale_shape
  std::vector<int64_t> tensor_scale_shape = {1};
  // Which weight tensors (model.layers.N.*_proj.weight) are stored FP8.
  std::function<bool(const std::string&)> fp8 = [](const std::string&) { return true; };
  // When set, an F32 `input_scale` of this value beside each FP8 weight.
  std::function<float(const std::string&)> input_scale;
  // When set, multiplies a weight's scales (>= 1: its codes then use less of the range).
  std::function<float(const std::string&)> scale_mult;
  // Scales rounded up to powers of two: every code times its scale is then exact in bf16.
  bool pow2_scales = false;
};

// What a projection's FP8 shard was written as: its codes, and its scale per output row.
struct Fp8Shard {
  std::vector<uint8_t> codes;
  std::vector<float> row_scales;
};

// Exports tiny's synthetic weights (seed 11), then quantizes the projections `layout`
// names to FP8 (scale = largest magnitude / 448, per row or per tensor) and writes the
// quantization_config. Returns the FP8 shards by weight name.
inline std::map<std::string, Fp8Shard> write_fp8(const std::string& dir, const ModelSpec& spec,
                                          const Fp8Layout& layout) {
  export_synthetic(dir, spec, 11);
  if (!layout.quant.is_null()) {
    nlohmann::json config = nlohmann::json::parse(read_file(dir + "/config.json"));
    config["quantization_config"] = layout.quant;
    write_file(dir + "/config.json", config.dump(2));
  }
  std::map<std::string, Fp8Shard> shards;
  rewrite_tensors(dir + "/model.safetensors", [&](std::vector<StWriteTensor>& all) {
    std::vector<StWriteTensor> added;
    for (StWriteTensor& t : all) {
      if (!t.name.starts_with("model.layers.") || !t.name.ends_with("_proj.weight") || !layout.fp8(t.name))
        continue;
      REQUIRE(t.dtype == StDtype::BF16);
      const int64_t n = t.shape[0], k = t.shape[1];
      std::vector<float> x(size_t(n * k));
      for (size_t i = 0; i < x.size(); ++i) {
        uint16_t b;
        std::memcpy(&b, t.bytes.data() + 2 * i, 2);
        x[i] = bf16_to_f32(b);
      }
      std::vector<float> scales(size_t(layout.per_channel ? n : 1), 0.0f);
      for (int64_t i = 0; i < n * k; ++i) {
        float& s = scales[layout.per_channel ? size_t(i / k) : 0];
        s = std::max(s, std::fabs(x[size_t(i)]) / 448.0f);
      }
      for (float& s : scales) {
        s = (s > 0.0f ? s : 1.0f) * (layout.scale_mult ? layout.scale_mult(t.name) : 1.0f);
        if (layout.pow2_scales) s = std::exp2(std::ceil(std::log2(s)));
      }
      Fp8Shard& sh = shards[t.name];
      for (int64_t i = 0; i < n * k; ++i) {
        const float s = scales[layout.per_channel ? size_t(i / k) : 0];
        sh.codes.push_back(fp8_encode(x[size_t(i)] / s, Fp8Format::e4m3fn));
      }
      for (int64_t r = 0; r < n; ++r) sh.row_scales.push_back(scales[layout.per_channel ? size_t(r) : 0]);
      t.dtype = StDtype::F8_E4M3;
      t.bytes = sh.codes;
      const std::string base = t.name.substr(0, t.name.size() - std::string("weight").size());
      added.push_back({base + "weight_scale", StDtype::F32,
                       layout.per_channel ? std::vector<int64_t>{n, 1} : layout.tensor_scale_shape,
                       bytes_of(scales)});
      if (layout.input_scale) added.push_back(f32_scalar(base + "input_scale", layout.input_scale(t.name)));
    }
    all.insert(all.end(), added.begin(), added.end());
  });
  return shards;
}

}  // namespace kvfuse::testing
