#include "src/loading/hf_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/loading/quant_config.h"
#include "src/loading/rope.h"

namespace kvfuse {

using nlohmann::json;

namespace {

struct Reader {
  const json& j;
  absl::string_view source;

  absl::Status error(absl::string_view key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source, ": '", key, "' ", what));
  }
  bool present(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  // Integer key in [lo, hi]; `def` when absent (required when def is nullopt).
  absl::Status integer(const char* key, int64_t lo, int64_t hi, std::optional<int64_t> def,
                       int32_t& out) const {
    if (!present(key)) {
      if (!def) return error(key, "is missing");
      out = int32_t(*def);
      return absl::OkStatus();
    }
    const json& v = j.at(key);
    if (!v.is_number_integer()) return error(key, "is not an integer");
    const int64_t x =
        v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
    if (x < lo || x > hi) return error(key, absl::StrCat("is ", x, ", outside [", lo, ", ", hi, "]"));
    out = int32_t(x);
    return absl::OkStatus();
  }
  absl::Status number(const json& obj, const char* key, double lo, double hi, double def, float& out) const {
    if (!obj.contains(key) || obj.at(key).is_null()) {
      out = float(def);
      return absl::OkStatus();
    }
    const json& v = obj.at(key);
    if (!v.is_number()) return error(key, "is not a number");
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < lo || x > hi)
      return error(key, absl::StrCat("is ", x, ", outside [", lo, ", ", hi, "]"));
    out = float(x);
    return absl::OkStatus();
  }
  absl::Status boolean(const char* key, bool def, bool& out) const {
    if (!present(key)) {
      out = def;
      return absl::OkStatus();
    }
    if (!j.at(key).is_boolean()) return error(key, "is not true or false");
    out = j.at(key).get<bool>();
    return absl::OkStatus();
  }
  std::string string_or(const json& obj, const char* key, const std::string& def) const {
    return obj.contains(key) && obj.at(key).is_string() ? obj.at(key).get<std::string>() : def;
  }
};

