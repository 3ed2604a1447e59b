// Real checkpoints: config.json mapping, loading synthetic weights exported as
// safetensors (bit-identical logits), validation errors naming the file and tensor, and
// sharded checkpoints. KV scales and calibration: test_kv_scales.cc.
#include <nlohmann/json.hpp>

#include "src/loading/hf_config.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

const json kLlama3 = llama3_8b_config();

}  // namespace

TEST_CASE("hf config: Llama, Qwen2 and Mistral config.json give the specs transformers builds",
          "[checkpoint][hf_config]") {
  const ModelSpec l = hf(kLlama3);
  const ModelSpec preset = *model_preset("llama3-8b");
  CHECK(l.arch == "llama");
  CHECK(l.num_params() == preset.num_params());
  CHECK(l.head_dim == 128);
  CHECK(l.num_kv_heads == 8);
  CHECK(l.rope_theta == 500000.0f);
  CHECK(l.rms_eps == 1e-5f);
  CHECK(l.max_position == 8192);
  CHECK_FALSE(l.qkv_bias);
  CHECK_FALSE(l.any_swa());

  // Defaults: kv heads = heads, head_dim = hidden / heads, eps 1e-6, theta 10000.
  json minimal = {{"architectures", {"LlamaForCausalLM"}},
                  {"hidden_size", 64},
                  {"intermediate_size", 128},
                  {"num_attention_heads", 4},
                  {"num_hidden_layers", 2},
                  {"vocab_size", 100}};
  const ModelSpec m = hf(minimal);
  CHECK(m.num_kv_heads == 4);
  CHECK(m.head_dim == 16);
  CHECK(m.rms_eps == 1e-6f);
  CHECK(m.rope_theta == 10000.0f);
  CHECK(m.max_position == 2048);
  minimal["head_dim"] = 32;  // head_dim may differ from hidden / heads (Mistral Nemo)
  CHECK(hf(minimal).q_dim() == 128);
  minimal["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}};  // transformers 5
  CHECK(hf(minimal).rope_theta == 250000.0f);

  json qwen = {{"architectures", {"Qwen2ForCausalLM"}},
               {"hidden_size", 3584},
               {"intermediate_size", 18944},
               {"max_window_layers", 28},
               {"num_attention_heads", 28},
               {"num_hidden_layers", 28},
               {"num_key_value_heads", 4},
               {"rms_norm_eps", 1e-6},
               {"rope_theta", 1000000.0},
               {"sliding_window", 131072},
               {"use_sliding_window", false},
               {"tie_word_embeddings", false},
               {"vocab_size", 152064}};
  const ModelSpec q = hf(qwen);
  CHECK(q.qkv_bias);
  CHECK(q.num_params() == model_preset("qwen2.5-7b")->num_params());
  CHECK_FALSE(q.any_swa());  // use_sliding_window false
  qwen["use_sliding_window"] = true;
  qwen["max_window_layers"] = 20;
  qwen["sliding_window"] = 4096;
  const ModelSpec qs = hf(qwen);
  CHECK(qs.sliding_window == 4096);
  for (int l = 0; l < 28; ++l) CHECK(qs.layer_is_swa[size_t(l)] == (l >= 20));  // layers >= max_window_layers
  qwen["tie_word_embeddings"] = true;
  CHECK(hf(qwen).tie_embeddings);

  json mistral = {{"architectures", {"MistralForCausalLM"}},
                  {"hidden_size", 4096},
                  {"intermediate_size", 14336},
                  {"num_attention_heads", 32},
                  {"num_hidden_layers", 32},
                  {"num_key_value_heads", 8},
                  {"rms_norm_eps", 1e-5},
                  {"sliding_window", 4096},
                  {"vocab_size", 32000}};
  const ModelSpec ms = hf(mistral);
  CHECK(ms.num_params() == model_preset("mistral-7b")->num_params());
  CHECK(ms.sliding_window == 4096);
  CHECK(ms.layer_is_swa == std::vector<bool>(32, true));
  mistral["sliding_window"] = nullptr;  // Mistral v0.2+: no window
  CHECK_FALSE(hf(mistral).any_swa());
  mistral.erase("sliding_window");  // MistralConfig's default
  CHECK(hf(mistral).sliding_window == 4096);
  mistral["sliding_window"] = 16;
  mistral["layer_types"] = json::array();
  for (int l = 0; l < 32; ++l)
    mistral["layer_types"].push_back(l % 2 ? "full_attention" : "sliding_attention");
  const ModelSpec mt = hf(mistral);
  CHECK(mt.sliding_window == 16);
  CHECK(mt.layer_is_swa[0]);
  CHECK_FALSE(mt.layer_is_swa[1]);
}

TEST_CASE("hf config: special tokens from config.json, then generation_config.json - presets declare theirs",
          "[checkpoint][hf_config]") {
  json j = kLlama3;
  j["bos_token_id"] = 128000;
  j["eos_token_id"] = {128001, 128009, 128001};  // repeats count once
  j["pad_token_id"] = nullptr;
  const ModelSpec l = hf(j);
  CHECK(l.bos_token_id == 128000);
  CHECK(l.eos_token_ids == std::vector<int32_t>{128001, 128009});
  CHECK(l.pad_token_id == -1);
  j["eos_token_id"] = 2;  // one id, not a list
  CHECK(hf(j).eos_token_ids == std::vector<int32_t>{2});
  CHECK(hf(kLlama3).eos_token_ids.empty());  // none declared
  CHECK(hf(kLlama3).bos_token_id == -1);
  // Ids outside the vocabulary, or not ids, are refused naming the key.
  j["eos_token_id"] = {1, 128256};
  CHECK_THAT(hf_error(j), Catch::Matchers::ContainsSubstring("'eos_token_id' is 128256"));
  j["eos_token_id"] = 1;
  j["bos_token_id"] = "<s>";
  CHECK_THAT(hf_error(j), Catch::Matchers::ContainsSubstring("'bos_token_id'"));

  // From a checkpoint directory: config.json's tokens, replaced by generation_config.json's.
  TempDir dir;
  ModelSpec spec = mini_spec("llama");
  spec.bos_token_id = 1;
  spec.eos_token_ids = {2};
  export_synthetic(dir.path(), spec, 5);
  auto from_config = load_hf_config(dir.path());
  REQUIRE(from_config.ok());
  CHECK(from_config->bos_token_id == 1);
  CHECK(from_config->eos_token_ids == std::vector<int32_t>{2});
  write_file(dir / "generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [7, 5], "do_sample": true})");
  auto from_gen = load_hf_config(dir.path());
  REQUIRE(from_gen.ok());
  CHECK(from_gen->eos_token_ids == std::vector<int32_t>{7, 5});
  write_file(dir / "generation_config.json", "{not json");
  auto bad = load_hf_config(dir.path());
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Matchers::ContainsSubstring("generation_config.json"));

  CHECK(model_preset("llama3-8b")->eos_token_ids == std::vector<int32_t>{128001, 128008, 128009});
  CHECK(model_preset("llama3-8b")->bos_token_id == 128000);
  CHECK(model_preset("mistral-7b")->eos_token_ids == std::vector<int32_t>{2});
  CHECK(model_preset("qwen2.5-7b")->pad_token_id == 151643);
  CHECK(model_preset("tiny")->eos_token_ids.empty());
}

