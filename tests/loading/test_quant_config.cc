// quantization_config of FP8 checkpoints (src/loading/quant_config.h): the configs real
// checkpoints carry parse into the expected QuantConfig, every refusal names the file and
// the key path, ignore / exclude entries match as documented, and no JSON shape throws.
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "src/loading/quant_config.h"
#include "tests/util/catch.h"

using namespace kvfuse;
using nlohmann::json;

namespace {

const std::string kSource = "/m/config.json";

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

absl::StatusOr<std::optional<QuantConfig>> parse(const json& qc) {
  return parse_quant_config(json{{"architectures", {"LlamaForCausalLM"}}, {"quantization_config", qc}},
                            kSource);
}

QuantConfig parsed(const json& qc) {
  auto r = parse(qc);
  INFO((r.ok() ? std::string("ok") : std::string(r.status().message())));
  REQUIRE(r.ok());
  REQUIRE(r->has_value());
  return **r;
}

// The message a config is refused with, its code checked; it names the file and the
// quantization_config key it is about.
std::string refused(const json& qc, absl::StatusCode code) {
  absl::StatusOr<std::optional<QuantConfig>> r = absl::InternalError("not run");
  REQUIRE_NOTHROW(r = parse(qc));
  REQUIRE_FALSE(r.ok());
  const std::string m(r.status().message());
  INFO(m);
  CHECK(r.status().code() == code);
  CHECK(contains(m, kSource + ": quantization_config"));
  return m;
}
std::string unsupported(const json& qc) { return refused(qc, absl::StatusCode::kUnimplemented); }
std::string invalid(const json& qc) { return refused(qc, absl::StatusCode::kInvalidArgument); }

json with(json j, const std::string& pointer, const json& value) {
  j[json::json_pointer(pointer)] = value;
  return j;
}

// RedHatAI (neuralmagic) Meta-Llama-3.1-8B-Instruct-FP8-dynamic, as llm-compressor writes it:
// per-channel weights, dynamic per-token activations, lm_head left out.
const json kCtDynamic = json::parse(R"({
  "config_groups": {
    "group_0": {
      "input_activations": {"actorder": null, "block_structure": null, "dynamic": true, "group_size": null,
                            "num_bits": 8, "observer": null, "observer_kwargs": {}, "strategy": "token",
                            "symmetric": true, "type": "float"},
      "output_activations": null,
      "targets": ["Linear"],
      "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": null,
                  "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
                  "symmetric": true, "type": "float"}
    }
  },
  "format": "float-quantized",
  "global_compression_ratio": 1.2405352996226195,
  "ignore": ["lm_head"],
  "kv_cache_scheme": null,
  "quant_method": "compressed-tensors",
  "quantization_status": "compressed"
})");

// nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf, as transformers' compressed-tensors
// documentation prints it (defaults left out): static per-tensor weights and inputs.
const json kCtStaticDoc = json::parse(R"({
  "config_groups": {
    "group_0": {
      "input_activations": {"num_bits": 8, "strategy": "tensor", "type": "float"},
      "targets": ["Linear"],
      "weights": {"num_bits": 8, "strategy": "tensor", "type": "float"}
    }
  },
  "format": "naive-quantized",
  "ignore": ["lm_head"],
  "quant_method": "compressed-tensors",
  "quantization_status": "frozen"
})");

// An llm-compressor FP8 static export with per-channel weights and an FP8 KV cache: the
// dynamic export above with static per-tensor inputs and a kv_cache_scheme.
const json kCtStaticKv = [] {
  const json fp8_tensor_static = {{"dynamic", false},     {"num_bits", 8},     {"observer", "minmax"},
                                  {"strategy", "tensor"}, {"symmetric", true}, {"type", "float"}};
  json j = kCtDynamic;
  j["config_groups"]["group_0"]["input_activations"] = fp8_tensor_static;
  j["kv_cache_scheme"] = fp8_tensor_static;
  j["sparsity_config"] = json::object();
  return j;
}();

