// FP8 checkpoints with a quantization_config (src/loading/checkpoint.h): tiny checkpoints
// in the compressed-tensors, Quark and fp8 layouts load their projections in HostLinear's
// FP8 form (codes as stored, one scale per output row, each fused shard its own, the
// activation scheme, the largest input_scale), the checks name the file and tensor, and an
// FP8 checkpoint without a quantization_config still loads dequantized to bf16.
#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "kernels/common/fp8.h"
#include "src/loading/checkpoint_fp8.h"
#include "tests/util/checkpoint_fp8_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

// compressed-tensors static: per-tensor weights and per-tensor static input scales.
const json kCtStatic = json::parse(R"({
  "config_groups": {"group_0": {
    "input_activations": {"num_bits": 8, "strategy": "tensor", "type": "float"},
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "strategy": "tensor", "type": "float"}}},
  "format": "naive-quantized", "ignore": ["lm_head"],
  "quant_method": "compressed-tensors", "quantization_status": "frozen"})");

// Quark FP8 with KV scales on the K and V projections' outputs (and q_proj's, which vLLM
// and kvfuse drop), lm_head excluded.
const json kQuark = [] {
  const json fp8 = {
      {"dtype", "fp8_e4m3"}, {"is_dynamic", false}, {"qscheme", "per_tensor"}, {"symmetric", true}};
  const json with_out = {{"weight", fp8}, {"input_tensors", fp8}, {"output_tensors", fp8}, {"bias", nullptr}};
  return json{{"quant_method", "quark"},
              {"exclude", {"lm_head"}},
              {"export", {{"kv_cache_group", {"*k_proj", "*v_proj"}}, {"weight_format", "real_quantized"}}},
              {"global_quant_config",
               {{"weight", fp8}, {"input_tensors", fp8}, {"output_tensors", nullptr}, {"bias", nullptr}}},
              {"layer_quant_config", {{"*k_proj", with_out}, {"*v_proj", with_out}, {"*q_proj", with_out}}}};
}();

std::unique_ptr<Checkpoint> open_ok(const std::string& dir) {
  auto c = Checkpoint::open(dir);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

HostLayerWeights load_layer(const Checkpoint& c, int32_t l) {
  HostLayerWeights L;
  const absl::Status st = c.weights()->layer(l, L);
  INFO(st.ToString());
  REQUIRE(st.ok());
  return L;
}

// The shards' codes and row scales concatenated in order: the fused FP8 form.
Fp8Shard fused(const std::map<std::string, Fp8Shard>& shards, int32_t l,
               const std::vector<std::string>& names) {
  Fp8Shard out;
  for (const std::string& n : names) {
    const Fp8Shard& s = shards.at("model.layers." + std::to_string(l) + "." + n);
    out.codes.insert(out.codes.end(), s.codes.begin(), s.codes.end());
    out.row_scales.insert(out.row_scales.end(), s.row_scales.begin(), s.row_scales.end());
  }
  return out;
}

const std::vector<std::string> kQkv = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"};
const std::vector<std::string> kGateUp = {"mlp.gate_proj.weight", "mlp.up_proj.weight"};

// The message of an FP8 checkpoint that opens but fails to load layer `l`.
std::string layer_error(const std::string& dir, int32_t l) {
  auto c = open_ok(dir);
  HostLayerWeights L;
  const absl::Status st = c->weights()->layer(l, L);
  REQUIRE_FALSE(st.ok());
  return std::string(st.message());
}

const ModelSpec& tiny() {
  static const ModelSpec s = *model_preset("tiny");
  return s;
}
const std::string kUp1 = "model.layers.1.mlp.up_proj.weight";
const std::string kO0 = "model.layers.0.self_attn.o_proj.weight";

}  // namespace

