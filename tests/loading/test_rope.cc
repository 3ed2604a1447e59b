// Scaled RoPE: the frequency tables of src/loading/rope.h against the transformers
// formulas (modeling_rope_utils.py) evaluated here independently in double, the
// config.json keys that describe them (transformers 4.x `rope_scaling`, 5.x
// `rope_parameters`), export -> load round trips, and the table reaching the model.
// The rotation itself with a scaled table: test_cpu_ops.cc; on the GPU:
// test_gpu_backend.cc.
#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "src/loading/hf_config.h"
#include "src/loading/rope.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

constexpr double kPi = 3.14159265358979323846;

// theta^(-2i/D) in double.
std::vector<double> plain(double theta, int32_t D) {
  std::vector<double> f(size_t(D / 2));
  for (int32_t i = 0; i < D / 2; ++i) f[size_t(i)] = 1.0 / std::pow(theta, double(2 * i) / D);
  return f;
}

// transformers' _compute_llama3_parameters, in double.
std::vector<double> llama3_ref(double theta, int32_t D, double factor, double low, double high,
                               double original) {
  std::vector<double> f = plain(theta, D);
  for (double& x : f) {
    const double wavelen = 2 * kPi / x;
    const double smooth = (original / wavelen - low) / (high - low);
    const double scaled = wavelen > original / low ? x / factor : x;
    const bool medium = !(wavelen < original / high) && !(wavelen > original / low);
    x = medium ? (1 - smooth) * scaled / factor + smooth * scaled : scaled;
  }
  return f;
}

// transformers' _compute_yarn_parameters' inv_freq, in double.
std::vector<double> yarn_ref(double theta, int32_t D, double factor, double original, double beta_fast,
                             double beta_slow, bool truncate) {
  auto dim_of = [&](double rot) { return D * std::log(original / (rot * 2 * kPi)) / (2 * std::log(theta)); };
  double low = dim_of(beta_fast), high = dim_of(beta_slow);
  if (truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, D - 1.0);
  if (low == high) high += 0.001;
  std::vector<double> f(size_t(D / 2));
  for (int32_t i = 0; i < D / 2; ++i) {
    const double pos_freq = std::pow(theta, double(2 * i) / D);
    const double extrapolation = 1 / pos_freq, interpolation = 1 / (factor * pos_freq);
    const double ramp = std::min(std::max((i - low) / (high - low), 0.0), 1.0);
    const double extrapolation_factor = 1 - ramp;
    f[size_t(i)] = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return f;
}

RopeTable table(double theta, int32_t D, const RopeScaling& sc) {
  auto t = rope_table(theta, D, sc);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  REQUIRE(t->inv_freq.size() == size_t(D / 2));
  return *t;
}

// Entries of `got` further than 2^-23 relative (one fp32 ulp-ish) from `want`.
int count_off(const std::vector<float>& got, const std::vector<double>& want) {
  int off = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = std::fabs(double(got[i]) - want[i]) <= std::ldexp(std::fabs(want[i]), -23);
    if (!ok) WARN("inv_freq[" << i << "] = " << got[i] << ", expected " << want[i]);
    off += !ok;
  }
  return off;
}

RopeScaling llama31() {
  RopeScaling sc;
  sc.type = RopeType::kLlama3;
  sc.factor = 8;
  sc.low_freq_factor = 1;
  sc.high_freq_factor = 4;
  sc.original_max_position = 8192;
  return sc;
}

RopeScaling yarn(double factor, int32_t original) {
  RopeScaling sc;
  sc.type = RopeType::kYarn;
  sc.factor = factor;
  sc.original_max_position = original;
  return sc;
}

// Llama 3.1 8B's config.json without its RoPE keys.
json llama_base() {
  json j = llama3_8b_config();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["max_position_embeddings"] = 131072;
  return j;
}

// Qwen2.5 7B's config.json without its RoPE keys.
json qwen_base() {
  return {{"architectures", {"Qwen2ForCausalLM"}},
          {"model_type", "qwen2"},
          {"hidden_size", 3584},
          {"intermediate_size", 18944},
          {"num_attention_heads", 28},
          {"num_hidden_layers", 28},
          {"num_key_value_heads", 4},
          {"max_position_embeddings", 32768},
          {"vocab_size", 152064}};
}

}  // namespace

