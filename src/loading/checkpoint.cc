#include "src/loading/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"
#include "src/loading/checkpoint_fp8.h"
#include "src/loading/hf_config.h"

namespace kvfuse {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string layer_prefix(int32_t l) { return absl::StrCat("model.layers.", l, "."); }

// The tensors an architecture needs, with their shapes.
std::map<std::string, std::vector<int64_t>> expected_tensors(const ModelSpec& s) {
  const int64_t V = s.vocab, H = s.hidden, I = s.intermediate, Q = s.q_dim(), K = s.kv_dim();
  std::map<std::string, std::vector<int64_t>> e = {{"model.embed_tokens.weight", {V, H}},
                                                   {"model.norm.weight", {H}}};
  if (!s.tie_embeddings) e["lm_head.weight"] = {V, H};
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    e[p + "input_layernorm.weight"] = {H};
    e[p + "post_attention_layernorm.weight"] = {H};
    e[p + "self_attn.q_proj.weight"] = {Q, H};
    e[p + "self_attn.k_proj.weight"] = {K, H};
    e[p + "self_attn.v_proj.weight"] = {K, H};
    e[p + "self_attn.o_proj.weight"] = {H, Q};
    e[p + "mlp.gate_proj.weight"] = {I, H};
    e[p + "mlp.up_proj.weight"] = {I, H};
    e[p + "mlp.down_proj.weight"] = {H, I};
    if (s.qkv_bias) {
      e[p + "self_attn.q_proj.bias"] = {Q};
      e[p + "self_attn.k_proj.bias"] = {K};
      e[p + "self_attn.v_proj.bias"] = {K};
    }
  }
  return e;
}

// "model.layers.<N><rest>": N and rest, or false.
bool split_layer_name(absl::string_view name, int64_t& layer, absl::string_view& rest) {
  constexpr absl::string_view kPrefix = "model.layers.";
  if (!absl::StartsWith(name, kPrefix)) return false;
  size_t i = kPrefix.size();
  layer = 0;
  const size_t digits_at = i;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i - digits_at < 9)
    layer = layer * 10 + (name[i++] - '0');
  if (i == digits_at || (name[digits_at] == '0' && i - digits_at > 1)) return false;
  rest = name.substr(i);
  return true;
}

}  // namespace

const CheckpointTensor* Checkpoint::find(absl::string_view name) const {
  const auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::string& dir) {
  std::unique_ptr<Checkpoint> c(new Checkpoint());
  c->dir_ = dir;
  auto spec = load_hf_config(dir);
  if (!spec.ok()) return spec.status();
  c->spec_ = std::move(*spec);
  KVFUSE_RETURN_IF_ERROR(c->map_files());
  KVFUSE_RETURN_IF_ERROR(c->validate());
  return c;
}