// A Quark export of its FP8-KV recipe (W8A8 static per tensor, KV scales on the K and V
// projections' outputs), in the layout Quark writes.
const json kQuarkFp8Kv = json::parse(R"({
  "algo_config": null,
  "exclude": ["lm_head"],
  "export": {"kv_cache_group": ["*v_proj", "*k_proj"], "min_kv_scale": 0.0, "pack_method": "reorder",
             "weight_format": "real_quantized", "weight_merge_groups": null},
  "global_quant_config": {
    "bias": null,
    "input_tensors": {"ch_axis": null, "dtype": "fp8_e4m3", "group_size": null, "is_dynamic": false,
                      "observer_cls": "PerTensorMinMaxObserver", "qscheme": "per_tensor", "round_method": null,
                      "scale_type": "float", "symmetric": true},
    "output_tensors": null,
    "target_device": null,
    "weight": {"ch_axis": null, "dtype": "fp8_e4m3", "group_size": null, "is_dynamic": false,
               "observer_cls": "PerTensorMinMaxObserver", "qscheme": "per_tensor", "round_method": null,
               "scale_type": "float", "symmetric": true}
  },
  "layer_quant_config": {
    "*k_proj": {
      "bias": null, "target_device": null,
      "input_tensors": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true},
      "output_tensors": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true},
      "weight": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true}
    },
    "*v_proj": {
      "bias": null, "target_device": null,
      "input_tensors": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true},
      "output_tensors": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true},
      "weight": {"dtype": "fp8_e4m3", "is_dynamic": false, "qscheme": "per_tensor", "symmetric": true}
    }
  },
  "layer_type_quant_config": {},
  "quant_method": "quark",
  "quant_mode": "eager_mode",
  "softmax_quant_spec": null
})");

// amd/Llama-3.1-8B-Instruct-FP8-KV (AutoFP8's layout): static FP8, KV scales in the checkpoint.
const json kFp8AmdKv = json::parse(R"({"activation_scheme": "static", "ignored_layers": ["lm_head"],
                                       "kv_cache_scheme": "static", "quant_method": "fp8"})");
// deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-8B-FP8: 128x128 block scales (weight_scale_inv).
const json kFp8Blocks = json::parse(R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]})");

// An FP8 scheme as parsed: the method, the weight scales' granularity, the activation
// scheme, and whether the config declares KV scales.
void check_scheme(const QuantConfig& q, const char* method, ScaleGranularity w, ActivationScheme a, bool kv) {
  CHECK(q.method == method);
  CHECK(q.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, w, 0, 0, a});
  CHECK(q.kv_cache_scales == kv);
}

}  // namespace

