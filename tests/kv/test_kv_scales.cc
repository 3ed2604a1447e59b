// KV scales: checkpoint scale tensors (and their older forms), a kv_scales_file and the
// config with their precedence, the FNUZ rule (doubled scale, same bytes), and
// calibration (amax / 448 of a bf16 prefill) end to end.
#include <nlohmann/json.hpp>

#include "src/loading/calibration.h"
#include "src/loading/kv_scales.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

std::vector<float> pool_scales(Engine& e, bool k) {
  return k ? e.pool().config().k_scale : e.pool().config().v_scale;
}

// Prefills `prompt` in chunks without sampling (the way calibration does).
void prefill(Engine& e, SeqId id, const std::vector<int32_t>& prompt, int32_t chunk) {
  REQUIRE(e.add_sequence(id, prompt, SamplingParams{}).ok());
  for (int32_t done = 0; done < int32_t(prompt.size());) {
    const int32_t n = std::min<int32_t>(chunk, int32_t(prompt.size()) - done);
    auto r = e.step({StepItem{id, n, false, false}});
    REQUIRE(r.ok());
    REQUIRE((*r)[0].status.ok());
    done += n;
  }
}

}  // namespace

TEST_CASE("checkpoint kv scales: k_scale and v_scale tensors reach the pool, older forms load, bad ones fail",
          "[checkpoint][scales]") {
  const ModelSpec spec = mini_spec();
  ExportOptions opts;
  opts.kv_scales = KvScales{{0.5f, 0.25f}, {2.0f, 4.0f}, "", ""};
  {
    TempDir dir;
    export_synthetic(dir.path(), spec, 1, opts);
    auto e = make_engine({{"model_path", dir.path()}, {"kv_cache_dtype", "fp8_e4m3"}});
    CHECK(pool_scales(*e, true) == std::vector<float>{0.5f, 0.25f});  // CPU: e4m3fn, stored as given
    CHECK(pool_scales(*e, false) == std::vector<float>{2.0f, 4.0f});
    CHECK(greedy(*e, 1, prompt_of(12, 1, spec.vocab), 4).size() == 4);
  }
  auto with = [&](TempDir& dir, const std::function<void(std::vector<StWriteTensor>&)>& edit) {
    export_synthetic(dir.path(), spec, 1, opts);
    rewrite_tensors(dir / "model.safetensors", edit);
  };
  auto drop_scales = [](std::vector<StWriteTensor>& all) {
    std::erase_if(all, [](const StWriteTensor& t) { return t.name.ends_with("_scale"); });
  };
  {
    TempDir dir;  // AutoFP8's kv_scale: one scale for K and V
    with(dir, [&](auto& all) {
      drop_scales(all);
      all.push_back(f32_scalar("model.layers.0.self_attn.kv_scale", 0.75f));
      all.push_back(f32_scalar("model.layers.1.self_attn.kv_scale", 1.5f));
    });
    auto c = Checkpoint::open(dir.path());
    REQUIRE(c.ok());
    CHECK((*c)->kv_scales()->k == std::vector<float>{0.75f, 1.5f});
    CHECK((*c)->kv_scales()->v == std::vector<float>{0.75f, 1.5f});
  }
  {
    TempDir dir;  // older vLLM k_proj/v_proj.output_scale, BF16 scalars of shape [1]
    with(dir, [&](auto& all) {
      drop_scales(all);
      for (int l = 0; l < 2; ++l) {
        for (const char* p : {"k_proj", "v_proj"}) {
          all.push_back({"model.layers." + std::to_string(l) + ".self_attn." + p + ".output_scale",
                         StDtype::BF16,
                         {1},
                         bytes_of(std::vector<uint16_t>{f32_to_bf16(p[0] == 'k' ? 0.5f : 8.0f)})});
        }
      }
    });
    auto c = Checkpoint::open(dir.path());
    REQUIRE(c.ok());
    CHECK((*c)->kv_scales()->k == std::vector<float>{0.5f, 0.5f});
    CHECK((*c)->kv_scales()->v == std::vector<float>{8.0f, 8.0f});
  }
  const std::string k1 = "model.layers.1.self_attn.k_scale";
  struct Bad {
    const char* what;
    std::function<void(std::vector<StWriteTensor>&)> edit;
    std::string expect;
  };
  const std::vector<Bad> bad = {
      {"NaN", [&](auto& all) { *tensor_named(all, k1) = f32_scalar(k1, std::nanf("")); },
       "tensor '" + k1 + "' is nan"},
      {"zero", [&](auto& all) { *tensor_named(all, k1) = f32_scalar(k1, 0.0f); }, "finite and > 0"},
      {"negative", [&](auto& all) { *tensor_named(all, k1) = f32_scalar(k1, -1.0f); }, "finite and > 0"},
      {"inf", [&](auto& all) { *tensor_named(all, k1) = f32_scalar(k1, INFINITY); }, "finite and > 0"},
      {"per-head",
       [&](auto& all) {
         *tensor_named(all, k1) = {k1, StDtype::F32, {2}, bytes_of(std::vector<float>{1, 1})};
       },
       "one value"},
      {"integer",
       [&](auto& all) {
         *tensor_named(all, k1) = {k1, StDtype::I32, {}, bytes_of(std::vector<int32_t>{1})};
       },
       "dtype I32"},
      {"partial",
       [&](auto& all) { std::erase_if(all, [&](const StWriteTensor& t) { return t.name == k1; }); },
       "every layer or none"},
      {"two forms", [&](auto& all) { all.push_back(f32_scalar("model.layers.1.self_attn.kv_scale", 1.0f)); },
       "twice"},
      {"layer out of range",
       [&](auto& all) { all.push_back(f32_scalar("model.layers.2.self_attn.k_scale", 1.0f)); },
       "names layer 2"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    TempDir dir;
    with(dir, b.edit);
    const std::string e = open_error(dir.path());
    CAPTURE(e);
    CHECK(contains(e, b.expect));
  }
}

TEST_CASE("kv scales precedence: config over kv_scales_file over checkpoint over 1.0, K and V separately",
          "[checkpoint][scales]") {
  const ModelSpec spec = mini_spec();
  TempDir dir;
  ExportOptions opts;
  opts.kv_scales = KvScales{{0.5f, 0.25f}, {2.0f, 4.0f}, "", ""};
  export_synthetic(dir.path(), spec, 1, opts);
  write_file(dir / "scales.json", json{{"k_scale", {0.125, 0.375}}, {"v_scale", 8}}.dump());
  auto plain = make_engine({{"kv_cache_dtype", "fp8_e4m3"}});
  CHECK(pool_scales(*plain, true) == std::vector<float>(4, 1.0f));
  auto ck = make_engine({{"model_path", dir.path()}});
  CHECK(pool_scales(*ck, true) == std::vector<float>{0.5f, 0.25f});
  auto file = make_engine({{"model_path", dir.path()}, {"kv_scales_file", dir / "scales.json"}});
  CHECK(pool_scales(*file, true) == std::vector<float>{0.125f, 0.375f});
  CHECK(pool_scales(*file, false) == std::vector<float>{8.0f, 8.0f});
  auto cfg =
      make_engine({{"model_path", dir.path()}, {"kv_scales_file", dir / "scales.json"}, {"k_scale", 3.0}});
  CHECK(pool_scales(*cfg, true) == std::vector<float>{3.0f, 3.0f});
  CHECK(pool_scales(*cfg, false) == std::vector<float>{8.0f, 8.0f});
  auto v_only = make_engine({{"model_path", dir.path()}, {"v_scale", {1.0, 2.0}}});
  CHECK(pool_scales(*v_only, true) == std::vector<float>{0.5f, 0.25f});
  CHECK(pool_scales(*v_only, false) == std::vector<float>{1.0f, 2.0f});

  Config c = *config_from_json({{"kv_scales_file", dir / "scales.json"}, {"k_scale", 3.0}});
  auto r = resolve_kv_scales(c, std::nullopt, 2);
  REQUIRE(r.ok());
  CHECK(r->k_source == "config");
  CHECK(contains(r->v_source, "scales.json"));
  c.kv_scales_file = dir / "missing.json";
  CHECK(resolve_kv_scales(c, std::nullopt, 2).status().code() == absl::StatusCode::kNotFound);
  auto bad = Engine::create(*config_from_json({{"model_path", dir.path() + "/nope"}, {"device", "cpu"}}));
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(std::string(bad.status().message()), "config.json"));
}