TEST_CASE("rope table: default is float(pow(double(theta), -2i/D)) bit for bit, attention scaling 1",
          "[rope]") {
  for (auto [theta, D] : {std::pair{10000.0f, 64}, std::pair{500000.0f, 128}, std::pair{1000000.0f, 128}}) {
    const RopeTable t = table(theta, D, RopeScaling{});
    CHECK(t.attention_scaling == 1.0f);
    for (int32_t i = 0; i < D / 2; ++i)
      CHECK(t.inv_freq[size_t(i)] == float(std::pow(double(theta), -2.0 * double(i) / double(D))));
  }
}

TEST_CASE("rope table: linear divides every frequency by the factor", "[rope]") {
  RopeScaling sc;
  sc.type = RopeType::kLinear;
  sc.factor = 4;
  const RopeTable t = table(1000000.0, 128, sc), d = table(1000000.0, 128, RopeScaling{});
  CHECK(t.attention_scaling == 1.0f);
  for (size_t i = 0; i < t.inv_freq.size(); ++i) CHECK(t.inv_freq[i] == d.inv_freq[i] / 4);  // exact: 4 = 2^2
  sc.factor = 3;
  std::vector<double> want = plain(10000.0, 64);
  for (double& x : want) x /= 3;
  CHECK(count_off(table(10000.0, 64, sc).inv_freq, want) == 0);
}

TEST_CASE(
    "rope table: llama3 (Llama 3.1) matches transformers' formula - high frequencies kept, low ones / factor",
    "[rope]") {
  const RopeTable t = table(500000.0, 128, llama31());
  CHECK(t.attention_scaling == 1.0f);
  CHECK(count_off(t.inv_freq, llama3_ref(500000.0, 128, 8, 1, 4, 8192)) == 0);
  const RopeTable d = table(500000.0, 128, RopeScaling{});
  int kept = 0, divided = 0, smoothed = 0;
  for (size_t i = 0; i < t.inv_freq.size(); ++i) {
    const double wavelen = 2 * kPi / double(d.inv_freq[i]);
    if (wavelen < 8192.0 / 4) {
      CHECK(t.inv_freq[i] == d.inv_freq[i]);
      ++kept;
    } else if (wavelen > 8192.0) {
      CHECK(std::fabs(double(t.inv_freq[i]) - double(d.inv_freq[i]) / 8) <=
            std::ldexp(double(t.inv_freq[i]), -23));
      ++divided;
    } else {
      CHECK(t.inv_freq[i] < d.inv_freq[i]);
      CHECK(t.inv_freq[i] > d.inv_freq[i] / 8);
      ++smoothed;
    }
    if (i > 0) CHECK(t.inv_freq[i] < t.inv_freq[i - 1]);
  }
  // Llama 3.1 8B: the first 29 pairs keep their frequency, 6 are smoothed, 29 divided.
  CHECK(kept == 29);
  CHECK(smoothed == 6);
  CHECK(divided == 29);
  CHECK(t.inv_freq[0] == 1.0f);
  // Another shape: Llama 3.2 1B (factor 32, head_dim 64), and a small original context.
  RopeScaling sc = llama31();
  sc.factor = 32;
  CHECK(count_off(table(500000.0, 64, sc).inv_freq, llama3_ref(500000.0, 64, 32, 1, 4, 8192)) == 0);
  sc.original_max_position = 64;
  sc.low_freq_factor = 2;
  sc.high_freq_factor = 8;
  CHECK(count_off(table(10000.0, 64, sc).inv_freq, llama3_ref(10000.0, 64, 32, 2, 8, 64)) == 0);
}

