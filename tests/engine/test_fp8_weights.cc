// FP8 weights on the CPU backend, end to end: the <preset>-fp8 models (synthetic FP8
// codes, a scale per output channel, activations quantized per token at run time, the
// lm_head in bf16) load, keep their projections in FP8, compute close to the bf16 model
// they quantize, and keep the engine's guarantees: a row's bits do not depend on the
// batch it runs in, and a run is reproducible; FP8 checkpoints (compressed-tensors, Quark)
// are served from their FP8 codes. The kernels' arithmetic is
// tests/kernels/test_cpu_gemm_fp8.cc's; the sharded model is tests/parallel/
// test_tensor_parallel.cc's.
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "kernels/cpu/gemm/gemm_fp8.h"
#include "src/loading/host_weights.h"
#include "src/loading/model_spec.h"
#include "tests/util/catch.h"
#include "tests/util/checkpoint_fp8_util.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/forwarding_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using Catch::Matchers::ContainsSubstring;

namespace {

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += double(a[i]) * b[i];
    aa += double(a[i]) * a[i];
    bb += double(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

}  // namespace

TEST_CASE("fp8 weights: every preset has an -fp8 form, W8A8 with dynamic per-token activations", "[fp8]") {
  for (const char* base : {"tiny", "llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b", "hybrid-swa"}) {
    auto bf16 = model_preset(base);
    auto fp8 = model_preset(std::string(base) + "-fp8");
    REQUIRE(bf16.ok());
    REQUIRE(fp8.ok());
    CHECK(fp8->name == std::string(base) + "-fp8");
    CHECK(fp8->hidden == bf16->hidden);
    CHECK(fp8->num_layers == bf16->num_layers);
    CHECK_FALSE(bf16->quant.has_value());
    REQUIRE(fp8->quant.has_value());
    CHECK(fp8->quant->linear.format == WeightQuantFormat::fp8_e4m3);
    CHECK(fp8->quant->linear.activation == ActivationScheme::dynamic_token);
    CHECK(fp8->quant->ignored("lm_head"));
    CHECK_FALSE(fp8->quant->ignored("model.layers.0.self_attn.q_proj"));
  }
  // llama3-8b: 15.0 GiB of bf16 weights; with FP8 projections (1 byte a value and a
  // 4-byte scale per output row) and the embeddings and lm_head in bf16, 8.5 GiB.
  auto l8 = model_preset("llama3-8b");
  auto l8f = model_preset("llama3-8b-fp8");
  REQUIRE(l8.ok());
  REQUIRE(l8f.ok());
  CHECK(l8->weight_bytes() == 2 * l8->num_params());
  CHECK(l8->weight_format() == "bf16");
  const int64_t proj = 4096LL * 6144 + 4096LL * 4096 + 2 * 4096LL * 14336 + 14336LL * 4096;
  const int64_t rows = 6144 + 4096 + 2 * 14336 + 4096;
  CHECK(l8f->weight_bytes() == l8->weight_bytes() - 32 * (2 * proj - (proj + 4 * rows)));
  CHECK(double(l8f->weight_bytes()) / double(1 << 30) == Approx(8.46).margin(0.01));
  CHECK_THAT(l8f->weight_format(), ContainsSubstring("fp8_e4m3 W8A8 (weights per channel, activations dynamic per token)"));
  auto twice = model_preset("tiny-fp8-fp8");
  REQUIRE_FALSE(twice.ok());
  CHECK_THAT(std::string(twice.status().message()), ContainsSubstring("unknown preset 'tiny-fp8-fp8'"));
  CHECK_THAT(std::string(twice.status().message()), ContainsSubstring("<name>-fp8"));
}

TEST_CASE("fp8 weights (cpu): tiny-fp8 computes close to tiny, the bf16 model it quantizes", "[fp8][engine]") {
  auto bf16 = make_engine({{"model", "tiny"}});
  auto fp8 = make_engine({{"model", "tiny-fp8"}});
  const Run a = run_model(*bf16);
  const Run b = run_model(*fp8);
  REQUIRE(a.logits.size() == b.logits.size());
  double worst_cos = 1.0;
  bool any_differs = false;
  for (size_t i = 0; i < a.logits.size(); ++i) {
    worst_cos = std::min(worst_cos, cosine(a.logits[i], b.logits[i]));
    any_differs |= std::memcmp(a.logits[i].data(), b.logits[i].data(), a.logits[i].size() * sizeof(float)) != 0;
  }
  INFO("worst logits cosine " << worst_cos << " over " << a.logits.size() << " positions");
  // Per-channel e4m3 weights and per-token e4m3 activations: a few per cent of noise per
  // projection, well above 0.99 in cosine over four layers; a wrong scale or layout
  // (a transposed panel, a shard's scale on another shard) falls far below.
  CHECK(worst_cos > 0.99);
  CHECK(any_differs);  // the FP8 path ran: FP8 rounding changes the logits' bits
}

TEST_CASE("fp8 weights (cpu): a sequence's logits are the same bits alone and in a batch", "[fp8][engine]") {
  auto solo = make_engine({{"model", "tiny-fp8"}});
  const auto prompt = prompt_of(37, 2, 1024);
  const auto forced = prompt_of(12, 9, 1024);
  const auto alone = teacher_forced_logits(*solo, 1, prompt, forced);

  auto e = make_engine({{"model", "tiny-fp8"}});
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), forced.begin(), forced.end());
  REQUIRE(e->add_sequence(1, all, SamplingParams{}).ok());
  REQUIRE(e->add_sequence(2, prompt_of(50, 4, 1024), SamplingParams{}).ok());
  REQUIRE(e->add_sequence(3, prompt_of(21, 6, 1024), SamplingParams{}).ok());
  // Sequence 1 as teacher_forced_logits feeds it, beside two others that prefill and
  // decode in the same steps (other rows, other per-token activation scales).
  int32_t n1 = int32_t(prompt.size()), n2 = 50, n3 = 21;
  for (size_t i = 0; i < forced.size(); ++i) {
    auto r = e->step({StepItem{2, n2, true}, StepItem{1, n1, false, true}, StepItem{3, n3, true}});
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    REQUIRE((*r)[1].status.ok());
    const float* lg = e->last_logits().data() + size_t((*r)[1].logits_row) * 1024;
    INFO("position " << i);
    CHECK(std::memcmp(lg, alone[i].data(), 1024 * sizeof(float)) == 0);
    n1 = n2 = n3 = 1;
  }
  for (SeqId id : {1, 2, 3}) REQUIRE(e->release(id).ok());
}

