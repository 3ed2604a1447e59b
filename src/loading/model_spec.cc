#include "src/loading/model_spec.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"
#include "src/loading/hf_config.h"
#include "src/common/arith.h"

namespace kvfuse {

const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kLlama3:
      return "llama3";
    case RopeType::kYarn:
      return "yarn";
  }
  return "?";
}

bool ModelSpec::any_swa() const {
  for (bool b : layer_is_swa) {
    if (b) return true;
  }
  return false;
}

int64_t ModelSpec::layer_projection_params() const {
  const int64_t h = hidden;
  return h * qkv_dim() + q_dim() * h + 2 * h * intermediate + int64_t(intermediate) * h;
}
int64_t ModelSpec::layer_projection_rows() const { return qkv_dim() + hidden + 2 * int64_t(intermediate) + hidden; }

int64_t ModelSpec::num_params() const {
  const int64_t h = hidden;
  const int64_t per_layer = layer_projection_params() + 2 * h + (qkv_bias ? qkv_dim() : 0);
  return int64_t(vocab) * h * (tie_embeddings ? 1 : 2) + num_layers * per_layer + h;
}

int64_t ModelSpec::weight_bytes() const {
  const bool fp8 = quant && quant->linear.format == WeightQuantFormat::fp8_e4m3;
  // The projections of every layer (FP8: codes and per-output-channel scales), then the
  // embeddings, norms, biases and lm_head in bf16 (the FP8 layouts leave the lm_head out).
  const int64_t proj = layer_projection_params();
  const int64_t proj_bytes = fp8 ? proj + 4 * layer_projection_rows() : 2 * proj;
  return num_layers * proj_bytes + 2 * (num_params() - num_layers * proj);
}

std::string ModelSpec::weight_format() const {
  return quant && quant->linear.format == WeightQuantFormat::fp8_e4m3 ? quant->describe() : "bf16";
}

namespace {

ModelSpec make(std::string name, std::string arch, int32_t vocab, int32_t hidden, int32_t inter,
               int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim, float theta, float eps) {
  ModelSpec s;
  s.name = std::move(name);
  s.arch = std::move(arch);
  s.vocab = vocab;
  s.hidden = hidden;
  s.intermediate = inter;
  s.num_layers = layers;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.rope_theta = theta;
  s.rms_eps = eps;
  s.layer_is_swa.assign(size_t(layers), false);
  return s;
}

// Llama 3.1's context and special tokens: <|begin_of_text|>; <|end_of_text|>, <|eom_id|>,
// <|eot_id|>.
absl::Status unknown_preset(const std::string& name) {
  const std::vector<std::string>& names = preset_names();
  return absl::InvalidArgumentError(absl::StrCat(
      "config key 'model': unknown preset '", name,
      "'; allowed: ", absl::StrJoin(names.begin(), names.begin() + names.size() / 2, ", "),
      ", each also with FP8 weights as <name>-fp8"));
}

ModelSpec llama31(ModelSpec s) {
  s.max_position = 131072;
  s.bos_token_id = 128000;
  s.eos_token_ids = {128001, 128008, 128009};
  return s;
}

}  // namespace