TEST_CASE(
    "rope table: yarn matches transformers' formula - attention factor 0.1 ln(factor) + 1 or from mscale",
    "[rope]") {
  // Qwen2.5 with the model card's yarn: factor 4 over 32768 positions, theta 1e6, D 128.
  const RopeTable t = table(1000000.0, 128, yarn(4, 32768));
  CHECK(count_off(t.inv_freq, yarn_ref(1000000.0, 128, 4, 32768, 32, 1, true)) == 0);
  CHECK(t.attention_scaling == float(0.1 * std::log(4.0) + 1.0));
  // The ramp: beta_fast 32 gives dimension floor(23.6) = 23, beta_slow 1 ceil(39.6) = 40;
  // below, frequencies are kept (extrapolation); above, divided by the factor.
  const RopeTable d = table(1000000.0, 128, RopeScaling{});
  for (size_t i = 0; i <= 23; ++i) CHECK(t.inv_freq[i] == d.inv_freq[i]);
  for (size_t i = 40; i < 64; ++i)
    CHECK(std::fabs(double(t.inv_freq[i]) - double(d.inv_freq[i]) / 4) <=
          std::ldexp(double(t.inv_freq[i]), -23));
  for (size_t i = 24; i < 40; ++i)
    CHECK((t.inv_freq[i] < d.inv_freq[i] && t.inv_freq[i] > d.inv_freq[i] / 4));

  // The small model of tests/hf_reference.py: factor 4 over 64 positions, D 64.
  CHECK(count_off(table(1000000.0, 64, yarn(4, 64)).inv_freq, yarn_ref(1000000.0, 64, 4, 64, 32, 1, true)) ==
        0);
  // Other betas, and without truncation (fractional ramp ends).
  RopeScaling sc = yarn(8, 4096);
  sc.beta_fast = 16;
  sc.beta_slow = 2;
  sc.truncate = false;
  const RopeTable u = table(10000.0, 128, sc);
  CHECK(count_off(u.inv_freq, yarn_ref(10000.0, 128, 8, 4096, 16, 2, false)) == 0);
  CHECK(u.attention_scaling == float(0.1 * std::log(8.0) + 1.0));

  // The attention factor: given; from mscale / mscale_all_dim (DeepSeek's); 1 at factor <= 1.
  sc = yarn(40, 4096);
  sc.attention_factor = 1.5;
  CHECK(table(10000.0, 64, sc).attention_scaling == 1.5f);
  sc.attention_factor.reset();
  sc.mscale = 1.0;
  sc.mscale_all_dim = 1.0;
  CHECK(table(10000.0, 64, sc).attention_scaling == 1.0f);
  sc.mscale_all_dim = 0.5;
  CHECK(table(10000.0, 64, sc).attention_scaling ==
        float((0.1 * std::log(40.0) + 1) / (0.1 * 0.5 * std::log(40.0) + 1)));
  sc.mscale_all_dim = 0.0;  // falsy in transformers: the plain formula
  CHECK(table(10000.0, 64, sc).attention_scaling == float(0.1 * std::log(40.0) + 1));
  CHECK(table(10000.0, 64, yarn(1, 4096)).attention_scaling == 1.0f);
  CHECK(table(10000.0, 64, yarn(0.5, 4096)).attention_scaling == 1.0f);
}

TEST_CASE("rope table: bad values are INVALID_ARGUMENT naming the field", "[rope][errors]") {
  auto err = [](double theta, int32_t D, const RopeScaling& sc) {
    auto t = rope_table(theta, D, sc);
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(t.status().message());
  };
  RopeScaling sc = llama31();
  sc.factor = 0;
  CHECK(contains(err(500000, 128, sc), "'factor'"));
  sc.factor = std::nan("");
  CHECK(contains(err(500000, 128, sc), "'factor'"));
  sc = llama31();
  sc.low_freq_factor = 0;
  CHECK(contains(err(500000, 128, sc), "'low_freq_factor'"));
  sc = llama31();
  sc.high_freq_factor = 1;  // == low: the smoothing divides by zero
  CHECK(contains(err(500000, 128, sc), "'high_freq_factor'"));
  sc = llama31();
  sc.original_max_position = 0;
  CHECK(contains(err(500000, 128, sc), "'original_max_position_embeddings'"));
  sc = yarn(4, 64);
  sc.beta_fast = -1;
  CHECK(contains(err(10000, 64, sc), "'beta_fast'"));
  sc = yarn(4, 64);
  sc.beta_slow = INFINITY;
  CHECK(contains(err(10000, 64, sc), "'beta_slow'"));
  sc = yarn(4, 64);
  sc.attention_factor = 0;
  CHECK(contains(err(10000, 64, sc), "'attention_factor'"));
  sc = yarn(4, 64);
  sc.mscale = 1;
  sc.mscale_all_dim = -20;  // a negative denominator
  CHECK(contains(err(10000, 64, sc), "'mscale_all_dim'"));
  sc = llama31();
  sc.factor = 1e-300;  // inv_freq / factor overflows fp32
  CHECK(contains(err(500000, 128, sc), "'factor'"));
  CHECK(contains(err(1.0, 64, yarn(4, 64)), "'rope_theta'"));
  CHECK(contains(err(10000, 63, RopeScaling{}), "'head_dim'"));
  CHECK(contains(err(0.0, 64, RopeScaling{}), "'rope_theta'"));
}