TEST_CASE("fp8 checkpoint: compressed-tensors per-channel, dynamic per token, loads as FP8 codes and scales",
          "[checkpoint][fp8]") {
  TempDir dir;
  const auto shards = write_fp8(dir.path(), tiny(), {});
  auto c = open_ok(dir.path());
  REQUIRE(c->spec().quant.has_value());
  CHECK(c->spec().quant->method == "compressed-tensors");
  CHECK_FALSE(c->kv_scales().has_value());
  const ModelSpec& s = tiny();
  for (int32_t l = 0; l < s.num_layers; ++l) {
    CAPTURE(l);
    const HostLayerWeights L = load_layer(*c, l);
    const Fp8Shard qkv = fused(shards, l, kQkv), gu = fused(shards, l, kGateUp);
    CHECK(L.qkv.w.empty());
    CHECK(L.qkv.fp8());
    CHECK(L.qkv.w_fp8.size() == size_t(s.qkv_dim() * s.hidden));
    CHECK((L.qkv.w_fp8 == qkv.codes));
    CHECK(L.qkv.w_scale.size() == size_t(s.qkv_dim()));
    CHECK((L.qkv.w_scale == qkv.row_scales));
    CHECK(L.qkv.act == Fp8Act::dynamic_token);
    CHECK(L.qkv.input_scale == 0.0f);
    CHECK((L.gate_up.w_fp8 == gu.codes));
    CHECK((L.gate_up.w_scale == gu.row_scales));
    CHECK((L.o.w_fp8 == fused(shards, l, {"self_attn.o_proj.weight"}).codes));
    CHECK((L.down.w_scale == fused(shards, l, {"mlp.down_proj.weight"}).row_scales));
    CHECK(L.down.act == Fp8Act::dynamic_token);
    CHECK(L.attn_norm.size() == size_t(s.hidden));
  }
  // lm_head (ignored), the embeddings and the norms stay bf16, as exported.
  auto syn = make_synthetic_weights(s, 11);
  HostGlobalWeights gs, gl;
  REQUIRE(syn->globals(gs).ok());
  REQUIRE(c->weights()->globals(gl).ok());
  CHECK_FALSE(gl.lm_head.fp8());
  CHECK((gl.lm_head.w == gs.lm_head.w));
  CHECK((gl.embed == gs.embed));
}

TEST_CASE(
    "fp8 checkpoint: per-tensor weights with static input scales keep each shard's scale, the largest "
    "input scale",
    "[checkpoint][fp8]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant = kCtStatic;
  layout.per_channel = false;
  const std::map<std::string, float> in = {{"q_proj", 0.5f},   {"k_proj", 0.75f},   {"v_proj", 0.25f},
                                           {"o_proj", 2.0f},   {"gate_proj", 0.1f}, {"up_proj", 0.3f},
                                           {"down_proj", 4.0f}};
  layout.input_scale = [&](const std::string& w) {
    for (const auto& [proj, x] : in)
      if (w.ends_with(proj + ".weight")) return x * (w.starts_with("model.layers.1.") ? 2.0f : 1.0f);
    FAIL("no input scale for " << w);
    return 0.0f;
  };
  // The synthetic weights' largest magnitudes are alike: make the shards' scales differ.
  layout.scale_mult = [](const std::string& w) {
    return w.ends_with("k_proj.weight") ? 2.0f : w.ends_with("v_proj.weight") ? 4.0f : 1.0f;
  };
  const auto shards = write_fp8(dir.path(), tiny(), layout);
  auto c = open_ok(dir.path());
  const ModelSpec& s = tiny();
  for (int32_t l : {0, 1}) {
    CAPTURE(l);
    const float m = l == 1 ? 2.0f : 1.0f;
    const HostLayerWeights L = load_layer(*c, l);
    const Fp8Shard qkv = fused(shards, l, kQkv);
    // One scale per shard, expanded to its rows: q's for the first q_dim rows, then k's, v's.
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const float sq = shards.at(p + kQkv[0]).row_scales[0], sk = shards.at(p + kQkv[1]).row_scales[0],
                sv = shards.at(p + kQkv[2]).row_scales[0];
    CHECK(sq != sk);
    CHECK(sk != sv);
    CHECK(L.qkv.w_scale[0] == sq);
    CHECK(L.qkv.w_scale[size_t(s.q_dim())] == sk);
    CHECK(L.qkv.w_scale[size_t(s.q_dim() + s.kv_dim())] == sv);
    CHECK((L.qkv.w_scale == qkv.row_scales));
    CHECK((L.qkv.w_fp8 == qkv.codes));
    CHECK(L.qkv.act == Fp8Act::static_tensor);
    CHECK(L.qkv.input_scale == 0.75f * m);     // max(q 0.5, k 0.75, v 0.25)
    CHECK(L.gate_up.input_scale == 0.3f * m);  // max(gate 0.1, up 0.3)
    CHECK(L.o.input_scale == 2.0f * m);
    CHECK(L.down.input_scale == 4.0f * m);
    CHECK((L.gate_up.w_scale == fused(shards, l, kGateUp).row_scales));
  }
}

