#include "src/loading/quant_config.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <regex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"
#include "src/loading/quant_config_json.h"

namespace kvfuse {

using nlohmann::json;

// The ignore and target entries of a QuantConfig with their "re:" regexes compiled
// (nullopt for the other entries, and for a regex that does not compile).
struct QuantPatterns {
  std::vector<std::string> ignore, targets;
  std::vector<std::optional<std::regex>> ignore_re, target_re;
};

namespace {

std::optional<std::regex> compile_re(const std::string& entry) {
  if (entry.rfind("re:", 0) != 0) return std::nullopt;
  try {
    return std::regex(entry.substr(3), std::regex::ECMAScript);
  } catch (const std::regex_error&) {
    return std::nullopt;
  }
}
std::shared_ptr<const QuantPatterns> compile_patterns(const std::vector<std::string>& ignore,
                                                      const std::vector<std::string>& targets) {
  auto p = std::make_shared<QuantPatterns>();
  p->ignore = ignore;
  p->targets = targets;
  for (const auto& e : ignore) p->ignore_re.push_back(compile_re(e));
  for (const auto& e : targets) p->target_re.push_back(compile_re(e));
  return p;
}
bool entry_matches(const std::string& entry, const std::optional<std::regex>& re, absl::string_view name) {
  if (entry.rfind("re:", 0) == 0)
    return re && std::regex_search(name.begin(), name.end(), *re, std::regex_constants::match_continuous);
  if (entry.find_first_of("*?[") != std::string::npos) return glob_match(entry, name);
  if (name == entry) return true;
  return name.size() > entry.size() && name.substr(name.size() - entry.size()) == entry &&
         name[name.size() - entry.size() - 1] == '.';
}

// One character against the class at p[i] == '['; the index after the class, or npos
// when it is unterminated (then the '[' is a literal, as in fnmatch).
size_t glob_class(absl::string_view p, size_t i, char ch, bool& matched) {
  size_t j = i + 1;
  const bool negate = j < p.size() && p[j] == '!';
  if (negate) ++j;
  size_t k = j < p.size() && p[j] == ']' ? j + 1 : j;
  while (k < p.size() && p[k] != ']') ++k;
  if (k >= p.size()) return absl::string_view::npos;
  bool in = false;
  for (size_t t = j; t < k; ++t) {
    if (t + 2 < k && p[t + 1] == '-') {
      in = in || (p[t] <= ch && ch <= p[t + 2]);
      t += 2;
    } else {
      in = in || p[t] == ch;
    }
  }
  matched = in != negate;
  return k + 1;
}

}  // namespace

namespace quant_json {

absl::Status Ctx::invalid(const std::string& path, absl::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", path, ": ", what));
}
absl::Status Ctx::unsupported(const std::string& path, absl::string_view what) const {
  return absl::UnimplementedError(absl::StrCat(source, ": ", path, ": ", what));
}

std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}
std::string in_quotes(absl::string_view s) { return absl::StrCat("'", s, "'"); }
std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}
std::string child(const std::string& path, const std::string& name) {
  const bool plain = !name.empty() && std::all_of(name.begin(), name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-';
  });
  return plain ? absl::StrCat(path, ".", name) : absl::StrCat(path, "['", name, "']");
}