TEST_CASE("hf config: llama3, linear and yarn RoPE in the transformers 4.x and 5 layouts",
          "[rope][hf_config]") {
  // Llama 3.1 8B as transformers 4.x writes it ...
  json j4 = llama_base();
  j4["rope_theta"] = 500000.0;
  j4["rope_scaling"] = {{"factor", 8.0},
                        {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0},
                        {"original_max_position_embeddings", 8192},
                        {"rope_type", "llama3"}};
  const ModelSpec a = hf(j4);
  CHECK(a.rope_theta == 500000.0f);
  CHECK(a.rope_scaling == llama31());
  CHECK(a.max_position == 131072);
  // ... and as transformers 5 writes it.
  json j5 = llama_base();
  j5["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                           {"factor", 8.0},           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const ModelSpec b = hf(j5);
  CHECK(b.rope_theta == 500000.0f);
  CHECK(b.rope_scaling == llama31());
  // transformers 5 fills a missing original_max_position_embeddings from max_position_embeddings.
  j5["rope_parameters"].erase("original_max_position_embeddings");
  CHECK(hf(j5).rope_scaling.original_max_position == 131072);

  // linear, legacy `type` key (4.x) and rope_parameters (5).
  json l = llama_base();
  l["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  CHECK(hf(l).rope_scaling.type == RopeType::kLinear);
  CHECK(hf(l).rope_scaling.factor == 2.0);
  l.erase("rope_scaling");
  l["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2}, {"rope_theta", 10000.0}};
  CHECK(hf(l).rope_scaling.type == RopeType::kLinear);
  CHECK(hf(l).rope_scaling.factor == 2.0);
  CHECK(hf(l).max_position == 131072);

  // Qwen2.5 with its model card's yarn: max_position_embeddings stays 32768 in the file,
  // the model serves 4 x 32768 positions.
  json q4 = qwen_base();
  q4["rope_theta"] = 1000000.0;
  q4["rope_scaling"] = {{"factor", 4.0}, {"original_max_position_embeddings", 32768}, {"type", "yarn"}};
  const ModelSpec q = hf(q4);
  CHECK(q.rope_scaling == yarn(4, 32768));
  CHECK(q.rope_scaling.beta_fast == 32.0);
  CHECK(q.rope_scaling.beta_slow == 1.0);
  CHECK(q.rope_scaling.truncate);
  CHECK_FALSE(q.rope_scaling.attention_factor.has_value());
  CHECK(q.max_position == 131072);
  json q5 = qwen_base();
  q5["rope_parameters"] = {{"rope_type", "yarn"},
                           {"rope_theta", 1000000.0},
                           {"factor", 4.0},
                           {"original_max_position_embeddings", 32768}};
  CHECK(hf(q5).rope_scaling == yarn(4, 32768));
  CHECK(hf(q5).rope_theta == 1000000.0f);
  CHECK(hf(q5).max_position == 131072);
  // yarn's optional fields; null and 0 betas take the defaults (transformers' `or`).
  q5["rope_parameters"].update({{"beta_fast", 16},
                                {"beta_slow", nullptr},
                                {"attention_factor", 1.25},
                                {"mscale", 0.5},
                                {"mscale_all_dim", 0.25},
                                {"truncate", false}});
  RopeScaling want = yarn(4, 32768);
  want.beta_fast = 16;
  want.attention_factor = 1.25;
  want.mscale = 0.5;
  want.mscale_all_dim = 0.25;
  want.truncate = false;
  CHECK(hf(q5).rope_scaling == want);
  q5["rope_parameters"]["beta_fast"] = 0;
  CHECK(hf(q5).rope_scaling.beta_fast == 32.0);
  // Without original_max_position_embeddings: max_position_embeddings; the top-level
  // key (Phi-3's convention) comes first; a null factor is max_position / original.
  json y = qwen_base();
  y["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  CHECK(hf(y).rope_scaling.original_max_position == 32768);
  CHECK(hf(y).max_position == 65536);
  y["original_max_position_embeddings"] = 4096;
  CHECK(hf(y).rope_scaling.original_max_position == 4096);
  CHECK(hf(y).max_position == 32768);
  y["rope_scaling"]["factor"] = nullptr;
  CHECK(hf(y).rope_scaling.factor == 8.0);
  // Both keys, describing the same scaling: fine.
  json both = q4;
  both["rope_parameters"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  CHECK(hf(both).rope_scaling == yarn(4, 32768));
}

TEST_CASE("hf config: bad RoPE values name the field - dynamic, longrope and unknown types are refused",
          "[rope][hf_config][errors]") {
  const json base = [] {
    json j = llama_base();
    j["rope_theta"] = 500000.0;
    return j;
  }();
  const json llama3 = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  const json yarn_dict = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 8192}};
  struct Bad {
    json dict;
    const char* field;
  };
  auto with = [](json d, const char* k, json v) {
    if (v.is_discarded())
      d.erase(k);
    else
      d[k] = v;
    return d;
  };
  const json gone = json(json::value_t::discarded);
  const std::vector<Bad> bad = {
      {with(llama3, "factor", -1.0), "factor'"},
      {with(llama3, "factor", 0), "factor'"},
      {with(llama3, "factor", "8"), "factor' is not a number"},
      {with(llama3, "factor", gone), "factor' is missing"},
      {with(llama3, "factor", nullptr), "factor' is missing"},
      {with(llama3, "low_freq_factor", 0.0), "low_freq_factor'"},
      {with(llama3, "low_freq_factor", gone), "low_freq_factor' is missing"},
      {with(llama3, "high_freq_factor", 1.0), "high_freq_factor'"},
      {with(llama3, "high_freq_factor", gone), "high_freq_factor' is missing"},
      {with(llama3, "original_max_position_embeddings", 0), "original_max_position_embeddings'"},
      {with(llama3, "original_max_position_embeddings", 8192.5), "original_max_position_embeddings'"},
      {with(llama3, "rope_type", 3), "rope_type' is not a string"},
      {with(yarn_dict, "factor", -4.0), "factor'"},
      {with(yarn_dict, "factor", gone), "factor' is missing"},
      {with(yarn_dict, "beta_fast", -32.0), "beta_fast'"},
      {with(yarn_dict, "beta_slow", "1"), "beta_slow' is not a number"},
      {with(yarn_dict, "attention_factor", 0.0), "attention_factor'"},
      {with(yarn_dict, "attention_factor", -1.0), "attention_factor'"},
      {with(with(yarn_dict, "mscale", 1.0), "mscale_all_dim", -20.0), "mscale_all_dim'"},
      {with(yarn_dict, "truncate", "yes"), "truncate' is not true or false"},
      {with(yarn_dict, "original_max_position_embeddings", -5), "original_max_position_embeddings'"},
  };
  for (const Bad& b : bad) {
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      CAPTURE(b.dict.dump(), key);
      json j = base;
      j[key] = b.dict;
      const std::string e = hf_error(j);
      CHECK(contains(e, std::string("'") + key + "." + b.field));
      CHECK(contains(e, "config.json"));
    }
  }
  json j = base;
  j["rope_scaling"] = "llama3";
  CHECK(contains(hf_error(j), "'rope_scaling' is not an object"));
  j = base;
  j["rope_theta"] = 1.0;
  j["rope_scaling"] = yarn_dict;
  CHECK(contains(hf_error(j), "'rope_theta'"));

  // Types kvfuse does not implement: UNIMPLEMENTED naming the key and the type.
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    for (const char* type : {"dynamic", "longrope", "su", "made-up"}) {
      CAPTURE(key, type);
      j = base;
      j[key] = {{"rope_type", type}, {"factor", 2.0}};
      const std::string e = hf_error(j, absl::StatusCode::kUnimplemented);
      CHECK(contains(e, std::string("'") + key + "'"));
      CHECK(contains(e, std::string("'") + type + "'"));
    }
  }
  j = base;
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};  // the legacy key
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "dynamic NTK"));
  j = base;
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}},
                          {"sliding_attention", {{"rope_type", "linear"}, {"factor", 2.0}}}};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "per-layer-type"));
  j = base;
  j["rope_parameters"] = {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}};
  CHECK(contains(hf_error(j, absl::StatusCode::kUnimplemented), "partial_rotary_factor"));
  // Both keys, disagreeing.
  j = base;
  j["rope_scaling"] = llama3;
  j["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  const std::string e = hf_error(j);
  CHECK(contains(e, "'rope_scaling'"));
  CHECK(contains(e, "'rope_parameters'"));
}