TEST_CASE("fp8 checkpoint: Quark per-tensor with lm_head excluded loads its k/v_proj.output_scale KV scales",
          "[checkpoint][fp8][scales]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant = kQuark;
  layout.per_channel = false;
  layout.tensor_scale_shape = {};  // Quark writes scalars
  layout.input_scale = [](const std::string&) { return 0.125f; };
  const auto shards = write_fp8(dir.path(), tiny(), layout);
  const ModelSpec& s = tiny();
  rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
    for (int l = 0; l < s.num_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
      all.push_back(f32_scalar(p + "k_proj.output_scale", 0.5f + float(l)));
      all.push_back(f32_scalar(p + "v_proj.output_scale", 2.0f + float(l)));
      all.push_back(f32_scalar(p + "q_proj.output_scale", 3.0f));  // vLLM's q_scale: unused
    }
  });
  auto c = open_ok(dir.path());
  REQUIRE(c->spec().quant.has_value());
  CHECK(c->spec().quant->method == "quark");
  CHECK(c->spec().quant->kv_cache_scales);
  REQUIRE(c->kv_scales().has_value());
  CHECK(c->kv_scales()->k == std::vector<float>{0.5f, 1.5f, 2.5f, 3.5f});
  CHECK(c->kv_scales()->v == std::vector<float>{2.0f, 3.0f, 4.0f, 5.0f});
  const HostLayerWeights L = load_layer(*c, 2);
  CHECK((L.qkv.w_fp8 == fused(shards, 2, kQkv).codes));
  CHECK((L.qkv.w_scale == fused(shards, 2, kQkv).row_scales));
  CHECK(L.qkv.act == Fp8Act::static_tensor);
  CHECK(L.qkv.input_scale == 0.125f);
  HostGlobalWeights g;
  REQUIRE(c->weights()->globals(g).ok());
  CHECK_FALSE(g.lm_head.fp8());
  CHECK(g.lm_head.w.size() == size_t(s.vocab) * size_t(s.hidden));
}

TEST_CASE("fp8 checkpoint: activation schemes map to Fp8Act, dynamic per tensor served per token",
          "[checkpoint][fp8]") {
  CHECK(fp8_act(ActivationScheme::none) == Fp8Act::none);
  CHECK(fp8_act(ActivationScheme::static_tensor) == Fp8Act::static_tensor);
  CHECK(fp8_act(ActivationScheme::dynamic_token) == Fp8Act::dynamic_token);
  CHECK(fp8_act(ActivationScheme::dynamic_tensor) == Fp8Act::dynamic_token);
  struct Case {
    const char* what;
    json quant;
    bool input_scales;
    Fp8Act act;
  };
  json ct_dyn_tensor = kCtDynamic;
  ct_dyn_tensor["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor";
  json ct_w8a16 = kCtDynamic;
  ct_w8a16["config_groups"]["group_0"]["input_activations"] = nullptr;
  const json fp8_dynamic = {
      {"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"ignored_layers", {"lm_head"}}};
  const json fp8_static = {
      {"quant_method", "fp8"}, {"activation_scheme", "static"}, {"ignored_layers", {"lm_head"}}};
  for (const Case& k :
       {Case{"compressed-tensors dynamic per tensor", ct_dyn_tensor, false, Fp8Act::dynamic_token},
        Case{"compressed-tensors W8A16", ct_w8a16, false, Fp8Act::none},
        Case{"fp8 dynamic, input_scale tolerated", fp8_dynamic, true, Fp8Act::dynamic_token},
        Case{"fp8 static (AutoFP8)", fp8_static, true, Fp8Act::static_tensor}}) {
    CAPTURE(k.what);
    TempDir dir;
    Fp8Layout layout;
    layout.quant = k.quant;
    layout.per_channel = k.quant.value("quant_method", "") != "fp8";
    if (k.input_scales) layout.input_scale = [](const std::string&) { return 0.0625f; };
    write_fp8(dir.path(), tiny(), layout);
    auto c = open_ok(dir.path());
    const HostLayerWeights L = load_layer(*c, 0);
    CHECK(L.qkv.fp8());
    CHECK(L.qkv.act == k.act);
    CHECK(L.down.act == k.act);
    CHECK(L.qkv.input_scale == (k.act == Fp8Act::static_tensor ? 0.0625f : 0.0f));
  }
}

TEST_CASE("fp8 checkpoint: an ignored projection loads as bf16 beside FP8 ones", "[checkpoint][fp8]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant = kCtDynamic;
  layout.quant["ignore"] = {"lm_head", "re:.*mlp\\.down_proj$"};
  layout.fp8 = [](const std::string& w) { return !w.ends_with("down_proj.weight"); };
  write_fp8(dir.path(), tiny(), layout);
  auto c = open_ok(dir.path());
  auto syn = make_synthetic_weights(tiny(), 11);
  HostLayerWeights ls;
  REQUIRE(syn->layer(1, ls).ok());
  const HostLayerWeights L = load_layer(*c, 1);
  CHECK(L.qkv.fp8());
  CHECK_FALSE(L.down.fp8());
  CHECK(L.down.w_scale.empty());
  CHECK((L.down.w == ls.down.w));
}

TEST_CASE("fp8 checkpoint: fp8 weight_block_size (block-wise scales) is refused naming it",
          "[checkpoint][fp8][errors]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant = {{"quant_method", "fp8"},
                  {"activation_scheme", "dynamic"},
                  {"fmt", "e4m3"},
                  {"weight_block_size", {128, 128}}};
  layout.fp8 = [](const std::string&) { return false; };
  write_fp8(dir.path(), tiny(), layout);
  auto c = Checkpoint::open(dir.path());
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kUnimplemented);
  const std::string e(c.status().message());
  CAPTURE(e);
  CHECK(contains(e, "config.json"));
  CHECK(contains(e, "weight_block_size"));
}

TEST_CASE("fp8 checkpoint errors: a missing weight_scale names the weight and the scale",
          "[checkpoint][fp8][errors]") {
  TempDir dir;
  write_fp8(dir.path(), tiny(), {});
  rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
    std::erase_if(all,
                  [](const StWriteTensor& t) { return t.name == "model.layers.1.mlp.up_proj.weight_scale"; });
  });
  const std::string e = open_error(dir.path());
  CAPTURE(e);
  CHECK(contains(e, "model.safetensors: tensor '" + kUp1 + "'"));
  CHECK(contains(e, "'model.layers.1.mlp.up_proj.weight_scale' is missing"));
}