TEST_CASE("fp8 weights (cpu): a run is reproducible", "[fp8][engine]") {
  auto a = make_engine({{"model", "tiny-fp8"}, {"seed", 5}});
  auto b = make_engine({{"model", "tiny-fp8"}, {"seed", 5}});
  const Run ra = run_model(*a);
  const Run rb = run_model(*b);
  CHECK(ra.greedy == rb.greedy);
  REQUIRE(ra.logits.size() == rb.logits.size());
  for (size_t i = 0; i < ra.logits.size(); ++i) {
    CHECK(std::memcmp(ra.logits[i].data(), rb.logits[i].data(), ra.logits[i].size() * sizeof(float)) == 0);
  }
}

namespace {

// tiny's weights as an FP8 checkpoint in `dir` (write_fp8's layout), and an engine on it.
std::unique_ptr<Engine> fp8_checkpoint_engine(const TempDir& dir, const Fp8Layout& layout) {
  auto spec = model_preset("tiny");
  REQUIRE(spec.ok());
  write_fp8(dir.path(), *spec, layout);
  return make_engine({{"model_path", dir.path()}});
}

// The compressed-tensors layout of a weight-only (W8A16) export.
nlohmann::json weight_only() {
  nlohmann::json q = kCtDynamic;
  q["config_groups"]["group_0"]["input_activations"] = nullptr;
  return q;
}

}  // namespace