TEST_CASE("quant config: no quantization_config, or null, is no quantization", "[quant_config]") {
  auto r = parse_quant_config(json{{"architectures", {"LlamaForCausalLM"}}}, kSource);
  REQUIRE(r.ok());
  CHECK_FALSE(r->has_value());
  r = parse_quant_config(json{{"quantization_config", nullptr}}, kSource);
  REQUIRE(r.ok());
  CHECK_FALSE(r->has_value());
  r = parse_quant_config(json::array({1, 2}), kSource);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("quant config: compressed-tensors FP8 exports give their scheme",
          "[quant_config][compressed_tensors]") {
  const QuantConfig d = parsed(kCtDynamic);
  CHECK(d.method == "compressed-tensors");
  CHECK(d.source == kSource);
  CHECK(d.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::channel, 0, 0,
                                ActivationScheme::dynamic_token});
  CHECK(d.ignore == std::vector<std::string>{"lm_head"});
  CHECK(d.targets == std::vector<std::string>{"Linear"});
  CHECK_FALSE(d.kv_cache_scales);
  CHECK(d.weight_scale_suffix == "weight_scale");
  CHECK(d.describe() ==
        "compressed-tensors fp8_e4m3 W8A8 (weights per channel, activations dynamic per token), 1 ignore "
        "entry");
  CHECK(d.ignored("lm_head"));
  CHECK_FALSE(d.ignored("model.layers.0.self_attn.q_proj"));
  CHECK(d.check_fused_shards(32).ok());
  CHECK(d.require_tensor_or_channel_scales().ok());

  const QuantConfig s = parsed(kCtStaticDoc);  // absent keys take compressed-tensors' defaults
  CHECK(s.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::tensor, 0, 0,
                                ActivationScheme::static_tensor});
  CHECK_FALSE(s.kv_cache_scales);

  const QuantConfig kv = parsed(kCtStaticKv);
  CHECK(kv.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::channel, 0, 0,
                                 ActivationScheme::static_tensor});
  CHECK(kv.kv_cache_scales);
  CHECK(contains(kv.describe(), "KV scales in the checkpoint"));

  // Weight-only (W8A16), per-tensor dynamic inputs, and the preset form.
  const QuantConfig w = parsed(with(kCtDynamic, "/config_groups/group_0/input_activations", nullptr));
  CHECK(w.linear.activation == ActivationScheme::none);
  CHECK(contains(w.describe(), "W8A16 (weights per channel, activations unquantized)"));
  CHECK(parsed(with(kCtDynamic, "/config_groups/group_0/input_activations/strategy", "tensor"))
            .linear.activation == ActivationScheme::dynamic_tensor);
  const QuantConfig p = parsed(json{{"quant_method", "compressed-tensors"},
                                    {"format", "float-quantized"},
                                    {"config_groups", {{"FP8_DYNAMIC", {"Linear"}}}},
                                    {"ignore", {"lm_head"}}});
  CHECK(p.linear == d.linear);
  // Two groups with the same scheme (here on disjoint targets) are one scheme.
  json two = kCtDynamic;
  two["config_groups"]["group_0"]["targets"] = {"re:.*self_attn.*"};
  two["config_groups"]["group_1"] = two["config_groups"]["group_0"];
  two["config_groups"]["group_1"]["targets"] = {"re:.*mlp.*"};
  two["config_groups"]["group_1"]["format"] = "float-quantized";
  const QuantConfig t = parsed(two);
  CHECK(t.targets.size() == 2);
  CHECK_FALSE(t.ignored("model.layers.1.mlp.down_proj"));
  CHECK(t.ignored("lm_head"));
}