TEST_CASE("hf config: dynamic RoPE, other architectures, biases and bad shapes are refused clearly",
          "[checkpoint][hf_config][errors]") {
  // Scaled RoPE (llama3, linear, yarn) loads: test_rope.cc. Dynamic NTK does not.
  json j = kLlama3;
  j["rope_scaling"] = {{"factor", 8.0}, {"rope_type", "dynamic"}};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "'dynamic'"));
  j["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "'longrope'"));
  j["rope_scaling"] = {{"rope_type", "default"}};
  CHECK(spec_from_hf_config(j, "config.json", "m").ok());

  j = kLlama3;
  j["architectures"] = {"GPT2LMHeadModel"};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "GPT2LMHeadModel"));
  j = kLlama3;
  j["model_type"] = "qwen2";
  CHECK(contains(hf_error(j), "model_type"));
  j = kLlama3;
  j["attention_bias"] = true;
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "attention_bias"));
  j = kLlama3;
  j["hidden_act"] = "gelu";
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "gelu"));
  j = kLlama3;
  j["num_key_value_heads"] = 5;
  CHECK(contains(hf_error(j), "num_key_value_heads"));
  j = kLlama3;
  j.erase("hidden_size");
  CHECK(contains(hf_error(j), "'hidden_size' is missing"));
  j = kLlama3;
  j["vocab_size"] = "big";
  CHECK(contains(hf_error(j), "vocab_size"));
  j = kLlama3;
  j["layer_types"] = {"full_attention"};
  CHECK(contains(hf_error(j), "layer_types"));
  j = kLlama3;
  j["quantization_config"] = {{"quant_method", "gptq"}};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "gptq"));
  CHECK(contains(hf_error(json::array()), "config.json"));
}