const json* get(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  const auto it = obj.find(std::string(key));
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}
// A scalar of JSON type T at obj[key], or nullopt when absent or null; `is` checks the
// type, `what` says what was expected.
template <class T>
absl::Status get_scalar(const Ctx& c, const json& obj, const std::string& path, const char* key,
                        bool (json::*is)() const noexcept, const char* what, std::optional<T>& out) {
  const json* v = get(obj, key);
  if (v != nullptr && !(v->*is)()) return c.invalid(child(path, key), absl::StrCat(shown(*v), " is not ", what));
  out = v ? std::optional<T>(v->get<T>()) : std::nullopt;
  return absl::OkStatus();
}
absl::Status get_string(const Ctx& c, const json& obj, const std::string& path, const char* key,
                        std::optional<std::string>& out) {
  return get_scalar(c, obj, path, key, &json::is_string, "a string", out);
}
absl::Status get_bool(const Ctx& c, const json& obj, const std::string& path, const char* key,
                      std::optional<bool>& out) {
  return get_scalar(c, obj, path, key, &json::is_boolean, "true or false", out);
}
absl::Status get_int(const Ctx& c, const json& obj, const std::string& path, const char* key,
                     std::optional<int64_t>& out) {
  const json* v = get(obj, key);
  if (v != nullptr && !v->is_number_integer())
    return c.invalid(child(path, key), absl::StrCat(shown(*v), " is not an integer"));
  out = std::nullopt;
  if (v)
    out = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v->get<int64_t>();
  return absl::OkStatus();
}
absl::Status get_strings(const Ctx& c, const json& obj, const std::string& path, const char* key,
                         std::vector<std::string>& out) {
  const json* v = get(obj, key);
  if (v == nullptr) return absl::OkStatus();
  const std::string p = child(path, key);
  if (!v->is_array()) return c.invalid(p, absl::StrCat(shown(*v), " is not a list of names"));
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string())
      return c.invalid(absl::StrCat(p, "[", i, "]"), absl::StrCat(shown((*v)[i]), " is not a string"));
    out.push_back((*v)[i].get<std::string>());
  }
  return absl::OkStatus();
}
absl::Status get_object(const Ctx& c, const json& obj, const std::string& path, const char* key,
                        const json*& out) {
  out = get(obj, key);
  if (out != nullptr && !out->is_object())
    return c.invalid(child(path, key), absl::StrCat(shown(*out), " is not an object"));
  return absl::OkStatus();
}
bool empty_or_null(const json* v) { return v == nullptr || (v->is_object() && v->empty()); }

absl::Status check_regexes(const Ctx& c, const std::string& path, const std::vector<std::string>& list) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].rfind("re:", 0) == 0 && !compile_re(list[i]))
      return c.invalid(absl::StrCat(path, "[", i, "]"),
                       absl::StrCat(in_quotes(list[i]), " is not a valid regular expression"));
  }
  return absl::OkStatus();
}
std::string different_schemes(const LinearQuant& a, const LinearQuant& b) {
  QuantConfig x, y;
  x.linear = a;
  y.linear = b;
  return absl::StrCat(x.describe(), " vs ", y.describe());
}

}  // namespace quant_json

namespace {

using namespace quant_json;

// ---- fp8 ----------------------------------------------------------------------------------

absl::Status parse_fp8(const quant_json::Ctx& c, const json& q, const std::string& path, QuantConfig& out) {
  std::optional<std::string> scheme, fmt;
  KVFUSE_RETURN_IF_ERROR(get_string(c, q, path, "activation_scheme", scheme));
  KVFUSE_RETURN_IF_ERROR(get_string(c, q, path, "fmt", fmt));
  const std::string ap = child(path, "activation_scheme");
  if (!scheme) return c.invalid(ap, "is missing ('static' or 'dynamic' was expected)");
  if (*scheme != "static" && *scheme != "dynamic")
    return c.invalid(ap, absl::StrCat(in_quotes(*scheme), " is not 'static' or 'dynamic'"));
  if (fmt && *fmt != "e4m3")
    return c.unsupported(child(path, "fmt"), absl::StrCat(in_quotes(*fmt), " is not supported (e4m3)"));
  out.linear = {WeightQuantFormat::fp8_e4m3, ScaleGranularity::tensor, 0, 0,
                *scheme == "static" ? ActivationScheme::static_tensor : ActivationScheme::dynamic_token};
  KVFUSE_RETURN_IF_ERROR(get_strings(c, q, path, "ignored_layers", out.ignore));
  KVFUSE_RETURN_IF_ERROR(check_regexes(c, child(path, "ignored_layers"), out.ignore));
  std::vector<std::string> not_convert;
  KVFUSE_RETURN_IF_ERROR(get_strings(c, q, path, "modules_to_not_convert", not_convert));
  KVFUSE_RETURN_IF_ERROR(check_regexes(c, child(path, "modules_to_not_convert"), not_convert));
  out.ignore.insert(out.ignore.end(), not_convert.begin(), not_convert.end());
  if (const json* kv = get(q, "kv_cache_scheme")) {
    if (!kv->is_string() || kv->get<std::string>() != "static")
      return c.unsupported(child(path, "kv_cache_scheme"),
                           absl::StrCat(shown(*kv), " is not supported ('static' or null)"));
    out.kv_cache_scales = true;
  }
  if (const json* b = get(q, "weight_block_size")) {
    const std::string bp = child(path, "weight_block_size");
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || !(*b)[1].is_number_integer() ||
        (*b)[0].get<int64_t>() < 1 || (*b)[1].get<int64_t>() < 1 || (*b)[0].get<int64_t>() > (1 << 20) ||
        (*b)[1].get<int64_t>() > (1 << 20))
      return c.invalid(bp, absl::StrCat(shown(*b), " is not [block_n, block_k] (two positive integers)"));
    if (*scheme != "dynamic")
      return c.invalid(bp, "needs activation_scheme 'dynamic' (as vLLM's block-wise FP8 does)");
    out.linear.weight_scale = ScaleGranularity::block;
    out.linear.block_n = int32_t((*b)[0].get<int64_t>());
    out.linear.block_k = int32_t((*b)[1].get<int64_t>());
    out.weight_scale_suffix = "weight_scale_inv";
    out.block_key = bp;
  }
  return absl::OkStatus();
}