// One RoPE dict, `rope_scaling` (transformers 4.x) or `rope_parameters` (5), read as
// transformers 5 standardizes it: the type from `rope_type` (or the legacy `type`),
// original_max_position_embeddings from the config's top level when it has one (the
// Phi-3 convention, which transformers puts first), else the dict, else
// max_position_embeddings, and yarn's null factor from max_position_embeddings /
// original. Every field's error names it as key.field.
absl::StatusOr<RopeScaling> read_rope_dict(const Reader& r, const char* key, int32_t max_position) {
  const json& v = r.j.at(key);
  if (!v.is_object()) return r.error(key, "is not an object");
  const std::string p = absl::StrCat(key, ".");
  for (const auto& [name, value] : v.items()) {
    if (value.is_object()) {
      return absl::UnimplementedError(absl::StrCat(r.source, ": '", key,
                                                   "' has per-layer-type RoPE parameters ('", name,
                                                   "'); kvfuse applies one RoPE to every layer"));
    }
  }
  const char* type_key = v.contains("rope_type") ? "rope_type" : "type";
  std::string type = "default";
  if (v.contains(type_key) && !v.at(type_key).is_null()) {
    if (!v.at(type_key).is_string()) return r.error(p + type_key, "is not a string");
    type = v.at(type_key).get<std::string>();
  }
  RopeScaling sc;
  if (type == "default") {
    sc.type = RopeType::kDefault;
  } else if (type == "linear") {
    sc.type = RopeType::kLinear;
  } else if (type == "llama3") {
    sc.type = RopeType::kLlama3;
  } else if (type == "yarn") {
    sc.type = RopeType::kYarn;
  } else {
    const char* why = type == "dynamic" ? "dynamic NTK recomputes the frequencies as the sequence grows past "
                                          "max_position_embeddings, which a fixed table cannot express"
                      : type == "longrope" ? "longrope switches between two frequency sets by sequence length"
                                           : "it is not a rope type kvfuse knows";
    return absl::UnimplementedError(
        absl::StrCat(r.source, ": '", key, "' has rope type '", type,
                     "'; kvfuse implements default, linear, llama3 and yarn (", why,
                     "), and serving the model with another RoPE would give wrong logits"));
  }

  // Optional numbers: absent or null leave `out` unset.
  auto number = [&](const char* field, std::optional<double>& out) -> absl::Status {
    if (!v.contains(field) || v.at(field).is_null()) return absl::OkStatus();
    if (!v.at(field).is_number()) return r.error(p + field, "is not a number");
    out = v.at(field).get<double>();
    return absl::OkStatus();
  };
  std::optional<double> partial;
  KVFUSE_RETURN_IF_ERROR(number("partial_rotary_factor", partial));
  if (partial && *partial != 1.0)
    return absl::UnimplementedError(
        absl::StrCat(r.source, ": '", p, "partial_rotary_factor' != 1 is not supported"));
  if (sc.type == RopeType::kDefault) return sc;

  std::optional<double> factor;
  KVFUSE_RETURN_IF_ERROR(number("factor", factor));
  if (!v.contains("factor") || (v.at("factor").is_null() && sc.type != RopeType::kYarn))
    return r.error(p + "factor", absl::StrCat("is missing; rope type '", type, "' needs it"));
  if (factor) sc.factor = *factor;
  auto validated = [&]() -> absl::StatusOr<RopeScaling> {
    if (absl::Status st = validate_rope_scaling(sc, p); !st.ok())
      return absl::InvalidArgumentError(absl::StrCat(r.source, ": ", st.message()));
    return sc;
  };
  if (sc.type == RopeType::kLinear) return validated();

  // The pretraining context: an integer.
  auto integer = [&](const json& obj, const std::string& name, const char* field,
                     int32_t& out) -> absl::Status {
    const json& x = obj.at(field);
    if (!x.is_number_integer() || x.get<int64_t>() < 1 || x.get<int64_t>() > (int64_t(1) << 24))
      return r.error(
          name, absl::StrCat("is ", x.dump(), "; an integer in [1, ", int64_t(1) << 24, "] was expected"));
    out = int32_t(x.get<int64_t>());
    return absl::OkStatus();
  };
  constexpr const char* kOriginal = "original_max_position_embeddings";
  if (r.present(kOriginal)) {
    KVFUSE_RETURN_IF_ERROR(integer(r.j, kOriginal, kOriginal, sc.original_max_position));
  } else if (v.contains(kOriginal) && !v.at(kOriginal).is_null()) {
    KVFUSE_RETURN_IF_ERROR(integer(v, p + kOriginal, kOriginal, sc.original_max_position));
  } else {
    sc.original_max_position = max_position;
  }

  if (sc.type == RopeType::kLlama3) {
    std::optional<double> low, high;
    KVFUSE_RETURN_IF_ERROR(number("low_freq_factor", low));
    KVFUSE_RETURN_IF_ERROR(number("high_freq_factor", high));
    if (!low) return r.error(p + "low_freq_factor", "is missing; rope type 'llama3' needs it");
    if (!high) return r.error(p + "high_freq_factor", "is missing; rope type 'llama3' needs it");
    sc.low_freq_factor = *low;
    sc.high_freq_factor = *high;
  } else {  // yarn
    if (!factor) sc.factor = double(max_position) / double(sc.original_max_position);
    std::optional<double> beta_fast, beta_slow;
    KVFUSE_RETURN_IF_ERROR(number("beta_fast", beta_fast));
    KVFUSE_RETURN_IF_ERROR(number("beta_slow", beta_slow));
    // transformers: `get("beta_fast") or 32`, so 0 takes the default as null does.
    sc.beta_fast = beta_fast.value_or(0.0) != 0.0 ? *beta_fast : 32.0;
    sc.beta_slow = beta_slow.value_or(0.0) != 0.0 ? *beta_slow : 1.0;
    KVFUSE_RETURN_IF_ERROR(number("attention_factor", sc.attention_factor));
    KVFUSE_RETURN_IF_ERROR(number("mscale", sc.mscale));
    KVFUSE_RETURN_IF_ERROR(number("mscale_all_dim", sc.mscale_all_dim));
    if (v.contains("truncate") && !v.at("truncate").is_null()) {
      if (!v.at("truncate").is_boolean()) return r.error(p + "truncate", "is not true or false");
      sc.truncate = v.at("truncate").get<bool>();
    }
  }
  return validated();
}