TEST_CASE("checkpoint export and load: synthetic weights as safetensors give bit-identical logits",
          "[checkpoint][engine]") {
  const ModelSpec tiny = *model_preset("tiny");
  struct Variant {
    const char* what;
    StDtype dtype;
    int shards;
    bool window;  // window in config.json; the synthetic engine gets it through config overrides
  };
  for (const Variant& v : {Variant{"bf16, one file", StDtype::BF16, 1, false},
                           Variant{"f32, 3 shards, hybrid window", StDtype::F32, 3, true}}) {
    CAPTURE(v.what);
    TempDir dir;
    ModelSpec spec = tiny;
    json swa = json::object();
    if (v.window) {
      spec.sliding_window = 24;
      for (int l = 0; l < spec.num_layers; ++l) spec.layer_is_swa[size_t(l)] = l % 2 == 0;
      swa = {{"sliding_window", 24}, {"swa_layers", "alternate"}};
    }
    ExportOptions opts;
    opts.dtype = v.dtype;
    opts.num_shards = v.shards;
    export_synthetic(dir.path(), spec, 7, opts);
    json a = {{"seed", 7}, {"kv_cache_dtype", "fp8_e4m3"}};
    a.update(swa);
    auto synthetic = make_engine(a);
    auto loaded = make_engine({{"model_path", dir.path()}, {"kv_cache_dtype", "fp8_e4m3"}});
    CHECK(loaded->spec().layer_is_swa == synthetic->spec().layer_is_swa);
    CHECK(loaded->spec().sliding_window == synthetic->spec().sliding_window);
    const auto prompt = prompt_of(45, 3, tiny.vocab);
    const auto tokens = greedy(*synthetic, 1, prompt, 12);
    CHECK(greedy(*loaded, 1, prompt, 12) == tokens);
    const auto la = teacher_forced_logits(*synthetic, 2, prompt, tokens);
    const auto lb = teacher_forced_logits(*loaded, 2, prompt, tokens);
    CHECK((la == lb));
  }
}