absl::string_view granularity_name(const LinearQuant& q) {
  return q.weight_scale == ScaleGranularity::tensor    ? "tensor"
         : q.weight_scale == ScaleGranularity::channel ? "channel"
                                                       : "block";
}

}  // namespace

bool glob_match(absl::string_view p, absl::string_view s) {
  size_t pi = 0, si = 0, star = absl::string_view::npos, star_s = 0;
  while (si < s.size()) {
    size_t next = absl::string_view::npos;  // where p continues when p[pi] matches s[si]
    if (pi < p.size()) {
      bool in = false;
      if (p[pi] == '*') {
        star = pi++;
        star_s = si;
        continue;
      }
      if (p[pi] == '[') {
        const size_t end = glob_class(p, pi, s[si], in);
        if (end != absl::string_view::npos) {
          if (in) next = end;
        } else if (s[si] == '[') {
          next = pi + 1;
        }
      } else if (p[pi] == '?' || p[pi] == s[si]) {
        next = pi + 1;
      }
    }
    if (next != absl::string_view::npos) {
      pi = next;
      ++si;
    } else if (star != absl::string_view::npos) {
      pi = star + 1;
      si = ++star_s;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

bool QuantConfig::ignored(absl::string_view name) const {
  std::shared_ptr<const QuantPatterns> p = patterns;
  if (!p || p->ignore != ignore || p->targets != targets) p = compile_patterns(ignore, targets);
  for (size_t i = 0; i < ignore.size(); ++i)
    if (entry_matches(ignore[i], p->ignore_re[i], name)) return true;
  if (targets.empty()) return false;
  for (size_t i = 0; i < targets.size(); ++i)
    if (targets[i] == "Linear" || entry_matches(targets[i], p->target_re[i], name)) return false;
  return true;
}

absl::Status QuantConfig::check_fused_shards(int32_t num_layers) const {
  static const std::vector<std::vector<std::string>> kFused = {
      {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"mlp.gate_proj", "mlp.up_proj"}};
  for (int32_t l = 0; l < num_layers; ++l) {
    for (const auto& shards : kFused) {
      std::vector<std::string> off, on;
      for (const auto& s : shards) {
        const std::string name = absl::StrCat("model.layers.", l, ".", s);
        (ignored(name) ? off : on).push_back(name);
      }
      if (!off.empty() && !on.empty())
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": quantization_config leaves ", absl::StrJoin(off, ", "), " unquantized but quantizes ",
            absl::StrJoin(on, ", "),
            "; the shards of a fused projection must be all quantized or all not (as vLLM requires)"));
    }
  }
  return absl::OkStatus();
}

absl::Status QuantConfig::require_tensor_or_channel_scales() const {
  if (linear.weight_scale != ScaleGranularity::block) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      source, ": ", block_key.empty() ? "quantization_config" : block_key, ": [", linear.block_n, ", ",
      linear.block_k, "]: block-wise FP8 weight scales (", weight_scale_suffix, ", one per ", linear.block_n,
      "x", linear.block_k, " block) are not supported; ", kFp8Hint));
}