TEST_CASE("fp8 checkpoint errors: a weight scale of the wrong shape names the scale",
          "[checkpoint][fp8][errors]") {
  TempDir dir;
  write_fp8(dir.path(), tiny(), {});
  const std::string sc = "model.layers.1.mlp.up_proj.weight_scale";
  rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
    *tensor_named(all, sc) = {sc, StDtype::F32, {2}, bytes_of(std::vector<float>{1.0f, 1.0f})};
  });
  const std::string e = open_error(dir.path());
  CAPTURE(e);
  CHECK(contains(e, "tensor '" + sc + "' has shape [2]"));
  CHECK(contains(e, "[768, 1]"));
}

TEST_CASE("fp8 checkpoint errors: a weight scale <= 0 or NaN names the scale and the element",
          "[checkpoint][fp8][errors]") {
  const std::string sc = "model.layers.1.mlp.up_proj.weight_scale";
  for (float bad : {0.0f, -0.5f, std::nanf(""), INFINITY}) {
    CAPTURE(bad);
    TempDir dir;
    write_fp8(dir.path(), tiny(), {});
    rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
      std::memcpy(tensor_named(all, sc)->bytes.data() + 4 * 5, &bad, 4);
    });
    const std::string e = open_error(dir.path());
    CAPTURE(e);
    CHECK(contains(e, "tensor '" + sc + "' holds"));
    CHECK(contains(e, " at 5; scales must be finite and > 0"));
  }
}

TEST_CASE("fp8 checkpoint errors: static activations need every input_scale, one finite value > 0",
          "[checkpoint][fp8][errors]") {
  Fp8Layout layout;
  layout.quant = kCtStatic;
  layout.per_channel = false;
  layout.input_scale = [](const std::string&) { return 0.5f; };
  const std::string in = "model.layers.0.self_attn.k_proj.input_scale";
  {
    TempDir dir;
    write_fp8(dir.path(), tiny(), layout);
    rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
      std::erase_if(all, [&](const StWriteTensor& t) { return t.name == in; });
    });
    const std::string e = open_error(dir.path());
    CAPTURE(e);
    CHECK(contains(e, "tensor 'model.layers.0.self_attn.k_proj.weight' needs the activation scale '" + in +
                          "', which is missing"));
  }
  for (float bad : {0.0f, std::nanf("")}) {
    CAPTURE(bad);
    TempDir dir;
    write_fp8(dir.path(), tiny(), layout);
    rewrite_tensors(dir / "model.safetensors",
                    [&](std::vector<StWriteTensor>& all) { *tensor_named(all, in) = f32_scalar(in, bad); });
    const std::string e = open_error(dir.path());
    CAPTURE(e);
    CHECK(contains(e, "tensor '" + in + "' is "));
    CHECK(contains(e, "finite and > 0"));
  }
  {
    TempDir dir;  // one value per tensor
    write_fp8(dir.path(), tiny(), layout);
    rewrite_tensors(dir / "model.safetensors", [&](std::vector<StWriteTensor>& all) {
      *tensor_named(all, in) = {in, StDtype::F32, {2}, bytes_of(std::vector<float>{1.0f, 1.0f})};
    });
    CHECK(contains(open_error(dir.path()), "tensor '" + in + "' has shape [2]; an input_scale is one value"));
  }
}