TEST_CASE("kv scales file: calibration's format loads, and bad files are refused",
          "[checkpoint][scales][errors]") {
  auto ok = kv_scales_from_json({{"format", "kvfuse-kv-scales-v1"},
                                 {"fp8_max", 448},
                                 {"num_layers", 2},
                                 {"k_scale", {0.5, 1.0}},
                                 {"v_scale", 2.0},
                                 {"k_amax", {224, 448}}},
                                "s.json", 2);
  REQUIRE(ok.ok());
  CHECK(ok->v == std::vector<float>{2.0f, 2.0f});
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"k_scale", 1.0}}, "'v_scale' is missing"},
      {{{"k_scale", {1.0}}, {"v_scale", 1.0}}, "has 1 values"},
      {{{"k_scale", 0.0}, {"v_scale", 1.0}}, "finite and > 0"},
      {{{"k_scale", -2.0}, {"v_scale", 1.0}}, "finite and > 0"},
      {{{"k_scale", "x"}, {"v_scale", 1.0}}, "not a number"},
      {{{"k_scale", 1.0}, {"v_scale", 1.0}, {"k_sclae", 1}}, "unknown key 'k_sclae'"},
      {{{"k_scale", 1.0}, {"v_scale", 1.0}, {"num_layers", 3}}, "num_layers"},
      {{{"k_scale", 1.0}, {"v_scale", 1.0}, {"fp8_max", 240}}, "e4m3fn units"},
      {json::array(), "not a JSON object"},
  };
  for (const auto& [j, expect] : bad) {
    CAPTURE(j.dump());
    auto r = kv_scales_from_json(j, "s.json", 2);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(std::string(r.status().message()), "s.json: "));
    CHECK(contains(std::string(r.status().message()), expect));
  }
}