// RoPE: theta from rope_parameters.rope_theta, else the top-level rope_theta; the
// scaling from whichever of rope_scaling / rope_parameters is given (both: they must
// agree). yarn serves original_max_position_embeddings x factor positions, as its
// model cards state, even where max_position_embeddings still says the original.
absl::Status read_rope(const Reader& r, ModelSpec& s) {
  KVFUSE_RETURN_IF_ERROR(r.number(r.j, "rope_theta", 1.0, 1e12, 10000.0, s.rope_theta));
  std::optional<RopeScaling> from_scaling, from_params;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!r.present(key)) continue;
    auto sc = read_rope_dict(r, key, s.max_position);
    if (!sc.ok()) return sc.status();
    (std::string(key) == "rope_scaling" ? from_scaling : from_params) = *sc;
  }
  if (r.present("rope_parameters")) {
    KVFUSE_RETURN_IF_ERROR(
        r.number(r.j.at("rope_parameters"), "rope_theta", 1.0, 1e12, s.rope_theta, s.rope_theta));
  }
  if (from_scaling && from_params && !(*from_scaling == *from_params) && !r.j.at("rope_scaling").empty()) {
    return r.error("rope_scaling",
                   absl::StrCat("(rope type '", rope_type_name(from_scaling->type),
                                "') and 'rope_parameters' (rope type '", rope_type_name(from_params->type),
                                "') describe different RoPE scalings; keep one"));
  }
  s.rope_scaling = from_scaling && !r.j.at("rope_scaling").empty() ? *from_scaling
                   : from_params                                   ? *from_params
                                                                   : RopeScaling{};
  float partial = 1.0f;
  KVFUSE_RETURN_IF_ERROR(r.number(r.j, "partial_rotary_factor", 0.0, 1.0, 1.0, partial));
  if (partial != 1.0f)
    return absl::UnimplementedError(absl::StrCat(r.source, ": partial_rotary_factor != 1 is not supported"));
  // Everything the table needs (theta > 1 for yarn, ...) is checked here, at load.
  auto table = rope_table(s);
  if (!table.ok()) return absl::InvalidArgumentError(absl::StrCat(r.source, ": ", table.status().message()));
  const RopeScaling& sc = s.rope_scaling;
  if (sc.type == RopeType::kYarn) {
    const double extended = std::floor(double(sc.original_max_position) * sc.factor);
    s.max_position = int32_t(std::clamp(extended, double(s.max_position), double(int64_t(1) << 24)));
  }
  return absl::OkStatus();
}

// One token id in [0, vocab), or null / absent (-1).
absl::Status token_id(const json& v, absl::string_view source, const char* key, int32_t vocab, int32_t& out) {
  if (v.is_null()) {
    out = -1;
    return absl::OkStatus();
  }
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": '", key, "' is ", v.dump(), "; a token id in [0, ", vocab, ") was expected"));
  }
  out = int32_t(v.get<int64_t>());
  return absl::OkStatus();
}

}  // namespace

absl::Status read_special_tokens(const json& j, absl::string_view source, ModelSpec& s) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  if (j.contains("bos_token_id")) {
    KVFUSE_RETURN_IF_ERROR(token_id(j.at("bos_token_id"), source, "bos_token_id", s.vocab, s.bos_token_id));
  }
  if (j.contains("pad_token_id")) {
    KVFUSE_RETURN_IF_ERROR(token_id(j.at("pad_token_id"), source, "pad_token_id", s.vocab, s.pad_token_id));
  }
  if (j.contains("eos_token_id")) {
    const json& e = j.at("eos_token_id");
    std::vector<int32_t> ids;
    for (const json& v : e.is_array() ? e : json::array({e})) {
      int32_t id = -1;
      KVFUSE_RETURN_IF_ERROR(token_id(v, source, "eos_token_id", s.vocab, id));
      if (id >= 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    }
    s.eos_token_ids = std::move(ids);
  }
  return absl::OkStatus();
}

json rope_scaling_json(const RopeScaling& sc) {
  if (sc.type == RopeType::kDefault) return nullptr;
  json j = {{"rope_type", rope_type_name(sc.type)}, {"factor", sc.factor}};
  if (sc.type == RopeType::kLinear) return j;
  j["original_max_position_embeddings"] = sc.original_max_position;
  if (sc.type == RopeType::kLlama3) {
    j["low_freq_factor"] = sc.low_freq_factor;
    j["high_freq_factor"] = sc.high_freq_factor;
    return j;
  }
  j["beta_fast"] = sc.beta_fast;
  j["beta_slow"] = sc.beta_slow;
  if (sc.attention_factor) j["attention_factor"] = *sc.attention_factor;
  if (sc.mscale) j["mscale"] = *sc.mscale;
  if (sc.mscale_all_dim) j["mscale_all_dim"] = *sc.mscale_all_dim;
  if (!sc.truncate) j["truncate"] = false;
  return j;
}