TEST_CASE("fp8 checkpoint errors: a NaN weight code names the tensor and the element",
          "[checkpoint][fp8][errors]") {
  for (uint8_t nan : {uint8_t(0x7f), uint8_t(0xff)}) {
    CAPTURE(int(nan));
    TempDir dir;
    write_fp8(dir.path(), tiny(), {});
    rewrite_tensors(dir / "model.safetensors",
                    [&](std::vector<StWriteTensor>& all) { tensor_named(all, kUp1)->bytes[37] = nan; });
    const std::string e = layer_error(dir.path(), 1);
    CAPTURE(e);
    CHECK(contains(e, "model.safetensors: tensor '" + kUp1 + "' holds a non-finite value"));
    CHECK(contains(e, "at element 37"));
  }
}

TEST_CASE("fp8 checkpoint errors: a projection stored otherwise than the config says names it",
          "[checkpoint][fp8][errors]") {
  struct Case {
    const char* stored;  // o_proj of layer 0 as written
    Fp8Layout layout;
    const char* says;
  };
  Case bf16{"BF16", {}, "quantizes model.layers.0.self_attn.o_proj, so it must be F8_E4M3"};
  bf16.layout.fp8 = [](const std::string& w) { return w != kO0; };
  Case fp8{"F8_E4M3", {}, "leaves model.layers.0.self_attn.o_proj unquantized"};
  fp8.layout.quant["ignore"] = {"lm_head", "model.layers.0.self_attn.o_proj"};
  for (const Case* c : {&bf16, &fp8}) {
    CAPTURE(c->stored);
    TempDir dir;
    write_fp8(dir.path(), tiny(), c->layout);
    const std::string e = open_error(dir.path());
    CAPTURE(e);
    CHECK(contains(e, "tensor '" + kO0 + "' has dtype " + c->stored));
    CHECK(contains(e, c->says));
  }
}

TEST_CASE("fp8 checkpoint errors: a config that ignores some shards of a fused projection names them",
          "[checkpoint][fp8][errors]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant["ignore"] = {"lm_head", "model.layers.2.mlp.up_proj"};
  layout.fp8 = [](const std::string& w) { return w != "model.layers.2.mlp.up_proj.weight"; };
  write_fp8(dir.path(), tiny(), layout);
  auto c = Checkpoint::open(dir.path());
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string e(c.status().message());
  CAPTURE(e);
  CHECK(contains(e, "config.json"));
  CHECK(contains(e,
                 "leaves model.layers.2.mlp.up_proj unquantized but quantizes model.layers.2.mlp.gate_proj"));
}

TEST_CASE("fp8 checkpoint: without a quantization_config, FP8 weights are dequantized to bf16",
          "[checkpoint][fp8]") {
  TempDir dir;
  Fp8Layout layout;
  layout.quant = nullptr;
  layout.input_scale = [](const std::string&) { return 0.5f; };  // ignored
  const auto shards = write_fp8(dir.path(), tiny(), layout);
  auto c = open_ok(dir.path());
  CHECK_FALSE(c->spec().quant.has_value());
  const HostLayerWeights L = load_layer(*c, 1);
  CHECK_FALSE(L.qkv.fp8());
  CHECK_FALSE(L.gate_up.fp8());
  const Fp8Shard gu = fused(shards, 1, kGateUp);
  const int64_t k = tiny().hidden;
  REQUIRE(L.gate_up.w.size() == gu.codes.size());
  for (size_t i = 0; i < gu.codes.size(); ++i) {
    const bf16_t want =
        f32_to_bf16(fp8_decode(gu.codes[i], Fp8Format::e4m3fn) * gu.row_scales[i / size_t(k)]);
    if (L.gate_up.w[i] != want) {
      FAIL("element " << i << ": " << L.gate_up.w[i] << " != " << want);
    }
  }
}