absl::Status Checkpoint::map_files() {
  const fs::path index_path = fs::path(dir_) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir_) / "model.safetensors";
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec)) {
      return absl::NotFoundError(
          absl::StrCat(dir_, ": has neither model.safetensors nor model.safetensors.index.json"));
    }
    auto f = SafetensorsFile::open(single_path.string());
    if (!f.ok()) return f.status();
    for (const StTensorInfo& t : (*f)->header().tensors) tensors_[t.name] = {f->get(), &t};
    files_.push_back(std::move(*f));
    return absl::OkStatus();
  }

  std::ifstream in(index_path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::NotFoundError(absl::StrCat(index_path.string(), ": cannot be read"));
  auto map = parse_safetensors_index(text.str(), index_path.string());
  if (!map.ok()) return map.status();
  std::map<std::string, const SafetensorsFile*> by_name;
  for (const auto& [tensor, shard] : *map) {
    if (by_name.count(shard)) continue;
    auto f = SafetensorsFile::open((fs::path(dir_) / shard).string());
    if (!f.ok()) {
      return absl::Status(f.status().code(),
                          absl::StrCat(f.status().message(), " (named by ", index_path.string(), ")"));
    }
    by_name[shard] = f->get();
    files_.push_back(std::move(*f));
  }
  // Index and shards must agree both ways: a tensor the index places in a shard must be
  // there, and a shard must hold nothing the index does not place in it.
  for (const auto& [tensor, shard] : *map) {
    const SafetensorsFile* f = by_name.at(shard);
    const StTensorInfo* t = f->find(tensor);
    if (!t) {
      return absl::InvalidArgumentError(absl::StrCat(f->path(), ": has no tensor '", tensor, "', which ",
                                                     index_path.string(), " places there"));
    }
    tensors_[tensor] = {f, t};
  }
  for (const auto& [shard, f] : by_name) {
    for (const StTensorInfo& t : f->header().tensors) {
      const auto it = map->find(t.name);
      if (it == map->end() || it->second != shard) {
        return absl::InvalidArgumentError(
            absl::StrCat(f->path(), ": holds tensor '", t.name, "', which ", index_path.string(),
                         it == map->end() ? " does not list" : " places in " + it->second));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::validate() {
  const ModelSpec& s = spec_;
  const auto expected = expected_tensors(s);
  auto err = [](const CheckpointTensor& t, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(t.file->path(), ": tensor '", t.info->name, "' ", what));
  };
  // Per-layer KV scale candidates: [layer] -> form -> value.
  std::vector<std::map<std::string, float>> k_found(static_cast<size_t>(s.num_layers)),
      v_found(static_cast<size_t>(s.num_layers));

  for (const auto& [name, t] : tensors_) {
    const StTensorInfo& info = *t.info;
    if (const auto it = expected.find(name); it != expected.end()) {
      if (info.shape != it->second) {
        return err(t, absl::StrCat("has shape ", shape_str(info.shape), "; config.json implies ",
                                   shape_str(it->second)));
      }
      if (s.quant) {  // FP8 kept as FP8: the config says which tensors are quantized
        KVFUSE_RETURN_IF_ERROR(check_fp8_expected(*this, *s.quant, t));
        continue;
      }
      // No quantization_config: an F8_E4M3 projection with a weight_scale is dequantized.
      const bool fp8 = info.dtype == StDtype::F8_E4M3 && is_projection(name) &&
                       find(strip_suffix(name, "weight") + "weight_scale") != nullptr;
      if (!is_float_dtype(info.dtype) && !fp8) {
        return err(t,
                   absl::StrCat("has dtype ", st_dtype_name(info.dtype),
                                "; weights must be BF16, F16, F32 or F64 (or F8_E4M3 with a weight_scale)"));
      }
      continue;
    }
    bool scale = false;
    KVFUSE_RETURN_IF_ERROR(check_scale_tensor(*this, s.quant, expected, t, scale));
    if (scale) continue;
    int64_t layer = 0;
    absl::string_view rest;
    if (split_layer_name(name, layer, rest)) {
      static const std::map<absl::string_view, std::pair<bool, bool>> kForms = {
          // form -> (is a K scale, is a V scale)
          {".self_attn.k_scale", {true, false}},
          {".self_attn.v_scale", {false, true}},
          {".self_attn.kv_scale", {true, true}},
          {".self_attn.k_proj.output_scale", {true, false}},
          {".self_attn.v_proj.output_scale", {false, true}},
          // Quark's query scale (for FP8 attention, which kvfuse does not do): checked
          // like a KV scale, then unused; only under a quantization_config.
          {".self_attn.q_proj.output_scale", {false, false}},
      };
      if (const auto f = kForms.find(rest);
          f != kForms.end() && (s.quant || f->second.first || f->second.second)) {
        if (layer >= s.num_layers)
          return err(t, absl::StrCat("names layer ", layer, "; the model has ", s.num_layers));
        if (info.num_elements() != 1 || info.shape.size() > 1) {
          return err(
              t, absl::StrCat("has shape ", shape_str(info.shape), "; a KV scale is one value ([] or [1])"));
        }
        auto x = st_element_f32(info.dtype, t.file->data(info), 0, name);
        if (!x.ok() || info.dtype == StDtype::F8_E4M3) {
          return err(t, absl::StrCat("has dtype ", st_dtype_name(info.dtype),
                                     "; a KV scale must be F32, BF16, F16 or F64"));
        }
        if (!std::isfinite(*x) || *x <= 0.0f)
          return err(t, absl::StrCat("is ", *x, "; a KV scale must be finite and > 0"));
        if (f->second.first) k_found[size_t(layer)][std::string(f->first)] = *x;
        if (f->second.second) v_found[size_t(layer)][std::string(f->first)] = *x;
        continue;
      }
      if (absl::EndsWith(rest, ".rotary_emb.inv_freq")) continue;  // a buffer old checkpoints saved
    }
    if (name == "lm_head.weight" && s.tie_embeddings) {
      // Tied: transformers uses the embedding and ignores a stored copy; so does kvfuse.
      if (info.shape != std::vector<int64_t>{s.vocab, s.hidden})
        return err(t, "has the wrong shape for a tied lm_head");
      continue;
    }
    return err(t, "is not expected in a " + s.arch + " checkpoint");
  }

  std::vector<std::string> missing;
  for (const auto& [name, shape] : expected) {
    if (!tensors_.count(name)) missing.push_back(name);
  }
  if (!missing.empty()) {
    const size_t n = missing.size();
    if (n > 5) missing.resize(5);
    std::vector<std::string> files;
    for (const auto& f : files_) files.push_back(fs::path(f->path()).filename().string());
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": missing ", n, " tensor(s): ", absl::StrJoin(missing, ", "),
                     n > 5 ? ", ..." : "", " (files: ", absl::StrJoin(files, ", "), ")"));
  }

  // KV scales: one form per layer and kind, and every layer or none.
  KvScales scales;
  int32_t first_with = -1, first_without = -1;
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (auto* found : {&k_found[size_t(l)], &v_found[size_t(l)]}) {
      if (found->size() > 1) {
        std::vector<std::string> forms;
        for (const auto& [form, _] : *found)
          forms.push_back("self_attn" + form.substr(std::string(".self_attn").size()));
        return absl::InvalidArgumentError(absl::StrCat(dir_, ": layer ", l, " has its ",
                                                       found == &k_found[size_t(l)] ? "K" : "V",
                                                       " scale twice: ", absl::StrJoin(forms, " and ")));
      }
    }
    const bool has = !k_found[size_t(l)].empty() && !v_found[size_t(l)].empty();
    const bool any = !k_found[size_t(l)].empty() || !v_found[size_t(l)].empty();
    if (any && first_with < 0) first_with = l;
    if (!has && first_without < 0) first_without = l;
    if (has) {
      scales.k.push_back(k_found[size_t(l)].begin()->second);
      scales.v.push_back(v_found[size_t(l)].begin()->second);
    }
  }
  if (first_with >= 0 && first_without >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": layer ", first_with, " has KV scales but layer ", first_without,
                     " lacks a k_scale or v_scale; give both for every layer or none"));
  }
  if (first_with >= 0) {
    scales.k_source = scales.v_source = absl::StrCat("checkpoint ", dir_);
    kv_scales_ = std::move(scales);
  }
  return absl::OkStatus();
}