TEST_CASE("rope: export writes the scaling into config.json and loading reads the same spec back",
          "[rope][checkpoint]") {
  std::vector<ModelSpec> specs;
  ModelSpec s = mini_spec();
  s.rope_scaling = llama31();
  s.rope_scaling.original_max_position = 64;
  specs.push_back(s);
  s = mini_spec();
  s.rope_scaling.type = RopeType::kLinear;
  s.rope_scaling.factor = 2.5;
  specs.push_back(s);
  s = mini_spec("qwen2");
  s.rope_theta = 1000000.0f;
  s.rope_scaling = yarn(4, 2048);
  s.rope_scaling.beta_fast = 24;
  s.rope_scaling.mscale = 0.75;
  s.rope_scaling.mscale_all_dim = 0.5;
  s.rope_scaling.truncate = false;
  s.max_position = 8192;
  specs.push_back(s);
  s.rope_scaling.attention_factor = 1.1;
  specs.push_back(s);
  for (const ModelSpec& spec : specs) {
    CAPTURE(rope_type_name(spec.rope_scaling.type));
    // In memory: the config.json object ...
    const json cfg = hf_config_json(spec);
    CHECK(cfg.at("rope_scaling").at("rope_type") == rope_type_name(spec.rope_scaling.type));
    const ModelSpec back = hf(cfg);
    CHECK(back.rope_scaling == spec.rope_scaling);
    CHECK(back.rope_theta == spec.rope_theta);
    CHECK(back.max_position == spec.max_position);
    // ... and through a written checkpoint.
    TempDir dir;
    export_synthetic(dir.path(), spec, 3);
    auto loaded = load_hf_config(dir.path());
    REQUIRE(loaded.ok());
    CHECK(loaded->rope_scaling == spec.rope_scaling);
    CHECK(loaded->max_position == spec.max_position);
  }
  CHECK(hf_config_json(mini_spec()).at("rope_scaling").is_null());
}

