// kvfuse-calibrate: measures per-layer KV scales (amax / 448, e4m3fn units) over a
// prefill of prompts and writes them as a kv_scales_file (src/loading/calibration.h).
//
//   kvfuse-calibrate --set model_path=DIR --prompts prompts.json -o scales.json
//   kvfuse-run --set model_path=DIR --set kv_scales_file=scales.json
//
// prompts.json is a list of token-id lists, or {"prompts": [...]}; use text from the
// serving distribution, tokenized with the model's tokenizer. --random N draws N
// uniform-random prompts instead (a smoke test, not a calibration).
//
// The engine runs with kv_cache_dtype bf16 and without scales whatever the config says
// (the measurement needs the exact bf16 K/V); unless the config sets them, num_pages and
// max_seq_len are sized to the longest prompt, since the whole cache is scanned after
// every step.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <random>

#include "absl/strings/str_format.h"
#include "src/loading/calibration.h"
#include "tools/tool_util.h"

using namespace kvfuse;
using nlohmann::json;

namespace {
constexpr const char* kTool = "kvfuse-calibrate";
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-calibrate: per-layer KV scales from a prefill of prompts"};
  std::string config_path, prompts_path, output_path;
  std::vector<std::string> overrides;
  int random_prompts = 0, random_len = 256;
  uint64_t random_seed = 0;
  app.add_option("-c,--config", config_path, "JSON config file");
  app.add_option("-s,--set", overrides, "override a config key: key=value (repeatable), e.g. model_path=DIR");
  app.add_option("-p,--prompts", prompts_path, "JSON list of token-id lists (or {\"prompts\": [...]})");
  app.add_option("--random", random_prompts, "use N random prompts instead of --prompts")
      ->check(CLI::Range(1, 100000));
  app.add_option("--random-len", random_len, "length of each random prompt")->check(CLI::Range(1, 1 << 20));
  app.add_option("--random-seed", random_seed, "seed of the random prompts");
  app.add_option("-o,--output", output_path, "the kv_scales_file to write")->required();
  CLI11_PARSE(app, argc, argv);
  if (prompts_path.empty() == (random_prompts == 0)) {
    return tools::fail(kTool, absl::InvalidArgumentError("give exactly one of --prompts and --random"));
  }

  auto cj = tools::config_json(config_path, overrides);
  if (!cj.ok()) return tools::fail(kTool, cj.status());
  json& j = *cj;
  j["kv_cache_dtype"] = "bf16";
  j["k_scale"] = nullptr;
  j["v_scale"] = nullptr;
  j["kv_scales_file"] = "";
  auto probe = config_from_json(j);  // validates before anything is sized from it
  if (!probe.ok()) return tools::fail(kTool, probe.status());

  std::vector<std::vector<int32_t>> prompts;
  if (!prompts_path.empty()) {
    auto pj = tools::read_json_file(prompts_path);
    if (!pj.ok()) return tools::fail(kTool, pj.status());
    const json& list = pj->is_object() && pj->contains("prompts") ? pj->at("prompts") : *pj;
    auto p = tools::token_lists(list, prompts_path);
    if (!p.ok()) return tools::fail(kTool, p.status());
    prompts = std::move(*p);
  } else {
    auto spec = resolve_model_spec(*probe);
    if (!spec.ok()) return tools::fail(kTool, spec.status());
    std::mt19937_64 rng(random_seed);
    std::uniform_int_distribution<int32_t> tok(0, spec->vocab - 1);
    prompts.assign(size_t(random_prompts), std::vector<int32_t>(size_t(random_len)));
    for (auto& p : prompts) {
      for (auto& t : p) t = tok(rng);
    }
  }
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  if (!j.contains("max_seq_len")) j["max_seq_len"] = std::max<int64_t>(2, int64_t(longest) + 1);
  if (!j.contains("num_pages")) {
    j["num_pages"] = (int64_t(longest) + probe->page_size - 1) / probe->page_size + 1;
  }
  auto cfg = config_from_json(j);
  if (!cfg.ok()) return tools::fail(kTool, cfg.status());

  auto engine = Engine::create(*cfg);
  if (!engine.ok()) return tools::fail(kTool, engine.status());
  auto amax = measure_kv_amax(**engine, prompts);
  if (!amax.ok()) return tools::fail(kTool, amax.status());
  const KvScales scales = scales_from_amax(*amax);
  const std::string model = cfg->model_path.empty() ? cfg->model : cfg->model_path;
  const json out = kv_scales_file_json(*amax, scales, model);
  if (absl::Status st = tools::write_text_file(output_path, out.dump(2) + "\n"); !st.ok())
    return tools::fail(kTool, st);
  std::fprintf(stderr, "%s: %d prompts, %lld tokens, %zu layers -> %s\n", kTool, amax->num_prompts,
               static_cast<long long>(amax->num_tokens), scales.k.size(), output_path.c_str());
  for (size_t l = 0; l < scales.k.size(); ++l) {
    std::fprintf(stderr, "  layer %3zu  k_amax %10.4g  k_scale %10.4g  v_amax %10.4g  v_scale %10.4g\n", l,
                 amax->k[l], scales.k[l], amax->v[l], scales.v[l]);
  }
  return 0;
}