TEST_CASE("quant config: compressed-tensors refusals name the key path",
          "[quant_config][compressed_tensors]") {
  const std::string w = "/config_groups/group_0/weights";
  CHECK(contains(
      unsupported(with(kCtDynamic, w + "/num_bits", 4)),
      "/m/config.json: quantization_config.config_groups.group_0.weights.num_bits: 4 is not supported "
      "(kvfuse serves 8-bit float weights)"));
  CHECK(contains(unsupported(with(kCtDynamic, w + "/type", "int")), "group_0.weights.type: 'int'"));
  json w4a16 = with(kCtDynamic, w, {{"num_bits", 8}, {"type", "float"}, {"group_size", 128}});
  CHECK(contains(unsupported(w4a16), "group_0.weights.strategy: 'group' is not supported"));
  CHECK(
      contains(unsupported(with(kCtDynamic, w + "/strategy", "block")), "group_0.weights.strategy: 'block'"));
  CHECK(contains(unsupported(with(kCtDynamic, w + "/dynamic", true)), "group_0.weights.dynamic: true"));
  CHECK(contains(unsupported(with(kCtDynamic, w + "/symmetric", false)), "group_0.weights.symmetric: false"));
  CHECK(contains(unsupported(with(kCtDynamic, "/format", "pack-quantized")),
                 "quantization_config.format: 'pack-quantized' is not supported"));
  CHECK(contains(unsupported(with(kCtDynamic, "/format", "int-quantized")), "quantization_config.format"));
  CHECK(contains(unsupported(with(kCtDynamic, "/config_groups/group_0/format", "nvfp4-pack-quantized")),
                 "config_groups.group_0.format"));
  CHECK(contains(unsupported(with(kCtDynamic, "/config_groups/group_0/input_activations",
                                  {{"num_bits", 8},
                                   {"type", "float"},
                                   {"strategy", "group"},
                                   {"group_size", 128},
                                   {"dynamic", true}})),
                 "group_0.input_activations.strategy: 'group' with dynamic true"));
  CHECK(contains(unsupported(with(kCtDynamic, "/config_groups/group_0/input_activations/type", "int")),
                 "group_0.input_activations.type"));
  CHECK(contains(unsupported(with(kCtDynamic, "/config_groups/group_0/output_activations",
                                  kCtDynamic["config_groups"]["group_0"]["weights"])),
                 "group_0.output_activations"));
  json mixed = kCtDynamic;
  mixed["config_groups"]["group_1"] = kCtStaticDoc["config_groups"]["group_0"];
  std::string m = unsupported(mixed);
  CHECK(contains(m, "quantization_config.config_groups: 'group_0' and 'group_1' describe different schemes"));
  CHECK(contains(m, "one scheme for all linear layers"));
  CHECK(contains(unsupported(with(kCtStaticKv, "/kv_cache_scheme/type", "int")),
                 "kv_cache_scheme.type: 'int'"));
  CHECK(contains(unsupported(with(kCtStaticKv, "/kv_cache_scheme/strategy", "attn_head")),
                 "kv_cache_scheme.strategy: 'attn_head'"));
  CHECK(contains(unsupported(with(kCtDynamic, "/sparsity_config", {{"format", "sparse-24-bitmask"}})),
                 "quantization_config.sparsity_config"));
  CHECK(contains(unsupported(with(kCtDynamic, "/quantization_status", "initialized")),
                 "quantization_config.quantization_status: 'initialized'"));
  CHECK(contains(unsupported(json{{"quant_method", "compressed-tensors"},
                                  {"format", "float-quantized"},
                                  {"config_groups", {{"W4A16", {"Linear"}}}}}),
                 "config_groups.W4A16: preset scheme 'W4A16'"));
  CHECK(contains(invalid(with(kCtDynamic, "/config_groups", json::object())),
                 "config_groups: is missing or empty"));
}

TEST_CASE("quant config: a Quark FP8-KV export gives its scheme and KV scales", "[quant_config][quark]") {
  const QuantConfig q = parsed(kQuarkFp8Kv);
  check_scheme(q, "quark", ScaleGranularity::tensor, ActivationScheme::static_tensor, true);
  CHECK(q.ignore == std::vector<std::string>{"lm_head"});
  CHECK(q.targets.empty());
  CHECK(q.ignored("lm_head"));
  CHECK_FALSE(q.ignored("model.layers.0.mlp.down_proj"));
  CHECK(
      q.describe() ==
      "quark fp8_e4m3 W8A8 (weights per tensor, activations static per tensor), KV scales in the checkpoint, "
      "1 ignore entry");

  // Per-channel weights with dynamic per-token inputs (qscheme per_channel, is_dynamic).
  json dyn = kQuarkFp8Kv;
  dyn["export"]["kv_cache_group"] = json::array();
  dyn["layer_quant_config"] = json::object();
  dyn["global_quant_config"]["weight"]["qscheme"] = "per_channel";
  dyn["global_quant_config"]["weight"]["ch_axis"] = 0;
  dyn["global_quant_config"]["input_tensors"]["qscheme"] = "per_channel";
  dyn["global_quant_config"]["input_tensors"]["is_dynamic"] = true;
  const QuantConfig d = parsed(dyn);
  CHECK(d.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::channel, 0, 0,
                                ActivationScheme::dynamic_token});
  CHECK_FALSE(d.kv_cache_scales);
  CHECK(parsed(with(dyn, "/global_quant_config/input_tensors", nullptr)).linear.activation ==
        ActivationScheme::none);
}