TEST_CASE("rope: the checkpoint's scaling reaches the model's forward pass", "[rope][engine]") {
  // The same weights exported with different RoPE: a scaling whose table equals the plain
  // one gives bit-identical logits; a different table, or yarn's attention factor alone,
  // changes them.
  const ModelSpec tiny = *model_preset("tiny");
  auto logits = [&](const RopeScaling& sc) {
    ModelSpec spec = tiny;
    spec.rope_scaling = sc;
    TempDir dir;
    export_synthetic(dir.path(), spec, 5);
    auto e = make_engine({{"model_path", dir.path()}});
    const auto prompt = prompt_of(40, 1, tiny.vocab);
    return teacher_forced_logits(*e, 1, prompt, {3, 5, 7});
  };
  const auto plain_rope = logits(RopeScaling{});
  RopeScaling same = llama31();  // every wavelength of tiny (theta 1e4, D 64) < 1 << 20 / 4
  same.original_max_position = 1 << 20;
  CHECK((logits(same) == plain_rope));
  RopeScaling y = yarn(1, 64);  // factor 1: the table is the plain one, attention factor 1
  CHECK((logits(y) == plain_rope));
  y.attention_factor = 1.3;  // only cos and sin grow
  const auto scaled_attention = logits(y);
  CHECK(max_abs_diff(scaled_attention[0], plain_rope[0]) > 1e-3f);
  const auto yarn4 = logits(yarn(4, 16));
  CHECK(max_abs_diff(yarn4[0], plain_rope[0]) > 1e-3f);
  for (const auto& row : yarn4)
    for (float x : row) REQUIRE(std::isfinite(x));
}