TEST_CASE("checkpoint weights: Llama, Qwen2 (biases, tied) and Mistral exports load to the same bf16 arrays",
          "[checkpoint]") {
  for (const char* arch : {"llama", "qwen2", "mistral"}) {
    for (StDtype dtype : {StDtype::BF16, StDtype::F16}) {
      CAPTURE(arch, st_dtype_name(dtype));
      ModelSpec spec = mini_spec(arch);
      if (spec.arch == "qwen2") spec.tie_embeddings = true;
      if (spec.arch == "mistral") {
        spec.sliding_window = 8;
        spec.layer_is_swa.assign(2, true);
      }
      TempDir dir;
      ExportOptions opts;
      opts.dtype = dtype;
      export_synthetic(dir.path(), spec, 3, opts);
      auto c = Checkpoint::open(dir.path());
      INFO(c.status().ToString());
      REQUIRE(c.ok());
      const ModelSpec& got = (*c)->spec();
      CHECK(got.arch == spec.arch);
      CHECK(got.num_params() == spec.num_params());
      CHECK(got.qkv_bias == spec.qkv_bias);
      CHECK(got.tie_embeddings == spec.tie_embeddings);
      CHECK(got.layer_is_swa == spec.layer_is_swa);
      CHECK(got.sliding_window == spec.sliding_window);
      CHECK(got.rms_eps == spec.rms_eps);
      CHECK_FALSE((*c)->kv_scales().has_value());

      // F16 files hold each bf16 value rounded to f16; loading rounds it back to bf16.
      auto expect = [&](std::vector<bf16_t> v) {
        if (dtype == StDtype::F16) {
          for (auto& x : v) x = f32_to_bf16(f16_to_f32(f32_to_f16(bf16_to_f32(x))));
        }
        return v;
      };
      auto syn = make_synthetic_weights(spec, 3);
      auto ld = (*c)->weights();
      HostGlobalWeights gs, gl;
      REQUIRE(syn->globals(gs).ok());
      REQUIRE(ld->globals(gl).ok());
      CHECK((gl.embed == expect(gs.embed)));
      CHECK((gl.final_norm == expect(gs.final_norm)));
      CHECK((gl.lm_head.w == expect(gs.lm_head.w)));
      CHECK(gl.lm_head.w.empty() == spec.tie_embeddings);
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        HostLayerWeights ls, ll;
        REQUIRE(syn->layer(l, ls).ok());
        REQUIRE(ld->layer(l, ll).ok());
        CHECK((ll.attn_norm == expect(ls.attn_norm)));
        CHECK((ll.ffn_norm == expect(ls.ffn_norm)));
        CHECK((ll.qkv.w == expect(ls.qkv.w)));
        CHECK((ll.qkv.bias == expect(ls.qkv.bias)));
        CHECK((ll.o.w == expect(ls.o.w)));
        CHECK((ll.gate_up.w == expect(ls.gate_up.w)));
        CHECK((ll.down.w == expect(ls.down.w)));
      }
    }
  }
  // A Qwen2 checkpoint with biases and tied embeddings serves end to end.
  TempDir dir;
  ModelSpec q = mini_spec("qwen2");
  q.tie_embeddings = true;
  export_synthetic(dir.path(), q, 5);
  auto e = make_engine({{"model_path", dir.path()}});
  CHECK(e->spec().qkv_bias);
  CHECK(greedy(*e, 1, prompt_of(20, 1, q.vocab), 6).size() == 6);
}