TEST_CASE(
    "kv scales on e4m3fnuz: the doubled scale stores the e4m3fn bytes and dequantizes to the same values",
    "[checkpoint][scales][fp8]") {
  CHECK(kv_scale_on_device(0.37f, KvFormat::fp8_e4m3fnuz) == 0.74f);
  CHECK(kv_scale_on_device(0.37f, KvFormat::fp8_e4m3fn) == 0.37f);
  CHECK(kv_scale_on_device(0.37f, KvFormat::fp8_e5m2) == 0.37f);
  int saturated = 0;
  for (float s : {1.0f, 0.37f, 2.9f, 3.7f / 448.0f}) {
    // The write computes the reciprocal once in fp32 and multiplies (docs/design.md#kv-scales).
    const float inv_fn = 1.0f / s, inv_nuz = 1.0f / kv_scale_on_device(s, KvFormat::fp8_e4m3fnuz);
    for (uint32_t b = 0; b < 0x10000; ++b) {
      const float x = bf16_to_f32(bf16_t(b));
      if (std::isnan(x)) continue;
      const uint8_t fn = fp8_encode(x * inv_fn, Fp8Format::e4m3fn);
      const uint8_t nuz = fp8_encode(x * inv_nuz, Fp8Format::e4m3fnuz);
      if (std::fabs(x * inv_fn) <= 448.0f) {
        if (fn == 0x80) {
          REQUIRE(nuz == 0x00);  // -0 has no FNUZ code
        } else {
          REQUIRE(nuz == fn);
          REQUIRE(fp8_decode(nuz, Fp8Format::e4m3fnuz) * (2.0f * s) == fp8_decode(fn, Fp8Format::e4m3fn) * s);
        }
      } else {
        // Beyond the calibrated range e4m3fn saturates at 448; FNUZ keeps one more code (480).
        ++saturated;
        REQUIRE((nuz & 0x7f) >= 0x7e);
      }
      // Without the doubling, FNUZ would clip everything above 240 * s.
      if (std::fabs(x * inv_fn) > 256.0f && std::fabs(x * inv_fn) <= 448.0f) {
        REQUIRE(fp8_decode(fp8_encode(x * inv_fn, Fp8Format::e4m3fnuz), Fp8Format::e4m3fnuz) * s !=
                fp8_decode(fn, Fp8Format::e4m3fn) * s);
      }
    }
  }
  CHECK(saturated > 0);
}

