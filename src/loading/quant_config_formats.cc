// The "compressed-tensors" and "quark" parsers of src/loading/quant_config.h (which
// documents what each accepts).
#include <algorithm>
#include <iterator>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/loading/quant_config_json.h"

namespace kvfuse::quant_json {

using nlohmann::json;

namespace {

// ---- compressed-tensors -----------------------------------------------------------------

// A QuantizationArgs with compressed-tensors' defaults for absent keys.
struct CtArgs {
  int64_t num_bits = 8;
  std::string type = "int", strategy;
  bool symmetric = true, dynamic = false, dynamic_local = false;
};
absl::StatusOr<CtArgs> read_ct_args(const Ctx& c, const json& v, const std::string& path) {
  if (!v.is_object()) return c.invalid(path, absl::StrCat(shown(v), " is not an object"));
  CtArgs a;
  std::optional<int64_t> bits, group;
  std::optional<std::string> type, strategy;
  std::optional<bool> sym;
  KVFUSE_RETURN_IF_ERROR(get_int(c, v, path, "num_bits", bits));
  KVFUSE_RETURN_IF_ERROR(get_string(c, v, path, "type", type));
  KVFUSE_RETURN_IF_ERROR(get_bool(c, v, path, "symmetric", sym));
  KVFUSE_RETURN_IF_ERROR(get_int(c, v, path, "group_size", group));
  KVFUSE_RETURN_IF_ERROR(get_string(c, v, path, "strategy", strategy));
  if (const json* d = get(v, "dynamic")) {
    if (d->is_string() && lower(d->get<std::string>()) == "local") {
      a.dynamic = a.dynamic_local = true;
    } else if (d->is_boolean()) {
      a.dynamic = d->get<bool>();
    } else {
      return c.invalid(child(path, "dynamic"), absl::StrCat(shown(*d), " is not true, false or 'local'"));
    }
  }
  a.num_bits = bits.value_or(8);
  a.type = lower(type.value_or("int"));
  a.symmetric = sym.value_or(true);
  if (strategy) {
    a.strategy = lower(*strategy);
  } else {  // compressed-tensors infers the strategy from group_size
    a.strategy = !group ? "tensor" : *group == -1 ? "channel" : *group > 0 ? "group" : "";
    if (a.strategy.empty())
      return c.invalid(child(path, "group_size"), absl::StrCat(*group, " is not -1 or > 0"));
  }
  static const char* const kStrategies[] = {"tensor", "channel",      "group",    "block",
                                            "token",  "tensor_group", "attn_head"};
  if (std::find(std::begin(kStrategies), std::end(kStrategies), a.strategy) == std::end(kStrategies))
    return c.invalid(child(path, "strategy"),
                     absl::StrCat(in_quotes(a.strategy), " is not a compressed-tensors strategy"));
  if (a.type != "int" && a.type != "float")
    return c.invalid(child(path, "type"), absl::StrCat(in_quotes(a.type), " is not 'int' or 'float'"));
  return a;
}
// 8-bit float and symmetric, as every FP8 tensor kvfuse reads: `what` names the tensor.
absl::Status ct_fp8(const Ctx& c, const CtArgs& a, const std::string& path, const char* what) {
  if (a.num_bits != 8)
    return c.unsupported(
        child(path, "num_bits"),
        absl::StrCat(a.num_bits, " is not supported (kvfuse serves 8-bit float ", what, ")"));
  if (a.type != "float")
    return c.unsupported(
        child(path, "type"),
        absl::StrCat(in_quotes(a.type), " is not supported (kvfuse serves 8-bit float ", what, ")"));
  if (!a.symmetric)
    return c.unsupported(child(path, "symmetric"),
                         absl::StrCat("false (asymmetric, with zero points) is not supported for ", what));
  return absl::OkStatus();
}
absl::Status ct_weights(const Ctx& c, const json& v, const std::string& path, LinearQuant& q) {
  auto a = read_ct_args(c, v, path);
  if (!a.ok()) return a.status();
  KVFUSE_RETURN_IF_ERROR(ct_fp8(c, *a, path, "weights"));
  if (a->strategy != "tensor" && a->strategy != "channel")
    return c.unsupported(child(path, "strategy"), absl::StrCat(in_quotes(a->strategy), " is not supported (",
                                                               kFp8Hint, ": 'tensor' or 'channel')"));
  if (a->dynamic)
    return c.unsupported(child(path, "dynamic"),
                         "true is not supported: weights need static scales stored in the checkpoint");
  q.format = WeightQuantFormat::fp8_e4m3;
  q.weight_scale = a->strategy == "tensor" ? ScaleGranularity::tensor : ScaleGranularity::channel;
  return absl::OkStatus();
}
absl::Status ct_inputs(const Ctx& c, const json& v, const std::string& path, LinearQuant& q) {
  auto a = read_ct_args(c, v, path);
  if (!a.ok()) return a.status();
  KVFUSE_RETURN_IF_ERROR(ct_fp8(c, *a, path, "input activations"));
  if (a->dynamic_local)
    return c.unsupported(child(path, "dynamic"), "'local' (NVFP4 activations) is not supported");
  if (!a->dynamic && a->strategy == "tensor") {
    q.activation = ActivationScheme::static_tensor;
  } else if (a->dynamic && (a->strategy == "token" || a->strategy == "tensor")) {
    q.activation =
        a->strategy == "token" ? ActivationScheme::dynamic_token : ActivationScheme::dynamic_tensor;
  } else {
    return c.unsupported(
        child(path, "strategy"),
        absl::StrCat(in_quotes(a->strategy), " with dynamic ", a->dynamic ? "true" : "false",
                     " is not supported (input activations static per 'tensor', or dynamic per "
                     "'token' or 'tensor')"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status parse_compressed_tensors(const Ctx& c, const json& q, const std::string& path,
                                      QuantConfig& out) {
  std::optional<std::string> format, status;
  KVFUSE_RETURN_IF_ERROR(get_string(c, q, path, "format", format));
  KVFUSE_RETURN_IF_ERROR(get_string(c, q, path, "quantization_status", status));
  if (!format) return c.invalid(child(path, "format"), "is missing ('float-quantized' was expected)");
  auto check_format = [&](const std::string& p, const std::string& f) {
    if (f == "float-quantized" || f == "naive-quantized") return absl::OkStatus();
    return c.unsupported(p, absl::StrCat(in_quotes(f),
                                         " is not supported (kvfuse loads FP8 weights stored "
                                         "'float-quantized' or 'naive-quantized')"));
  };
  if (*format != "mixed-precision") KVFUSE_RETURN_IF_ERROR(check_format(child(path, "format"), *format));
  // "frozen" is what older FP8 exports wrote (the example of transformers' compressed-tensors
  // documentation has it); "initialized" and "calibration" hold no final scales.
  if (status && *status != "compressed" && *status != "frozen")
    return c.unsupported(child(path, "quantization_status"),
                         absl::StrCat(in_quotes(*status),
                                      " is not supported (a finished export: 'compressed' "
                                      "or 'frozen')"));
  for (const char* key : {"sparsity_config", "transform_config"}) {
    if (!empty_or_null(get(q, key)))
      return c.unsupported(child(path, key), key == std::string("sparsity_config")
                                                 ? "sparse checkpoints are not supported"
                                                 : "online transforms (rotations) are not supported");
  }
  const json* groups = nullptr;
  KVFUSE_RETURN_IF_ERROR(get_object(c, q, path, "config_groups", groups));
  const std::string gp = child(path, "config_groups");
  if (groups == nullptr || groups->empty()) return c.invalid(gp, "is missing or empty");
  std::optional<LinearQuant> first;
  std::string first_name;
  for (const auto& [name, g] : groups->items()) {
    const std::string p = child(gp, name);
    LinearQuant lq;
    std::vector<std::string> targets;
    if (g.is_array()) {  // the preset form {"FP8_DYNAMIC": ["Linear"]}
      const std::string preset = absl::AsciiStrToUpper(name);
      if (preset != "FP8" && preset != "FP8_DYNAMIC")
        return c.unsupported(
            p, absl::StrCat("preset scheme ", in_quotes(name), " is not supported (FP8, FP8_DYNAMIC)"));
      lq = {WeightQuantFormat::fp8_e4m3,
            preset == "FP8" ? ScaleGranularity::tensor : ScaleGranularity::channel, 0, 0,
            preset == "FP8" ? ActivationScheme::static_tensor : ActivationScheme::dynamic_token};
      KVFUSE_RETURN_IF_ERROR(get_strings(c, *groups, gp, name.c_str(), targets));
    } else {
      if (!g.is_object()) return c.invalid(p, absl::StrCat(shown(g), " is not an object"));
      std::optional<std::string> gformat;
      KVFUSE_RETURN_IF_ERROR(get_string(c, g, p, "format", gformat));
      if (gformat || *format == "mixed-precision") {
        if (!gformat)
          return c.invalid(child(p, "format"), "is missing (the top-level format is 'mixed-precision')");
        KVFUSE_RETURN_IF_ERROR(check_format(child(p, "format"), *gformat));
      }
      KVFUSE_RETURN_IF_ERROR(get_strings(c, g, p, "targets", targets));
      const json* w = get(g, "weights");
      if (w == nullptr)
        return c.unsupported(child(p, "weights"), "is null: activation-only quantization is not supported");
      KVFUSE_RETURN_IF_ERROR(ct_weights(c, *w, child(p, "weights"), lq));
      if (const json* in = get(g, "input_activations"))
        KVFUSE_RETURN_IF_ERROR(ct_inputs(c, *in, child(p, "input_activations"), lq));
      if (get(g, "output_activations") != nullptr)
        return c.unsupported(child(p, "output_activations"),
                             "quantized layer outputs are not supported (null was expected)");
    }
    if (targets.empty()) return c.invalid(child(p, "targets"), "is missing or empty");
    KVFUSE_RETURN_IF_ERROR(check_regexes(c, child(p, "targets"), targets));
    if (first && !(*first == lq))
      return c.unsupported(gp, absl::StrCat(in_quotes(first_name), " and ", in_quotes(name),
                                            " describe different schemes (", different_schemes(*first, lq),
                                            "); kvfuse serves one scheme for all linear layers"));
    if (!first) first = lq, first_name = name;
    out.targets.insert(out.targets.end(), targets.begin(), targets.end());
  }
  out.linear = *first;
  KVFUSE_RETURN_IF_ERROR(get_strings(c, q, path, "ignore", out.ignore));
  KVFUSE_RETURN_IF_ERROR(check_regexes(c, child(path, "ignore"), out.ignore));
  if (const json* kv = get(q, "kv_cache_scheme")) {
    const std::string p = child(path, "kv_cache_scheme");
    auto a = read_ct_args(c, *kv, p);
    if (!a.ok()) return a.status();
    KVFUSE_RETURN_IF_ERROR(ct_fp8(c, *a, p, "KV cache"));
    if (a->strategy != "tensor")
      return c.unsupported(child(p, "strategy"), absl::StrCat(in_quotes(a->strategy),
                                                              " is not supported (KV scales per 'tensor')"));
    if (a->dynamic)
      return c.unsupported(child(p, "dynamic"),
                           "true is not supported (KV scales are static, in the checkpoint)");
    out.kv_cache_scales = true;
  }
  return absl::OkStatus();
}

namespace {

// ---- Quark ------------------------------------------------------------------------------

// One QuantizationSpec: an object with a dtype; a list (two-level specs) is refused.
absl::Status quark_spec(const Ctx& c, const json& v, const std::string& path, const char* what,
                        std::string& qscheme, bool& dynamic) {
  if (v.is_array())
    return c.unsupported(
        path, absl::StrCat("a list of specs (two-level ", what, ", e.g. FP8 + int4) is not supported"));
  if (!v.is_object()) return c.invalid(path, absl::StrCat(shown(v), " is not an object"));
  std::optional<std::string> dtype, qs;
  std::optional<bool> dyn, sym;
  KVFUSE_RETURN_IF_ERROR(get_string(c, v, path, "dtype", dtype));
  KVFUSE_RETURN_IF_ERROR(get_string(c, v, path, "qscheme", qs));
  KVFUSE_RETURN_IF_ERROR(get_bool(c, v, path, "is_dynamic", dyn));
  KVFUSE_RETURN_IF_ERROR(get_bool(c, v, path, "symmetric", sym));
  if (!dtype) return c.invalid(child(path, "dtype"), "is missing ('fp8_e4m3' was expected)");
  if (*dtype != "fp8_e4m3")
    return c.unsupported(
        child(path, "dtype"),
        absl::StrCat(in_quotes(*dtype), " is not supported (kvfuse serves fp8_e4m3 ", what, ")"));
  if (sym == false)
    return c.unsupported(child(path, "symmetric"),
                         absl::StrCat("false (asymmetric) is not supported for ", what));
  if (!qs) return c.invalid(child(path, "qscheme"), "is missing");
  qscheme = *qs;
  dynamic = dyn.value_or(false);
  return absl::OkStatus();
}
// The weight and input scheme of a Quark QuantizationConfig into q; `out_ok` allows
// output_tensors (returned in `output`, else nullptr).
absl::Status quark_layer(const Ctx& c, const json& v, const std::string& path, bool out_ok, LinearQuant& q,
                         const json*& output) {
  if (!v.is_object()) return c.invalid(path, absl::StrCat(shown(v), " is not an object"));
  const json* w = get(v, "weight");
  if (w == nullptr)
    return c.unsupported(child(path, "weight"),
                         "is null; kvfuse serves one FP8 scheme for all linear layers");
  std::string qs;
  bool dyn = false;
  KVFUSE_RETURN_IF_ERROR(quark_spec(c, *w, child(path, "weight"), "weights", qs, dyn));
  const std::string wp = child(path, "weight");
  if (qs != "per_tensor" && qs != "per_channel")
    return c.unsupported(child(wp, "qscheme"), absl::StrCat(in_quotes(qs), " is not supported (", kFp8Hint,
                                                            ": 'per_tensor' or 'per_channel')"));
  if (dyn)
    return c.unsupported(child(wp, "is_dynamic"),
                         "true is not supported: weights need static scales in the checkpoint");
  std::optional<int64_t> axis;
  KVFUSE_RETURN_IF_ERROR(get_int(c, *w, wp, "ch_axis", axis));
  if (qs == "per_channel" && axis && *axis != 0)
    return c.unsupported(child(wp, "ch_axis"),
                         absl::StrCat(*axis, " is not supported (per output channel: 0)"));
  q.format = WeightQuantFormat::fp8_e4m3;
  q.weight_scale = qs == "per_tensor" ? ScaleGranularity::tensor : ScaleGranularity::channel;
  q.activation = ActivationScheme::none;
  if (const json* in = get(v, "input_tensors")) {
    const std::string ip = child(path, "input_tensors");
    KVFUSE_RETURN_IF_ERROR(quark_spec(c, *in, ip, "input activations", qs, dyn));
    if (!dyn && qs == "per_tensor") {
      q.activation = ActivationScheme::static_tensor;
    } else if (dyn && (qs == "per_channel" || qs == "per_tensor")) {
      q.activation = qs == "per_channel" ? ActivationScheme::dynamic_token : ActivationScheme::dynamic_tensor;
    } else {
      return c.unsupported(
          child(ip, "qscheme"),
          absl::StrCat(in_quotes(qs), " with is_dynamic ", dyn ? "true" : "false",
                       " is not supported (static 'per_tensor', dynamic 'per_channel' = per token, "
                       "or dynamic 'per_tensor')"));
    }
  }
  if (get(v, "bias") != nullptr)
    return c.unsupported(child(path, "bias"), "quantized biases are not supported (null was expected)");
  output = get(v, "output_tensors");
  if (output != nullptr && !out_ok)
    return c.unsupported(child(path, "output_tensors"),
                         "quantized layer outputs are not supported here (only the K/V projections of "
                         "export.kv_cache_group carry output_tensors)");
  return absl::OkStatus();
}
}  // namespace

absl::Status parse_quark(const Ctx& c, const json& q, const std::string& path, QuantConfig& out) {
  const json* global = get(q, "global_quant_config");
  if (global == nullptr) return c.invalid(child(path, "global_quant_config"), "is missing");
  const json* none = nullptr;
  KVFUSE_RETURN_IF_ERROR(
      quark_layer(c, *global, child(path, "global_quant_config"), false, out.linear, none));
  const json* exp = nullptr;
  KVFUSE_RETURN_IF_ERROR(get_object(c, q, path, "export", exp));
  const std::string ep = child(path, "export");
  if (exp == nullptr)
    return c.invalid(ep, "is missing (Quark exports carry kv_cache_group and weight_format there)");
  std::vector<std::string> kv_group;
  KVFUSE_RETURN_IF_ERROR(get_strings(c, *exp, ep, "kv_cache_group", kv_group));
  std::optional<std::string> weight_format;
  KVFUSE_RETURN_IF_ERROR(get_string(c, *exp, ep, "weight_format", weight_format));
  if (weight_format && *weight_format != "real_quantized")
    return c.unsupported(
        child(ep, "weight_format"),
        absl::StrCat(in_quotes(*weight_format), " is not supported (FP8 weights exported 'real_quantized')"));
  // Per-layer overrides repeat the global scheme; output_tensors only where the KV group says.
  bool kv_found = false;
  for (const char* key : {"layer_quant_config", "kv_cache_quant_config", "layer_type_quant_config"}) {
    const json* map = nullptr;
    KVFUSE_RETURN_IF_ERROR(get_object(c, q, path, key, map));
    if (map == nullptr) continue;
    for (const auto& item : map->items()) {
      const std::string& pattern = item.key();  // not a structured binding: the lambda below captures it
      const json& cfg = item.value();
      const std::string p = child(child(path, key), pattern);
      const bool kv = key != std::string("layer_type_quant_config") &&
                      std::any_of(kv_group.begin(), kv_group.end(),
                                  [&](const std::string& g) { return glob_match(g, pattern); });
      LinearQuant lq;
      const json* output = nullptr;
      KVFUSE_RETURN_IF_ERROR(quark_layer(c, cfg, p, kv || pattern == "*q_proj", lq, output));
      if (!(lq == out.linear))
        return c.unsupported(
            p, absl::StrCat("differs from global_quant_config (", different_schemes(lq, out.linear),
                            "); kvfuse serves one scheme for all linear layers"));
      if (!kv) continue;
      const std::string op = child(p, "output_tensors");
      if (output == nullptr)
        return c.invalid(op, "is null, but the pattern is in export.kv_cache_group (the KV scales)");
      std::string qs;
      bool dyn = false;
      KVFUSE_RETURN_IF_ERROR(quark_spec(c, *output, op, "KV cache", qs, dyn));
      if (qs != "per_tensor" || dyn)
        return c.unsupported(op,
                             absl::StrCat("qscheme ", in_quotes(qs), ", is_dynamic ", dyn ? "true" : "false",
                                          " is not supported (static 'per_tensor' KV scales)"));
      kv_found = kv_found || key == std::string("layer_quant_config");
    }
  }
  if (!kv_group.empty() && !kv_found)
    return c.invalid(child(ep, "kv_cache_group"),
                     "names the KV projections, but no layer_quant_config entry matches it");
  out.kv_cache_scales = !kv_group.empty();
  KVFUSE_RETURN_IF_ERROR(get_strings(c, q, path, "exclude", out.ignore));
  KVFUSE_RETURN_IF_ERROR(check_regexes(c, child(path, "exclude"), out.ignore));
  // Algorithms are folded into the weights, except rotations applied online to the inputs
  // of the layers listed in online_rotation_layers.
  if (const json* algos = get(q, "algo_config")) {
    for (const json& a : algos->is_array() ? *algos : json::array({*algos})) {
      std::optional<std::string> name;
      KVFUSE_RETURN_IF_ERROR(get_string(c, a, child(path, "algo_config"), "name", name));
      const json* online = get(a, "online_config");
      const json* layers = online ? get(*online, "online_rotation_layers") : nullptr;
      if (name == "rotation" && layers != nullptr && !layers->empty())
        return c.unsupported(child(path, "algo_config"),
                             "online rotations (online_rotation_layers) are not supported");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse::quant_json