TEST_CASE(
    "checkpoint errors: missing, extra, mis-shaped and wrong-dtype tensors name the file and the tensor",
    "[checkpoint][errors]") {
  const ModelSpec spec = mini_spec();
  const std::string up1 = "model.layers.1.mlp.up_proj.weight";
  auto fresh = [&](TempDir& dir) {
    export_synthetic(dir.path(), spec, 1);
    return dir / "model.safetensors";
  };
  {
    TempDir dir;
    rewrite_tensors(fresh(dir), [&](auto& all) { all.erase(all.begin() + 3); });
    CHECK(contains(open_error(dir.path()), "missing 1 tensor(s)"));
  }
  {
    TempDir dir;
    rewrite_tensors(fresh(dir), [&](auto& all) {
      std::erase_if(all, [&](const StWriteTensor& t) { return t.name == up1; });
    });
    const std::string e = open_error(dir.path());
    CHECK(contains(e, up1));
    CHECK(contains(e, "model.safetensors"));
  }
  {
    TempDir dir;
    rewrite_tensors(fresh(dir),
                    [&](auto& all) { all.push_back(f32_scalar("model.layers.0.self_attn.foo", 1.0f)); });
    const std::string e = open_error(dir.path());
    CHECK(contains(e, "model.safetensors: tensor 'model.layers.0.self_attn.foo' is not expected"));
  }
  {
    TempDir dir;
    rewrite_tensors(fresh(dir), [&](auto& all) {
      tensor_named(all, up1)->shape = {spec.hidden, spec.intermediate};
    });
    const std::string e = open_error(dir.path());
    CHECK(contains(e, "tensor '" + up1 + "' has shape [32, 48]; config.json implies [48, 32]"));
  }
  {
    TempDir dir;
    rewrite_tensors(fresh(dir),
                    [&](auto& all) { tensor_named(all, "model.norm.weight")->dtype = StDtype::I16; });
    CHECK(contains(open_error(dir.path()), "tensor 'model.norm.weight' has dtype I16"));
  }
  {
    TempDir dir;  // an FP8 weight needs its weight_scale
    rewrite_tensors(fresh(dir), [&](auto& all) {
      StWriteTensor* t = tensor_named(all, up1);
      t->dtype = StDtype::F8_E4M3;
      t->bytes.resize(t->bytes.size() / 2);
    });
    CHECK(contains(open_error(dir.path()), "has dtype F8_E4M3"));
  }
  {
    TempDir dir;  // NaN in a weight: found when the weights are converted
    rewrite_tensors(fresh(dir), [&](auto& all) {
      tensor_named(all, up1)->bytes[7] = 0x7f, tensor_named(all, up1)->bytes[6] = 0xc0;
    });
    auto c = Checkpoint::open(dir.path());
    REQUIRE(c.ok());
    auto e = Engine::create(*config_from_json(
        {{"model_path", dir.path()}, {"device", "cpu"}, {"num_pages", 64}, {"max_seq_len", 256}}));
    REQUIRE_FALSE(e.ok());
    CHECK(contains(std::string(e.status().message()),
                   "tensor '" + up1 + "' holds a non-finite value at element 3"));
  }
  {
    TempDir dir;  // truncated file on disk
    const std::string f = fresh(dir);
    const std::string bytes = read_file(f);
    write_file(f, bytes.substr(0, bytes.size() - 10));
    const std::string e = open_error(dir.path());
    CHECK(contains(e, f));
    CHECK(contains(e, "truncated"));
  }
  {
    TempDir dir;
    CHECK(contains(open_error(dir.path()), "config.json"));
    write_file(dir / "config.json", hf_config_json(spec).dump());
    CHECK(contains(open_error(dir.path()), "neither model.safetensors nor model.safetensors.index.json"));
  }
}

TEST_CASE("checkpoint shards: the index and the shards must agree", "[checkpoint][errors]") {
  const ModelSpec spec = mini_spec();
  ExportOptions opts;
  opts.num_shards = 2;
  auto sharded = [&](TempDir& dir) {
    export_synthetic(dir.path(), spec, 1, opts);
    return json::parse(read_file(dir / "model.safetensors.index.json"));
  };
  const std::string s1 = "model-00001-of-00002.safetensors", s2 = "model-00002-of-00002.safetensors";
  {
    TempDir dir;
    sharded(dir);
    auto c = Checkpoint::open(dir.path());
    REQUIRE(c.ok());
    CHECK((*c)->num_files() == 2);
  }
  {
    TempDir dir;  // the index places a tensor in the wrong shard
    json idx = sharded(dir);
    idx["weight_map"]["model.norm.weight"] = idx["weight_map"]["model.norm.weight"] == s1 ? s2 : s1;
    write_file(dir / "model.safetensors.index.json", idx.dump());
    CHECK(contains(open_error(dir.path()), "tensor 'model.norm.weight'"));
  }
  {
    TempDir dir;  // a shard holds a tensor the index does not list
    json idx = sharded(dir);
    idx["weight_map"].erase("model.norm.weight");
    write_file(dir / "model.safetensors.index.json", idx.dump());
    CHECK(contains(open_error(dir.path()), "holds tensor 'model.norm.weight', which"));
  }
  {
    TempDir dir;  // a shard is missing
    sharded(dir);
    std::filesystem::remove(dir / s2);
    const std::string e = open_error(dir.path());
    CHECK(contains(e, s2));
    CHECK(contains(e, "model.safetensors.index.json"));
  }
  {
    TempDir dir;  // a shard name that escapes the directory
    json idx = sharded(dir);
    idx["weight_map"]["model.norm.weight"] = "../" + s1;
    write_file(dir / "model.safetensors.index.json", idx.dump());
    CHECK(contains(open_error(dir.path()), "not a plain file name"));
  }
}