TEST_CASE("calibration: scales are amax/448 of the prefill's bf16 K/V and a scales file reaches the pool",
          "[checkpoint][calibration]") {
  const int32_t chunk = 64;
  auto cal = make_engine({{"kv_cache_dtype", "bf16"}, {"max_batch_tokens", chunk}});
  const int32_t vocab = cal->spec().vocab;
  const std::vector<std::vector<int32_t>> prompts = {prompt_of(100, 1, vocab), prompt_of(37, 2, vocab)};
  auto amax = measure_kv_amax(*cal, prompts);
  INFO(amax.status().ToString());
  REQUIRE(amax.ok());
  CHECK(amax->num_tokens == 137);
  CHECK(amax->num_prompts == 2);
  CHECK(cal->num_sequences() == 0);
  const KvScales scales = scales_from_amax(*amax);
  for (size_t l = 0; l < scales.k.size(); ++l) {
    CHECK(scales.k[l] > 0.0f);
    CHECK(scales.v[l] > 0.0f);
  }

  // With the calibrated scales, an FP8 cache of the same prefill uses the top code: the
  // largest |K| and |V| of layer 0 (which depend only on the embeddings) map to exactly
  // 448; later layers see FP8 attention upstream, so theirs land within a few codes.
  auto fp8 = make_engine({{"kv_cache_dtype", "fp8_e4m3"},
                          {"max_batch_tokens", chunk},
                          {"k_scale", scales.k},
                          {"v_scale", scales.v}});
  prefill(*fp8, 1, prompts[0], chunk);
  prefill(*fp8, 2, prompts[1], chunk);
  for (int32_t l = 0; l < fp8->spec().num_layers; ++l) {
    const PagedKvView v = fp8->pool().layer_view(l);
    const size_t n = size_t(v.num_slots() * v.row_elems());
    std::vector<uint8_t> kb(n), vb(n);
    REQUIRE(fp8->backend().copy_to_host(kb.data(), v.k, n).ok());
    REQUIRE(fp8->backend().copy_to_host(vb.data(), v.v, n).ok());
    for (const auto* bytes : {&kb, &vb}) {
      float m = 0;
      for (uint8_t c : *bytes) m = std::max(m, std::fabs(fp8_decode(c, Fp8Format::e4m3fn)));
      CAPTURE(l, bytes == &kb ? "K" : "V");
      if (l == 0) {
        CHECK(m == 448.0f);
      } else {
        CHECK(m >= 352.0f);
        CHECK(m <= 448.0f);
      }
    }
  }

  TempDir dir;
  write_file(dir / "scales.json", kv_scales_file_json(*amax, scales, "tiny").dump(2));
  auto loaded = make_engine({{"kv_cache_dtype", "fp8_e4m3"}, {"kv_scales_file", dir / "scales.json"}});
  CHECK(pool_scales(*loaded, true) == scales.k);
  CHECK(pool_scales(*loaded, false) == scales.v);

  CHECK(measure_kv_amax(*fp8, prompts).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(measure_kv_amax(*cal, {}).status().code() == absl::StatusCode::kInvalidArgument);
}