std::string QuantConfig::describe() const {
  if (linear.format == WeightQuantFormat::none) return absl::StrCat(method, " (no quantized weights)");
  const LinearQuant& q = linear;
  const std::string weights = q.weight_scale == ScaleGranularity::block
                                  ? absl::StrCat(q.block_n, "x", q.block_k, " block")
                                  : std::string(granularity_name(q));
  const std::string acts = q.activation == ActivationScheme::none             ? "unquantized"
                           : q.activation == ActivationScheme::static_tensor  ? "static per tensor"
                           : q.activation == ActivationScheme::dynamic_tensor
                               ? "dynamic per token (declared per tensor, fp8_act)"
                           : q.weight_scale == ScaleGranularity::block
                               ? absl::StrCat("dynamic per token group of ", q.block_k)
                               : "dynamic per token";
  std::string s = absl::StrCat(method.empty() ? "" : method + " ", "fp8_e4m3 ",
                               q.activation == ActivationScheme::none ? "W8A16" : "W8A8", " (weights per ",
                               weights, ", activations ", acts, ")");
  if (kv_cache_scales) absl::StrAppend(&s, ", KV scales in the checkpoint");
  if (!ignore.empty())
    absl::StrAppend(&s, ", ", ignore.size(), ignore.size() == 1 ? " ignore entry" : " ignore entries");
  return s;
}

absl::StatusOr<std::optional<QuantConfig>> parse_quant_config(const json& config_json,
                                                              const std::string& source) {
  const Ctx c{source};
  const std::string path = "quantization_config";
  try {
    if (!config_json.is_object())
      return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
    const json* q = get(config_json, "quantization_config");
    if (q == nullptr) return std::optional<QuantConfig>();
    if (!q->is_object()) return c.invalid(path, absl::StrCat(shown(*q), " is not an object"));
    std::optional<std::string> method;
    KVFUSE_RETURN_IF_ERROR(get_string(c, *q, path, "quant_method", method));
    if (!method) return c.invalid(child(path, "quant_method"), "is missing");
    QuantConfig out;
    out.source = source;
    out.method = *method;
    if (*method == "compressed-tensors") {
      KVFUSE_RETURN_IF_ERROR(parse_compressed_tensors(c, *q, path, out));
    } else if (*method == "quark") {
      KVFUSE_RETURN_IF_ERROR(parse_quark(c, *q, path, out));
    } else if (*method == "fp8") {
      KVFUSE_RETURN_IF_ERROR(parse_fp8(c, *q, path, out));
    } else {
      return c.unsupported(child(path, "quant_method"),
                           absl::StrCat(in_quotes(*method),
                                        " is not supported (kvfuse loads FP8 checkpoints of quant_method "
                                        "'compressed-tensors', 'quark' or 'fp8')"));
    }
    out.patterns = compile_patterns(out.ignore, out.targets);
    return std::optional<QuantConfig>(std::move(out));
  } catch (const std::exception& e) {  // a JSON shape the checks above missed: still an error, not a throw
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", path, ": unexpected JSON (", e.what(), ")"));
  }
}

Fp8Act fp8_act(ActivationScheme a) {
  // Dynamic scales, per tensor or per token, are computed per token (see the header).
  if (a == ActivationScheme::none) return Fp8Act::none;
  return a == ActivationScheme::static_tensor ? Fp8Act::static_tensor : Fp8Act::dynamic_token;
}

}  // namespace kvfuse