TEST_CASE("quant config: Quark refusals name the key path", "[quant_config][quark]") {
  const std::string gw = "/global_quant_config/weight";
  CHECK(contains(unsupported(with(kQuarkFp8Kv, gw + "/dtype", "int4")),
                 "quantization_config.global_quant_config.weight.dtype: 'int4' is not supported"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, gw + "/dtype", "uint4")), "weight.dtype: 'uint4'"));
  CHECK(contains(
      unsupported(with(kQuarkFp8Kv, gw, {{"dtype", "fp4"}, {"qscheme", "per_group"}, {"group_size", 32}})),
      "weight.dtype: 'fp4'"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, gw + "/dtype", "fp8_e5m2")), "weight.dtype: 'fp8_e5m2'"));
  CHECK(
      contains(unsupported(with(kQuarkFp8Kv, gw + "/qscheme", "per_group")), "weight.qscheme: 'per_group'"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, gw + "/symmetric", false)), "weight.symmetric: false"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, gw + "/is_dynamic", true)), "weight.is_dynamic: true"));
  CHECK(contains(
      unsupported(with(kQuarkFp8Kv, gw,
                       json::array({kQuarkFp8Kv["global_quant_config"]["weight"], {{"dtype", "int4"}}}))),
      "global_quant_config.weight: a list of specs"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, "/global_quant_config/input_tensors/dtype", "int8")),
                 "global_quant_config.input_tensors.dtype: 'int8'"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, "/global_quant_config/output_tensors",
                                  kQuarkFp8Kv["global_quant_config"]["weight"])),
                 "global_quant_config.output_tensors"));
  // A per-layer override with another scheme.
  std::string m = unsupported(with(kQuarkFp8Kv, "/layer_quant_config/*v_proj/weight/qscheme", "per_channel"));
  CHECK(contains(m, "quantization_config.layer_quant_config['*v_proj']: differs from global_quant_config"));
  CHECK(contains(m, "one scheme for all linear layers"));
  CHECK(contains(
      unsupported(with(kQuarkFp8Kv, "/layer_quant_config/*v_proj/output_tensors/qscheme", "per_channel")),
      "layer_quant_config['*v_proj'].output_tensors"));
  CHECK(contains(invalid(with(kQuarkFp8Kv, "/layer_quant_config/*k_proj/output_tensors", nullptr)),
                 "layer_quant_config['*k_proj'].output_tensors: is null"));
  CHECK(contains(invalid(with(kQuarkFp8Kv, "/layer_quant_config", json::object())), "export.kv_cache_group"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, "/layer_quant_config/*down_proj",
                                  kQuarkFp8Kv["layer_quant_config"]["*k_proj"])),
                 "layer_quant_config['*down_proj'].output_tensors"));
  CHECK(contains(unsupported(with(kQuarkFp8Kv, "/export/weight_format", "fake_quantized")),
                 "export.weight_format: 'fake_quantized'"));
  json no_export = kQuarkFp8Kv;
  no_export.erase("export");
  CHECK(contains(invalid(no_export), "quantization_config.export: is missing"));
  CHECK(contains(
      unsupported(with(kQuarkFp8Kv, "/algo_config",
                       json::array({{{"name", "rotation"},
                                     {"online_config", {{"online_rotation_layers", {"down_proj"}}}}}}))),
      "quantization_config.algo_config: online rotations"));
  CHECK(parsed(with(kQuarkFp8Kv, "/algo_config", json::array({{{"name", "autosmoothquant"}}})))
            .kv_cache_scales);
}