namespace {

class CheckpointWeights final : public HostWeightSource {
 public:
  explicit CheckpointWeights(const Checkpoint& c) : c_(c) {}

  absl::Status globals(HostGlobalWeights& g) override {
    g = HostGlobalWeights{};
    KVFUSE_RETURN_IF_ERROR(append("model.embed_tokens.weight", g.embed));
    KVFUSE_RETURN_IF_ERROR(append("model.norm.weight", g.final_norm));
    if (!c_.spec().tie_embeddings) return append("lm_head.weight", g.lm_head.w);
    return absl::OkStatus();
  }

  absl::Status layer(int32_t l, HostLayerWeights& L) override {
    L = HostLayerWeights{};
    const std::string p = layer_prefix(l);
    KVFUSE_RETURN_IF_ERROR(append(p + "input_layernorm.weight", L.attn_norm));
    KVFUSE_RETURN_IF_ERROR(append(p + "post_attention_layernorm.weight", L.ffn_norm));
    // The model's fused layouts: qkv rows q, k, v; gate_up rows gate, up. A projection
    // loads in FP8 (src/loading/checkpoint_fp8.h) or in bf16, all its shards alike.
    for (const auto& [shards, dst] : std::vector<std::pair<std::vector<const char*>, HostLinear*>>{
             {{"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}, &L.qkv},
             {{"self_attn.o_proj.weight"}, &L.o},
             {{"mlp.gate_proj.weight", "mlp.up_proj.weight"}, &L.gate_up},
             {{"mlp.down_proj.weight"}, &L.down}}) {
      std::vector<std::string> names;
      for (const char* n : shards) names.push_back(p + n);
      auto fp8 = fp8_projection(c_, names);
      if (!fp8.ok()) return fp8.status();
      for (const std::string& n : names)
        KVFUSE_RETURN_IF_ERROR(*fp8 ? append_fp8_shard(c_, n, *dst) : append(n, dst->w));
    }
    if (c_.spec().qkv_bias) {
      for (const char* b : {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}) {
        KVFUSE_RETURN_IF_ERROR(append(p + b, L.qkv.bias));
      }
    }
    return absl::OkStatus();
  }

 private:
  // Converts a tensor to bf16 and appends it to `out`. FP8 weights (of a checkpoint
  // without a quantization_config) are dequantized with their weight_scale (validated in
  // Checkpoint::validate).
  absl::Status append(const std::string& name, std::vector<bf16_t>& out) {
    const CheckpointTensor* t = c_.find(name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat(c_.dir(), ": missing tensor '", name, "'"));
    const StTensorInfo& info = *t->info;
    const int64_t count = info.num_elements();
    const size_t at = out.size();
    out.resize(at + size_t(count));
    bf16_t* dst = out.data() + at;
    const uint8_t* src = t->file->data(info);
    if (info.dtype == StDtype::F8_E4M3) {
      const CheckpointTensor* sc = c_.find(strip_suffix(name, "weight") + "weight_scale");
      if (sc == nullptr) return absl::InternalError(absl::StrCat(name, ": FP8 weight without weight_scale"));
      const int64_t nscales = sc->info->num_elements();
      const int64_t row = info.shape.size() == 2 ? info.shape[1] : 1;
      for (int64_t i = 0; i < count; ++i) {
        const float scale =
            *st_element_f32(sc->info->dtype, sc->file->data(*sc->info), nscales == 1 ? 0 : i / row, name);
        dst[i] = f32_to_bf16(fp8_decode(src[i], Fp8Format::e4m3fn) * scale);
      }
    } else if (absl::Status st = st_to_bf16(info.dtype, src, count, dst,
                                            absl::StrCat(t->file->path(), ": tensor '", name, "'"));
               !st.ok()) {
      return st;
    }
    for (int64_t i = 0; i < count; ++i) {
      if ((dst[i] & 0x7f80u) == 0x7f80u) {
        return absl::InvalidArgumentError(
            absl::StrCat(t->file->path(), ": tensor '", name, "' holds a non-finite value at element ", i));
      }
    }
    return absl::OkStatus();
  }

  const Checkpoint& c_;
};

}  // namespace

std::unique_ptr<HostWeightSource> Checkpoint::weights() const {
  return std::make_unique<CheckpointWeights>(*this);
}

absl::Status Checkpoint::check_shapes(const ModelSpec& spec) const {
  const ModelSpec& c = spec_;
  if (spec.vocab != c.vocab || spec.hidden != c.hidden || spec.intermediate != c.intermediate ||
      spec.num_layers != c.num_layers || spec.num_q_heads != c.num_q_heads ||
      spec.num_kv_heads != c.num_kv_heads || spec.head_dim != c.head_dim || spec.qkv_bias != c.qkv_bias ||
      spec.tie_embeddings != c.tie_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("model spec '", spec.name, "' does not have the shapes of checkpoint ", dir_));
  }
  return absl::OkStatus();
}

json hf_config_json(const ModelSpec& s) {
  const std::string arch = s.arch == "qwen2" ? "qwen2" : s.arch == "mistral" ? "mistral" : "llama";
  json j = {
      {"architectures",
       {arch == "qwen2"     ? "Qwen2ForCausalLM"
        : arch == "mistral" ? "MistralForCausalLM"
                            : "LlamaForCausalLM"}},
      {"model_type", arch},
      {"vocab_size", s.vocab},
      {"hidden_size", s.hidden},
      {"intermediate_size", s.intermediate},
      {"num_hidden_layers", s.num_layers},
      {"num_attention_heads", s.num_q_heads},
      {"num_key_value_heads", s.num_kv_heads},
      {"head_dim", s.head_dim},
      {"hidden_act", "silu"},
      {"rms_norm_eps", double(s.rms_eps)},
      {"rope_theta", double(s.rope_theta)},
      {"rope_scaling", rope_scaling_json(s.rope_scaling)},
      {"max_position_embeddings", s.max_position},
      {"tie_word_embeddings", s.tie_embeddings},
      {"torch_dtype", "bfloat16"},
  };
  if (s.bos_token_id >= 0) j["bos_token_id"] = s.bos_token_id;
  if (s.pad_token_id >= 0) j["pad_token_id"] = s.pad_token_id;
  if (!s.eos_token_ids.empty()) j["eos_token_id"] = s.eos_token_ids;
  if (s.qkv_bias && arch != "qwen2") return json();  // not expressible; export_checkpoint refuses it
  if (s.any_swa()) {
    std::vector<std::string> types;
    for (bool w : s.layer_is_swa) types.push_back(w ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["sliding_window"] = s.sliding_window;
    if (arch == "qwen2") j["use_sliding_window"] = true;
  } else {
    j["sliding_window"] = nullptr;
  }
  return j;
}

absl::Status export_checkpoint(const std::string& dir, const ModelSpec& s, HostWeightSource& weights,
                               const ExportOptions& opts) {
  if (opts.dtype != StDtype::BF16 && opts.dtype != StDtype::F16 && opts.dtype != StDtype::F32) {
    return absl::InvalidArgumentError("export_checkpoint: dtype must be BF16, F16 or F32");
  }
  const json config = hf_config_json(s);
  if (config.is_null())
    return absl::InvalidArgumentError("export_checkpoint: qkv biases need the qwen2 architecture");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  {
    std::ofstream f(fs::path(dir) / "config.json");
    f << config.dump(2) << "\n";
    if (!f) return absl::DataLossError(absl::StrCat(dir, "/config.json: write failed"));
  }

  // All tensors in HF names, then split into shards in order.
  std::vector<StWriteTensor> all;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const bf16_t* v, int64_t count) {
    all.push_back({name, opts.dtype, std::move(shape),
                   bf16_to_st_bytes(std::vector<bf16_t>(v, v + count), opts.dtype)});
  };
  const int64_t H = s.hidden, I = s.intermediate, Q = s.q_dim(), K = s.kv_dim();
  if (opts.kv_scales && (opts.kv_scales->k.size() != size_t(s.num_layers) ||
                         opts.kv_scales->v.size() != size_t(s.num_layers))) {
    return absl::InvalidArgumentError("export_checkpoint: kv_scales need one k and one v value per layer");
  }
  HostGlobalWeights g;
  KVFUSE_RETURN_IF_ERROR(weights.globals(g));
  add("model.embed_tokens.weight", {s.vocab, H}, g.embed.data(), int64_t(g.embed.size()));
  add("model.norm.weight", {H}, g.final_norm.data(), H);
  if (!s.tie_embeddings) add("lm_head.weight", {s.vocab, H}, g.lm_head.w.data(), int64_t(g.lm_head.w.size()));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    HostLayerWeights L;
    KVFUSE_RETURN_IF_ERROR(weights.layer(l, L));
    if (int64_t(L.qkv.w.size()) != (Q + 2 * K) * H || int64_t(L.gate_up.w.size()) != 2 * I * H) {
      return absl::InvalidArgumentError(
          absl::StrCat("export_checkpoint: layer ", l, " weights do not match the spec"));
    }
    const std::string p = layer_prefix(l);
    add(p + "input_layernorm.weight", {H}, L.attn_norm.data(), H);
    add(p + "post_attention_layernorm.weight", {H}, L.ffn_norm.data(), H);
    add(p + "self_attn.q_proj.weight", {Q, H}, L.qkv.w.data(), Q * H);
    add(p + "self_attn.k_proj.weight", {K, H}, L.qkv.w.data() + Q * H, K * H);
    add(p + "self_attn.v_proj.weight", {K, H}, L.qkv.w.data() + (Q + K) * H, K * H);
    if (s.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {Q}, L.qkv.bias.data(), Q);
      add(p + "self_attn.k_proj.bias", {K}, L.qkv.bias.data() + Q, K);
      add(p + "self_attn.v_proj.bias", {K}, L.qkv.bias.data() + Q + K, K);
    }
    add(p + "self_attn.o_proj.weight", {H, Q}, L.o.w.data(), H * Q);
    add(p + "mlp.gate_proj.weight", {I, H}, L.gate_up.w.data(), I * H);
    add(p + "mlp.up_proj.weight", {I, H}, L.gate_up.w.data() + I * H, I * H);
    add(p + "mlp.down_proj.weight", {H, I}, L.down.w.data(), H * I);
    if (opts.kv_scales) {
      for (const auto& [kind, v] :
           {std::pair{"k_scale", &opts.kv_scales->k}, std::pair{"v_scale", &opts.kv_scales->v}}) {
        const float x = v->at(size_t(l));
        std::vector<uint8_t> bytes(4);
        std::memcpy(bytes.data(), &x, 4);
        all.push_back({p + "self_attn." + kind, StDtype::F32, {}, std::move(bytes)});
      }
    }
  }

  const int n = std::max(1, opts.num_shards);
  if (n == 1)
    return write_safetensors((fs::path(dir) / "model.safetensors").string(), all, {{"format", "pt"}});
  json weight_map = json::object();
  uint64_t total = 0;
  for (int shard = 0; shard < n; ++shard) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", shard + 1, n);
    std::vector<StWriteTensor> part;
    for (size_t i = all.size() * size_t(shard) / size_t(n); i < all.size() * size_t(shard + 1) / size_t(n);
         ++i) {
      weight_map[all[i].name] = file;
      total += all[i].bytes.size();
      part.push_back(std::move(all[i]));
    }
    if (absl::Status st = write_safetensors((fs::path(dir) / file).string(), part, {{"format", "pt"}});
        !st.ok())
      return st;
  }
  std::ofstream f(fs::path(dir) / "model.safetensors.index.json");
  f << json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) << "\n";
  if (!f) return absl::DataLossError(absl::StrCat(dir, "/model.safetensors.index.json: write failed"));
  return absl::OkStatus();
}

}  // namespace kvfuse