TEST_CASE("fp8 checkpoint (cpu): W8A16 serves the same bits as its weights dequantized to bf16 at load",
          "[fp8][engine][checkpoint]") {
  // Power-of-two scales make every code times its scale exact in bf16: the FP8 GEMM's
  // fp32 weights are then the bf16 GEMM's, and so are all the bits after them. The same
  // files without a quantization_config load dequantized to bf16 (nothing there says how
  // to compute in FP8).
  TempDir fp8_dir, bf16_dir;
  Fp8Layout fp8, deq;
  fp8.quant = weight_only();
  deq.quant = nullptr;
  fp8.pow2_scales = deq.pow2_scales = true;
  auto a = fp8_checkpoint_engine(fp8_dir, fp8);
  auto b = fp8_checkpoint_engine(bf16_dir, deq);
  REQUIRE(a->spec().quant.has_value());
  CHECK_FALSE(b->spec().quant.has_value());
  const Run ra = run_model(*a);
  const Run rb = run_model(*b);
  CHECK(ra.greedy == rb.greedy);
  REQUIRE(ra.logits.size() == rb.logits.size());
  for (size_t i = 0; i < ra.logits.size(); ++i) {
    INFO("position " << i);
    CHECK(std::memcmp(ra.logits[i].data(), rb.logits[i].data(), ra.logits[i].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("fp8 checkpoint (cpu): W8A8 checkpoints serve close to the bf16 weights they quantize",
          "[fp8][engine][checkpoint]") {
  auto tiny = make_engine({{"model", "tiny"}, {"seed", 11}});  // write_fp8 exports seed 11
  const Run ref = run_model(*tiny);
  nlohmann::json ct_static = kCtDynamic;
  ct_static["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 8}, {"strategy", "tensor"}, {"type", "float"}, {"dynamic", false}};
  // Static input scales: the activations of tiny stay within a few units; 8 / 448 covers
  // them with room to spare.
  const auto input_scale = [](const std::string&) { return 8.0f / 448.0f; };
  Fp8Layout dynamic, fixed, autofp8, quark;
  fixed.quant = ct_static;
  fixed.input_scale = input_scale;
  // The fp8 method (AutoFP8's static export) and Quark: per-tensor weight scales.
  autofp8.quant = {{"quant_method", "fp8"}, {"activation_scheme", "static"}, {"ignored_layers", {"lm_head"}}};
  const nlohmann::json quark_fp8 = {
      {"dtype", "fp8_e4m3"}, {"is_dynamic", false}, {"qscheme", "per_tensor"}, {"symmetric", true}};
  quark.quant = {{"quant_method", "quark"},
                 {"exclude", {"lm_head"}},
                 {"export", {{"kv_cache_group", nlohmann::json::array()}, {"weight_format", "real_quantized"}}},
                 {"global_quant_config",
                  {{"weight", quark_fp8}, {"input_tensors", quark_fp8}, {"output_tensors", nullptr}, {"bias", nullptr}}}};
  quark.tensor_scale_shape = {};  // Quark writes scalars
  for (Fp8Layout* l : {&autofp8, &quark}) {
    l->per_channel = false;
    l->input_scale = input_scale;
  }
  const std::pair<const char*, const Fp8Layout*> layouts[] = {{"compressed-tensors, dynamic per token", &dynamic},
                                                              {"compressed-tensors, static per tensor", &fixed},
                                                              {"fp8 (AutoFP8), static per tensor", &autofp8},
                                                              {"Quark, static per tensor", &quark}};
  for (const auto& [name, layout] : layouts) {
    DYNAMIC_SECTION(name) {
      TempDir dir;
      auto e = fp8_checkpoint_engine(dir, *layout);
      const Run got = run_model(*e);
      REQUIRE(got.logits.size() == ref.logits.size());
      double worst = 1.0;
      for (size_t i = 0; i < got.logits.size(); ++i) worst = std::min(worst, cosine(ref.logits[i], got.logits[i]));
      INFO("worst logits cosine " << worst);
      CHECK(worst > 0.99);
      CHECK(e->pool().usage(PoolKind::full).used_pages == 0);
    }
  }
}

namespace {

// A backend without FP8 GEMMs: the CPU backend for
// everything else, Backend's refusal for FP8 weights.
class NoFp8Backend final : public ForwardingBackend {
 public:
  NoFp8Backend() : ForwardingBackend(make_cpu_backend()) {}
  absl::StatusOr<LinearWeight> upload_linear_fp8(const Fp8LinearHost& w, int64_t n, int64_t k,
                                                 const bf16_t* bias) override {
    return Backend::upload_linear_fp8(w, n, k, bias);
  }
};

}  // namespace

TEST_CASE("fp8 weights: a backend without FP8 GEMMs refuses the model at load, naming itself",
          "[fp8][engine]") {
  auto cfg = config_from_json({{"model", "tiny-fp8"}, {"device", "cpu"}});
  REQUIRE(cfg.ok());
  auto e = Engine::create(*cfg, std::make_unique<NoFp8Backend>());
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(e.status().message()), ContainsSubstring("FP8 weights are not served by this backend"));
  CHECK_THAT(std::string(e.status().message()), ContainsSubstring("cpu"));  // the backend's description
  // The same backend serves the bf16 model.
  auto bf16_cfg = config_from_json({{"model", "tiny"}, {"device", "cpu"}});
  REQUIRE(bf16_cfg.ok());
  CHECK(Engine::create(*bf16_cfg, std::make_unique<NoFp8Backend>()).ok());
}

// The FP8 presets' synthetic weights, made a row at a time, are the per-row quantization
// of the bf16 preset's weights (src/loading/host_weights.cc), code for code.
TEST_CASE("fp8 weights: a preset's synthetic FP8 projections quantize its bf16 ones exactly", "[fp8]") {
  for (const char* name : {"tiny", "qwen2.5-7b"}) {
    CAPTURE(name);
    auto bf16 = model_preset(name);
    auto fp8 = model_preset(std::string(name) + "-fp8");
    REQUIRE(bf16.ok());
    REQUIRE(fp8.ok());
    HostLayerWeights b, f;
    REQUIRE(make_synthetic_weights(*bf16, 5)->layer(0, b).ok());
    REQUIRE(make_synthetic_weights(*fp8, 5)->layer(0, f).ok());
    CHECK(f.attn_norm == b.attn_norm);
    CHECK(f.qkv.bias == b.qkv.bias);
    for (auto [hb, hf] : {std::pair{&b.qkv, &f.qkv}, std::pair{&b.o, &f.o}, std::pair{&b.gate_up, &f.gate_up},
                          std::pair{&b.down, &f.down}}) {
      REQUIRE(hf->fp8());
      CHECK(hf->w.empty());
      const int64_t n = int64_t(hf->w_scale.size());
      const int64_t k = int64_t(hb->w.size()) / n;
      REQUIRE(int64_t(hf->w_fp8.size()) == n * k);
      std::vector<uint8_t> codes(size_t(n * k));
      std::vector<float> scales(static_cast<size_t>(n));
      cpu::quantize_rows_fp8(hb->w.data(), n, k, Fp8Act::dynamic_token, 1.0f, Fp8Format::e4m3fn, codes.data(),
                             scales.data());
      CHECK(mismatch(codes, hf->w_fp8) == "");
      CHECK(mismatch(scales, hf->w_scale) == "");
      CHECK(hf->act == Fp8Act::dynamic_token);
    }
  }
}

// The loaders pass one HostLayerWeights for every layer, and the synthetic weights reuse
// its buffers (src/loading/host_weights.h): a layer made over the one before it equals the
// layer made fresh, field for field.
TEST_CASE("fp8 weights: a synthetic layer made over the previous one equals it made fresh", "[fp8]") {
  const auto same = [](const HostLinear& a, const HostLinear& b) {
    return a.w == b.w && a.bias == b.bias && a.w_fp8 == b.w_fp8 && a.w_scale == b.w_scale && a.act == b.act &&
           a.input_scale == b.input_scale;
  };
  for (const char* name : {"tiny", "tiny-fp8", "qwen2.5-7b-fp8"}) {
    CAPTURE(name);
    auto spec = model_preset(name);
    REQUIRE(spec.ok());
    auto src = make_synthetic_weights(*spec, 9);
    HostLayerWeights reused, fresh;
    REQUIRE(src->layer(0, reused).ok());
    REQUIRE(src->layer(1, reused).ok());
    REQUIRE(src->layer(1, fresh).ok());
    CHECK(reused.attn_norm == fresh.attn_norm);
    CHECK(reused.ffn_norm == fresh.ffn_norm);
    CHECK(same(reused.qkv, fresh.qkv));
    CHECK(same(reused.o, fresh.o));
    CHECK(same(reused.gate_up, fresh.gate_up));
    CHECK(same(reused.down, fresh.down));
    CHECK(fresh.qkv.bias.empty() == !spec->qkv_bias);
    HostLayerWeights zero;
    REQUIRE(src->layer(0, zero).ok());
    CHECK_FALSE(same(zero.down, fresh.down));  // the layers differ, so equal above means remade
  }
}