TEST_CASE("quant config: fp8 configs, KV scales and block scales", "[quant_config][fp8]") {
  const QuantConfig a = parsed(kFp8AmdKv);
  check_scheme(a, "fp8", ScaleGranularity::tensor, ActivationScheme::static_tensor, true);
  CHECK(a.ignored("lm_head"));
  CHECK(a.require_tensor_or_channel_scales().ok());

  const QuantConfig b = parsed(kFp8Blocks);
  CHECK(b.linear == LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::block, 128, 128,
                                ActivationScheme::dynamic_token});
  CHECK(b.weight_scale_suffix == "weight_scale_inv");
  CHECK_FALSE(b.kv_cache_scales);
  CHECK(b.describe() ==
        "fp8 fp8_e4m3 W8A8 (weights per 128x128 block, activations dynamic per token group of 128)");
  const absl::Status st = b.require_tensor_or_channel_scales();
  CHECK(st.code() == absl::StatusCode::kUnimplemented);
  const std::string m(st.message());
  CHECK(contains(
      m, "/m/config.json: quantization_config.weight_block_size: [128, 128]: block-wise FP8 weight scales"));
  CHECK(contains(m, "weight_scale_inv"));

  // Qwen's FP8 exports list modules_to_not_convert (containers and norms included).
  const QuantConfig q = parsed(with(kFp8Blocks, "/modules_to_not_convert",
                                    {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"}));
  CHECK(q.ignored("lm_head"));
  CHECK(q.ignored("model.layers.0.mlp.gate"));
  CHECK_FALSE(q.ignored("model.layers.0.mlp.gate_proj"));
  // ignored_layers and modules_to_not_convert both count.
  CHECK(parsed(with(kFp8AmdKv, "/modules_to_not_convert", {"model.layers.1.mlp.down_proj"}))
            .ignored("model.layers.1.mlp.down_proj"));
}

TEST_CASE("quant config: fp8 refusals and other methods", "[quant_config][fp8]") {
  json no_scheme = kFp8AmdKv;
  no_scheme.erase("activation_scheme");
  CHECK(contains(invalid(no_scheme), "quantization_config.activation_scheme: is missing"));
  CHECK(contains(invalid(with(kFp8AmdKv, "/activation_scheme", "per_token")),
                 "activation_scheme: 'per_token' is not 'static' or 'dynamic'"));
  CHECK(contains(unsupported(with(kFp8Blocks, "/fmt", "e5m2")), "quantization_config.fmt: 'e5m2'"));
  CHECK(contains(invalid(with(kFp8Blocks, "/weight_block_size", {128})),
                 "quantization_config.weight_block_size"));
  CHECK(contains(invalid(with(kFp8Blocks, "/weight_block_size", {128, 0})), "weight_block_size"));
  CHECK(contains(invalid(with(kFp8Blocks, "/activation_scheme", "static")),
                 "weight_block_size: needs activation_scheme 'dynamic'"));
  CHECK(contains(unsupported(with(kFp8AmdKv, "/kv_cache_scheme", "dynamic")),
                 "quantization_config.kv_cache_scheme"));
  for (const char* method : {"gptq", "awq", "bitsandbytes", "fbgemm_fp8", "something-new"}) {
    const std::string e = unsupported({{"quant_method", method}, {"bits", 4}});
    CHECK(contains(e, std::string("quantization_config.quant_method: '") + method + "' is not supported"));
  }
  CHECK(contains(invalid(json{{"bits", 4}}), "quantization_config.quant_method: is missing"));
}

TEST_CASE("quant config: ignore entries match by name, suffix, re: and glob", "[quant_config][ignore]") {
  json j = kCtDynamic;
  j["ignore"] = {"lm_head",
                 "model.layers.0.mlp.down_proj",
                 "re:.*layers\\.1\\.self_attn\\.o_proj$",
                 "re:model\\.layers\\.2\\.",
                 "*layers.3.*_proj",
                 "model.layers.[45].mlp.up_proj",
                 "model.layers.6.mlp.?ate_proj"};
  const QuantConfig q = parsed(j);
  CHECK(q.ignored("lm_head"));
  CHECK(q.ignored("model.lm_head"));         // the entry names the last components
  CHECK_FALSE(q.ignored("model.xlm_head"));  // but only at a dot boundary
  CHECK(q.ignored("model.layers.0.mlp.down_proj"));
  CHECK_FALSE(q.ignored("model.layers.10.mlp.down_proj"));
  CHECK(q.ignored("model.layers.1.self_attn.o_proj"));
  CHECK_FALSE(q.ignored("model.layers.11.self_attn.o_proj"));
  CHECK(q.ignored("model.layers.2.mlp.up_proj"));  // re: matches from the start, as Python's re.match
  CHECK_FALSE(q.ignored("x.model.layers.2.mlp.up_proj"));
  CHECK(q.ignored("model.layers.3.self_attn.q_proj"));  // globs: '*' crosses dots
  CHECK_FALSE(q.ignored("model.layers.3.input_layernorm"));
  CHECK(q.ignored("model.layers.4.mlp.up_proj"));
  CHECK(q.ignored("model.layers.5.mlp.up_proj"));
  CHECK_FALSE(q.ignored("model.layers.7.mlp.up_proj"));
  CHECK(q.ignored("model.layers.6.mlp.gate_proj"));

  CHECK(glob_match("*k_proj", "model.layers.0.self_attn.k_proj"));
  CHECK(glob_match("*k_proj", "*k_proj"));
  CHECK_FALSE(glob_match("*k_proj", "model.layers.0.self_attn.k_proj.weight"));
  CHECK(glob_match("a[!b]c", "axc"));
  CHECK_FALSE(glob_match("a[!b]c", "abc"));
  CHECK(glob_match("a[a-c]?", "abz"));
  CHECK(glob_match("a[", "a["));  // an unterminated class is a literal '['
  CHECK(glob_match("**", ""));
  CHECK_FALSE(glob_match("?", ""));

  // Targets: a module no target matches is left unquantized.
  const QuantConfig t =
      parsed(with(kCtDynamic, "/config_groups/group_0/targets", {"re:.*self_attn\\.(q|k|v|o)_proj$"}));
  CHECK_FALSE(t.ignored("model.layers.0.self_attn.k_proj"));
  CHECK(t.ignored("model.layers.0.mlp.down_proj"));
  // A field set by hand after parsing is honoured.
  QuantConfig h = parsed(kCtDynamic);
  h.ignore.push_back("re:.*down_proj");
  CHECK(h.ignored("model.layers.9.mlp.down_proj"));
  // A regex that does not compile is an error naming its entry.
  CHECK(contains(invalid(with(kCtDynamic, "/ignore", {"lm_head", "re:(unclosed"})),
                 "quantization_config.ignore[1]: 're:(unclosed' is not a valid regular expression"));
  CHECK(contains(invalid(with(kQuarkFp8Kv, "/exclude", {"re:[z-a]"})), "quantization_config.exclude[0]"));
}

TEST_CASE("quant config: fused shards are all quantized or all not", "[quant_config][ignore]") {
  QuantConfig q = parsed(with(kCtDynamic, "/ignore", {"lm_head", "model.layers.3.self_attn.k_proj"}));
  absl::Status st = q.check_fused_shards(4);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  const std::string m(st.message());
  CHECK(contains(m, "/m/config.json"));
  CHECK(contains(m,
                 "model.layers.3.self_attn.k_proj unquantized but quantizes model.layers.3.self_attn.q_proj, "
                 "model.layers.3.self_attn.v_proj"));
  CHECK(q.check_fused_shards(3).ok());  // layer 3 is not there
  q = parsed(with(kCtDynamic, "/ignore", {"re:model\\.layers\\.0\\.mlp\\.(gate|up)_proj$"}));
  CHECK(q.check_fused_shards(2).ok());
  q = parsed(with(kCtDynamic, "/ignore", {"model.layers.1.mlp.up_proj"}));
  CHECK(contains(std::string(q.check_fused_shards(2).message()), "model.layers.1.mlp.up_proj unquantized"));
}

TEST_CASE("quant config: wrong JSON types are errors naming the key, never exceptions",
          "[quant_config][errors]") {
  const std::string g = "/config_groups/group_0";
  const std::vector<std::pair<json, std::string>> cases = {
      {"fp8", "quantization_config: \"fp8\" is not an object"},
      {with(kCtDynamic, "/quant_method", 7), "quantization_config.quant_method: 7 is not a string"},
      {with(kCtDynamic, g + "/weights/num_bits", "8"), "group_0.weights.num_bits: \"8\" is not an integer"},
      {with(kCtDynamic, g + "/weights/num_bits", 8.5), "group_0.weights.num_bits: 8.5 is not an integer"},
      {with(kCtDynamic, g + "/weights/symmetric", "yes"), "group_0.weights.symmetric"},
      {with(kCtDynamic, g + "/weights/strategy", "rowwise"), "group_0.weights.strategy: 'rowwise'"},
      {with(kCtDynamic, g + "/weights", "fp8"), "group_0.weights: \"fp8\" is not an object"},
      {with(kCtDynamic, g + "/targets", "Linear"), "group_0.targets: \"Linear\" is not a list of names"},
      {with(kCtDynamic, g, 3), "config_groups.group_0: 3 is not an object"},
      {with(kCtDynamic, "/config_groups", {1, 2}),
       "quantization_config.config_groups: [1,2] is not an object"},
      {with(kCtDynamic, "/ignore", "lm_head"),
       "quantization_config.ignore: \"lm_head\" is not a list of names"},
      {with(kCtDynamic, "/ignore", {"lm_head", nullptr}),
       "quantization_config.ignore[1]: null is not a string"},
      {with(kCtDynamic, "/kv_cache_scheme", "static"), "quantization_config.kv_cache_scheme"},
      {with(kQuarkFp8Kv, "/global_quant_config/weight", 5), "global_quant_config.weight: 5 is not an object"},
      {with(kQuarkFp8Kv, "/global_quant_config/weight/dtype", {"fp8"}),
       "weight.dtype: [\"fp8\"] is not a string"},
      {with(kQuarkFp8Kv, "/global_quant_config/weight/is_dynamic", 0),
       "weight.is_dynamic: 0 is not true or false"},
      {with(kQuarkFp8Kv, "/layer_quant_config", {1}),
       "quantization_config.layer_quant_config: [1] is not an object"},
      {with(kQuarkFp8Kv, "/layer_quant_config/*k_proj", "x"),
       "layer_quant_config['*k_proj']: \"x\" is not an object"},
      {with(kQuarkFp8Kv, "/export/kv_cache_group", "*k_proj"), "export.kv_cache_group"},
      {with(kQuarkFp8Kv, "/algo_config", {{{"name", 3}}}), "quantization_config.algo_config.name"},
      {with(kFp8Blocks, "/weight_block_size", "128"), "quantization_config.weight_block_size"},
      {with(kFp8Blocks, "/weight_block_size", {uint64_t(1) << 63, 128}),
       "quantization_config.weight_block_size"},
      {with(kFp8AmdKv, "/ignored_layers", {{"lm_head"}}), "quantization_config.ignored_layers[0]"},
  };
  for (const auto& [qc, part] : cases) {
    INFO(part);
    CHECK(contains(invalid(qc), part));
  }
}

TEST_CASE("quant config: any value of any type at any key of the real configs parses or errs, never throws",
          "[quant_config][errors]") {
  std::vector<json> values = {nullptr, true, -1, 4, 1.5, "x", "fp8_e4m3", json::array(), json::object()};
  values.push_back(json::array({1, "a"}));
  values.push_back(json{{"k", 1}});
  int errors = 0;
  for (const json& config : {kCtDynamic, kCtStaticDoc, kCtStaticKv, kQuarkFp8Kv, kFp8AmdKv, kFp8Blocks}) {
    std::set<std::string> pointers;  // every leaf and every object or list above one
    const json flat = config.flatten();
    for (const auto& [leaf, value] : flat.items()) {
      for (json::json_pointer p(leaf); !p.empty(); p = p.parent_pointer()) pointers.insert(p.to_string());
    }
    for (const std::string& pointer : pointers) {
      for (const json& v : values) {
        absl::StatusOr<std::optional<QuantConfig>> r = absl::InternalError("not run");
        INFO(pointer << " = " << v.dump());
        REQUIRE_NOTHROW(r = parse(with(config, pointer, v)));
        if (r.ok()) continue;
        ++errors;
        const std::string m(r.status().message());
        CHECK(contains(m, kSource + ": quantization_config"));
        CHECK_FALSE(contains(m, "unexpected JSON"));  // the checks caught it, not the last-resort catch
        CHECK((r.status().code() == absl::StatusCode::kInvalidArgument ||
               r.status().code() == absl::StatusCode::kUnimplemented));
      }
    }
  }
  CHECK(errors > 100);
}
