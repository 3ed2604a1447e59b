#include "src/loading/kv_scales.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse {

using nlohmann::json;

float kv_scale_on_device(float scale, KvFormat dtype) {
  // e4m3fnuz decodes every code to half its e4m3fn value: doubling the scale keeps the
  // dequantized value and the calibrated range (see kv_scales.h).
  return dtype == KvFormat::fp8_e4m3fnuz ? 2.0f * scale : scale;
}

namespace {

absl::Status scales_of(const json& j, const char* key, absl::string_view source, int32_t num_layers,
                       std::vector<float>& out) {
  auto err = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": '", key, "' ", what));
  };
  if (!j.contains(key)) return err("is missing");
  const json& v = j.at(key);
  out.clear();
  if (v.is_number()) {
    out.assign(size_t(num_layers), float(v.get<double>()));
  } else if (v.is_array()) {
    if (v.size() != size_t(num_layers)) {
      return err(absl::StrCat("has ", v.size(), " values; the model has ", num_layers, " layers"));
    }
    for (const json& e : v) {
      if (!e.is_number()) return err("holds a value that is not a number");
      out.push_back(float(e.get<double>()));
    }
  } else {
    return err("is not a number or a list of numbers");
  }
  for (size_t l = 0; l < out.size(); ++l) {
    if (!std::isfinite(out[l]) || out[l] <= 0.0f) {
      return err(absl::StrCat("layer ", l, " is ", out[l], "; a scale must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KvScales> kv_scales_from_json(const json& j, absl::string_view source, int32_t num_layers) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  static const std::set<std::string> known = {"k_scale",    "v_scale",     "format", "fp8_reference",
                                              "fp8_max",    "k_amax",      "v_amax", "num_layers",
                                              "num_tokens", "num_prompts", "model"};
  for (const auto& [key, _] : j.items()) {
    if (!known.count(key))
      return absl::InvalidArgumentError(absl::StrCat(source, ": unknown key '", key, "'"));
  }
  if (j.contains("num_layers") &&
      (!j.at("num_layers").is_number_integer() || j.at("num_layers").get<int64_t>() != num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": 'num_layers' is ",
                     j.at("num_layers").is_number() ? j.at("num_layers").dump() : "not a number",
                     "; the model has ", num_layers, " layers"));
  }
  if (j.contains("fp8_max") &&
      (!j.at("fp8_max").is_number() || j.at("fp8_max").get<double>() != kKvScaleReferenceMax)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": 'fp8_max' must be 448: scales are in e4m3fn units"));
  }
  KvScales s;
  KVFUSE_RETURN_IF_ERROR(scales_of(j, "k_scale", source, num_layers, s.k));
  KVFUSE_RETURN_IF_ERROR(scales_of(j, "v_scale", source, num_layers, s.v));
  s.k_source = s.v_source = std::string(source);
  return s;
}

absl::StatusOr<KvScales> load_kv_scales_file(const std::string& path, int32_t num_layers) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("kv_scales_file '", path, "' cannot be opened"));
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat("kv_scales_file '", path, "' is not valid JSON"));
  return kv_scales_from_json(j, absl::StrCat("kv_scales_file ", path), num_layers);
}

absl::StatusOr<KvScales> resolve_kv_scales(const Config& cfg, const std::optional<KvScales>& checkpoint,
                                           int32_t num_layers) {
  const size_t n = size_t(num_layers);
  KvScales out;
  out.k.assign(n, 1.0f);
  out.v.assign(n, 1.0f);
  out.k_source = out.v_source = "default";
  std::optional<KvScales> file;
  if (!cfg.kv_scales_file.empty()) {
    auto f = load_kv_scales_file(cfg.kv_scales_file, num_layers);
    if (!f.ok()) return f.status();
    file = std::move(*f);
  }
  auto pick = [&](const std::vector<float>& explicit_cfg, const std::vector<float> KvScales::*member,
                  const std::string KvScales::*source, std::vector<float>& dst, std::string& dst_source) {
    if (!explicit_cfg.empty()) {
      dst = explicit_cfg.size() == 1 ? std::vector<float>(n, explicit_cfg[0]) : explicit_cfg;
      dst_source = "config";
    } else if (file) {
      dst = (*file).*member;
      dst_source = (*file).*source;
    } else if (checkpoint) {
      dst = (*checkpoint).*member;
      dst_source = (*checkpoint).*source;
    }
  };
  pick(cfg.k_scale, &KvScales::k, &KvScales::k_source, out.k, out.k_source);
  pick(cfg.v_scale, &KvScales::v, &KvScales::v_source, out.v, out.v_source);
  if (out.k.size() != n || out.v.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("k_scale/v_scale: ", out.k.size(), "/", out.v.size(),
                                                   " values for a model of ", n, " layers"));
  }
  return out;
}

}  // namespace kvfuse