absl::StatusOr<ModelSpec> spec_from_hf_config(const json& j, absl::string_view source,
                                              const std::string& name) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  const Reader r{j, source};
  ModelSpec s;
  s.name = name;

  // Architecture: architectures[0], else model_type; both must agree when both are given.
  std::string from_arch, from_type;
  if (r.present("architectures")) {
    const json& a = j.at("architectures");
    if (!a.is_array() || a.size() != 1 || !a[0].is_string())
      return r.error("architectures", "is not a list of one name");
    const std::string n = a[0].get<std::string>();
    if (n == "LlamaForCausalLM")
      from_arch = "llama";
    else if (n == "Qwen2ForCausalLM")
      from_arch = "qwen2";
    else if (n == "MistralForCausalLM")
      from_arch = "mistral";
    else {
      return absl::UnimplementedError(absl::StrCat(source, ": architecture '", n,
                                                   "' is not supported; kvfuse serves LlamaForCausalLM, "
                                                   "Qwen2ForCausalLM and MistralForCausalLM"));
    }
  }
  if (r.present("model_type")) {
    if (!j.at("model_type").is_string()) return r.error("model_type", "is not a string");
    from_type = j.at("model_type").get<std::string>();
  }
  if (from_arch.empty()) {
    if (from_type != "llama" && from_type != "qwen2" && from_type != "mistral") {
      return absl::UnimplementedError(
          absl::StrCat(source, ": model_type '", from_type, "' is not supported (llama, qwen2, mistral)"));
    }
    from_arch = from_type;
  } else if (!from_type.empty() && from_type != from_arch) {
    return r.error("model_type",
                   absl::StrCat("is '", from_type, "' but architectures names a ", from_arch, " model"));
  }
  s.arch = from_arch;
  const bool llama = s.arch == "llama", qwen2 = s.arch == "qwen2", mistral = s.arch == "mistral";

  if (r.present("text_config"))
    return r.error("text_config", "is present: multimodal models are not supported");
  if (r.string_or(j, "hidden_act", "silu") != "silu") {
    return absl::UnimplementedError(absl::StrCat(source, ": hidden_act '", r.string_or(j, "hidden_act", ""),
                                                 "' is not supported (silu)"));
  }

  constexpr int64_t kBig = int64_t(1) << 30;
  KVFUSE_RETURN_IF_ERROR(r.integer("vocab_size", 1, kBig, std::nullopt, s.vocab));
  KVFUSE_RETURN_IF_ERROR(r.integer("hidden_size", 1, 1 << 20, std::nullopt, s.hidden));
  KVFUSE_RETURN_IF_ERROR(r.integer("intermediate_size", 1, 1 << 22, std::nullopt, s.intermediate));
  KVFUSE_RETURN_IF_ERROR(r.integer("num_hidden_layers", 1, 4096, std::nullopt, s.num_layers));
  KVFUSE_RETURN_IF_ERROR(r.integer("num_attention_heads", 1, 4096, std::nullopt, s.num_q_heads));
  KVFUSE_RETURN_IF_ERROR(r.integer("num_key_value_heads", 1, 4096, s.num_q_heads, s.num_kv_heads));
  if (s.num_q_heads % s.num_kv_heads != 0) {
    return r.error(
        "num_key_value_heads",
        absl::StrCat("is ", s.num_kv_heads, ", which does not divide num_attention_heads ", s.num_q_heads));
  }
  if (r.present("head_dim")) {
    KVFUSE_RETURN_IF_ERROR(r.integer("head_dim", 2, 1024, std::nullopt, s.head_dim));
  } else {
    if (s.hidden % s.num_q_heads != 0) {
      return r.error("hidden_size", "is not a multiple of num_attention_heads, and head_dim is not given");
    }
    s.head_dim = s.hidden / s.num_q_heads;
  }
  if (s.head_dim % 2 != 0)
    return r.error("head_dim", absl::StrCat("is ", s.head_dim, "; RoPE needs an even head_dim"));
  KVFUSE_RETURN_IF_ERROR(r.number(j, "rms_norm_eps", 0.0, 1.0, 1e-6, s.rms_eps));
  const int64_t default_max_pos = llama ? 2048 : qwen2 ? 32768 : 131072;
  KVFUSE_RETURN_IF_ERROR(r.integer("max_position_embeddings", 1, int64_t(1) << 24, default_max_pos, s.max_position));
  KVFUSE_RETURN_IF_ERROR(r.boolean("tie_word_embeddings", false, s.tie_embeddings));
  KVFUSE_RETURN_IF_ERROR(read_special_tokens(j, source, s));

  // RoPE: rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x).
  KVFUSE_RETURN_IF_ERROR(read_rope(r, s));

  // Biases: Qwen2 has q/k/v biases and no others; Llama-style configs must have none.
  s.qkv_bias = qwen2;
  bool attention_bias = false, mlp_bias = false;
  KVFUSE_RETURN_IF_ERROR(r.boolean("attention_bias", false, attention_bias));
  KVFUSE_RETURN_IF_ERROR(r.boolean("mlp_bias", false, mlp_bias));
  if (!qwen2 && attention_bias) {
    return absl::UnimplementedError(
        absl::StrCat(source, ": attention_bias true (biases on q/k/v/o) is not supported"));
  }
  if (mlp_bias) return absl::UnimplementedError(absl::StrCat(source, ": mlp_bias true is not supported"));

  // Sliding window (see the header for the rules).
  s.layer_is_swa.assign(size_t(s.num_layers), false);
  int32_t window = 0;
  const bool has_window = r.present("sliding_window");
  if (has_window) KVFUSE_RETURN_IF_ERROR(r.integer("sliding_window", 1, int64_t(1) << 24, std::nullopt, window));
  if (r.present("layer_types")) {
    const json& lt = j.at("layer_types");
    if (!lt.is_array() || lt.size() != size_t(s.num_layers)) {
      return r.error("layer_types", absl::StrCat("is not a list of ", s.num_layers, " layer types"));
    }
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (t == "sliding_attention") {
        s.layer_is_swa[i] = true;
      } else if (t != "full_attention") {
        return r.error("layer_types",
                       absl::StrCat("entry ", i, " is not 'full_attention' or 'sliding_attention'"));
      }
    }
    if (s.any_swa() && !has_window)
      return r.error("sliding_window", "is missing but layer_types has sliding layers");
  } else if (mistral) {
    // MistralConfig's default window is 4096; an explicit null turns it off.
    if (!j.contains("sliding_window")) window = 4096;
    if (window > 0) s.layer_is_swa.assign(size_t(s.num_layers), true);
  } else if (qwen2) {
    bool use = false;
    KVFUSE_RETURN_IF_ERROR(r.boolean("use_sliding_window", false, use));
    int32_t max_window_layers = 28;
    KVFUSE_RETURN_IF_ERROR(r.integer("max_window_layers", 0, 1 << 20, 28, max_window_layers));
    if (!j.contains("sliding_window")) window = 4096;
    if (use && window > 0) {
      for (int32_t l = max_window_layers; l < s.num_layers; ++l) s.layer_is_swa[size_t(l)] = true;
    }
  }
  s.sliding_window = s.any_swa() ? window : 0;

  // quantization_config: FP8 checkpoints (src/loading/quant_config.h), whose tensors
  // src/loading/checkpoint.cc then checks against it; other methods are refused here, early.
  // Dynamic activation scales per tensor are served per token (src/loading/checkpoint_fp8.h).
  auto quant = parse_quant_config(j, std::string(source));
  if (!quant.ok()) return quant.status();
  if (quant->has_value()) {
    KVFUSE_RETURN_IF_ERROR((*quant)->require_tensor_or_channel_scales());
    KVFUSE_RETURN_IF_ERROR((*quant)->check_fused_shards(s.num_layers));
    s.quant = std::move(**quant);
  }
  return s;
}

absl::StatusOr<ModelSpec> load_hf_config(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot be opened (config key 'model_path' is '", model_dir, "')"));
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  std::string name = std::filesystem::path(model_dir).lexically_normal().filename().string();
  if (name.empty())
    name = std::filesystem::path(model_dir).lexically_normal().parent_path().filename().string();
  auto s = spec_from_hf_config(j, path, name.empty() ? "checkpoint" : name);
  if (!s.ok()) return s;
  // generation_config.json, when present, is what generation uses: its special tokens
  // replace config.json's (transformers' GenerationConfig does the same).
  const std::string gen_path = (std::filesystem::path(model_dir) / "generation_config.json").string();
  std::ifstream gen(gen_path);
  if (gen) {
    const json g = json::parse(gen, nullptr, /*allow_exceptions=*/false);
    if (g.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(gen_path, ": not valid JSON"));
    KVFUSE_RETURN_IF_ERROR(read_special_tokens(g, gen_path, *s));
  }
  return s;
}

}  // namespace kvfuse