absl::StatusOr<ModelSpec> model_preset(const std::string& name) {
  if (absl::EndsWith(name, "-fp8")) {
    // Any preset with FP8 weights: synthetic FP8 codes with one scale per output channel,
    // activations quantized per token at run time, the lm_head left in bf16 (the layout of
    // the FP8-dynamic checkpoints the presets stand for).
    const std::string base = name.substr(0, name.size() - 4);
    if (absl::EndsWith(base, "-fp8")) return unknown_preset(name);
    auto s = model_preset(base);
    if (!s.ok()) return unknown_preset(name);
    s->name = name;
    QuantConfig q;
    q.source = "preset " + name;
    q.method = "preset";
    q.linear = LinearQuant{WeightQuantFormat::fp8_e4m3, ScaleGranularity::channel, 0, 0,
                           ActivationScheme::dynamic_token};
    q.ignore = {"lm_head"};
    s->quant = std::move(q);
    return s;
  }
  if (name == "tiny") {
    // Small enough to answer in milliseconds on 2 CPU cores; GQA 2:1, head_dim 64.
    ModelSpec s = make("tiny", "llama", 1024, 256, 768, 4, 4, 2, 64, 10000.0f, 1e-5f);
    s.max_position = 8192;
    return s;
  }
  if (name == "llama3-8b") {
    return llama31(make("llama3-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0f, 1e-5f));
  }
  if (name == "llama3-70b") {
    // Llama 3.1 70B's shapes: ~141 GB of bf16 weights, for tensor parallelism (one H200 or
    // MI300X cannot hold them with room for KV).
    return llama31(make("llama3-70b", "llama", 128256, 8192, 28672, 80, 64, 8, 128, 500000.0f, 1e-5f));
  }
  if (name == "qwen2.5-7b") {
    ModelSpec s = make("qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, 1000000.0f, 1e-6f);
    s.qkv_bias = true;
    s.max_position = 32768;
    // Qwen2.5 7B Instruct: <|im_end|>, <|endoftext|> (also its pad token); no BOS.
    s.eos_token_ids = {151645, 151643};
    s.pad_token_id = 151643;
    return s;
  }
  if (name == "mistral-7b") {
    // Mistral 7B v0.1: a 4096-token window on every layer.
    ModelSpec s = make("mistral-7b", "mistral", 32000, 4096, 14336, 32, 32, 8, 128, 10000.0f, 1e-5f);
    s.sliding_window = 4096;
    s.layer_is_swa.assign(32, true);
    s.max_position = 32768;
    s.bos_token_id = 1;
    s.eos_token_ids = {2};
    return s;
  }
  if (name == "hybrid-swa") {
    // llama3-8b shapes with sliding-window and full-attention layers alternating.
    ModelSpec s = make("hybrid-swa", "hybrid", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0f, 1e-5f);
    s.sliding_window = 4096;
    for (int i = 0; i < 32; i += 2) s.layer_is_swa[size_t(i)] = true;
    s.max_position = 131072;
    s.bos_token_id = 128000;
    s.eos_token_ids = {128001, 128008, 128009};
    return s;
  }
  return unknown_preset(name);
}

absl::StatusOr<ModelSpec> resolve_model_spec(const Config& cfg) {
  // A checkpoint's config.json replaces the preset; the overrides below apply to both.
  auto s = cfg.model_path.empty() ? model_preset(cfg.model) : load_hf_config(cfg.model_path);
  if (!s.ok()) return s.status();
  ModelSpec spec = *s;
  const size_t n = size_t(spec.num_layers);

  if (cfg.sliding_window >= 0) spec.sliding_window = cfg.sliding_window;
  if (cfg.swa_layers == "none") {
    spec.layer_is_swa.assign(n, false);
  } else if (cfg.swa_layers == "all") {
    spec.layer_is_swa.assign(n, true);
  } else if (cfg.swa_layers == "alternate") {
    spec.layer_is_swa.assign(n, false);
    for (size_t i = 0; i < n; i += 2) spec.layer_is_swa[i] = true;
  } else if (cfg.swa_layers == "list") {
    spec.layer_is_swa.assign(n, false);
    for (int32_t l : cfg.swa_layer_list) {
      if (l < 0 || l >= spec.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("config key 'swa_layers': layer ", l,
                                                       " is out of range [0, ", spec.num_layers - 1,
                                                       "] for model '", spec.name, "'"));
      }
      spec.layer_is_swa[size_t(l)] = true;
    }
  }
  if (cfg.sliding_window == 0) spec.layer_is_swa.assign(n, false);  // explicit 0 turns SWA off
  if (spec.any_swa() && spec.sliding_window <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key 'sliding_window': layers are marked sliding-window but model '", spec.name,
                     "' has no window; set sliding_window to W > 0"));
  }
  if (!spec.any_swa()) spec.sliding_window = 0;

  for (const auto* scales : {&cfg.k_scale, &cfg.v_scale}) {
    if (scales->size() > 1 && scales->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config key '", scales == &cfg.k_scale ? "k_scale" : "v_scale", "': has ", scales->size(),
          " values; give one, or one per layer (", n, " for model '", spec.name, "')"));
    }
  }
  if (cfg.max_seq_len > spec.max_position) {
    return absl::InvalidArgumentError(absl::StrCat("config key 'max_seq_len': ", cfg.max_seq_len,
                                                   " exceeds model '", spec.name, "' max position ",
                                                   spec.max_position));
  }
  return spec;
}

absl::Status check_tensor_parallel(const ModelSpec& spec, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("tensor_parallel ", tp, " must be >= 1"));
  std::vector<std::string> bad;
  auto need = [&](const char* what, int32_t value) {
    if (value % tp != 0) bad.push_back(absl::StrCat(what, " ", value));
  };
  need("num_q_heads", spec.num_q_heads);
  if (spec.num_kv_heads % tp != 0 && (spec.num_kv_heads <= 0 || tp % spec.num_kv_heads != 0)) {
    bad.push_back(absl::StrCat("num_kv_heads ", spec.num_kv_heads));
  }
  need("intermediate", spec.intermediate);
  if (bad.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tensor_parallel ", tp, " does not divide model '",
                                                 spec.name, "': ", absl::StrJoin(bad, ", "),
                                                 " (query heads and the MLP are split evenly over the ranks, KV heads split "
                                                 "or replicated; the vocabulary is padded)"));
}

absl::StatusOr<TensorParallelShard> tensor_parallel_shard(const ModelSpec& spec, int tp) {
  KVFUSE_RETURN_IF_ERROR(check_tensor_parallel(spec, tp));
  TensorParallelShard s;
  s.tp = tp;
  s.num_q_heads = spec.num_q_heads / tp;
  s.kv_replicas = spec.num_kv_heads % tp == 0 ? 1 : tp / spec.num_kv_heads;
  s.num_kv_heads = spec.num_kv_heads * s.kv_replicas / tp;
  s.intermediate = spec.intermediate / tp;
  s.padded_vocab = int32_t(round_up(spec.vocab, tp));
  s.vocab = s.padded_vocab / tp;
  return s;
}

}  // namespace kvfuse
