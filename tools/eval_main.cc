// kvfuse-eval: loads an engine from a config (typically --set model_path=DIR) and prints,
// as JSON, the greedy continuation and the logits of given prompts. It is the kvfuse side
// of tests/hf_reference.py, and a quick way to inspect a checkpoint.
//
// Input (--input FILE): a list of prompts [[ids...], ...], or
//   {"prompts": [[ids...], ...],
//    "steps": 32,                  greedy tokens per prompt (default 32)
//    "forced": [[ids...], ...]}    optional, one list per prompt: teacher-forced tokens
// Output (stdout, or --output FILE):
//   {"model": {...spec...}, "backend": "...", "kv_dtype": "...", "k_scale": [...],
//    "v_scale": [...] (the device scales in use), "results": [{
//      "prompt_len": n, "greedy": [ids], "prompt_logits": [vocab floats at the last
//      prompt position], "forced_logits": [[vocab floats], ...] (row j predicts forced[j]:
//      the prompt is prefilled, then forced tokens are fed one per decode step)}]}
// Sequences run one at a time, so the output does not depend on batching.
//
// --export-synthetic DIR writes the config's synthetic preset (model, seed, window
// overrides) as a Hugging Face directory instead, to try the loader without a download.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/loading/checkpoint.h"
#include "src/loading/hf_config.h"
#include "src/runtime/engine.h"
#include "tools/tool_util.h"

using namespace kvfuse;
using nlohmann::json;

namespace {

constexpr const char* kTool = "kvfuse-eval";

// Steps `id` through its pending tokens in chunks of max_batch_tokens; the last step
// samples (when `sample`) or returns logits. Returns the last step's result.
absl::StatusOr<StepResult> run_pending(Engine& e, SeqId id, bool sample) {
  const int32_t chunk = e.config().max_batch_tokens;
  for (;;) {
    const int32_t pending = e.sequence(id)->num_pending();
    const bool last = pending <= chunk;
    auto r = e.step({StepItem{id, last ? pending : chunk, last && sample, last}});
    if (!r.ok()) return r.status();
    if (!(*r)[0].status.ok()) return (*r)[0].status;
    if (last) return (*r)[0];
  }
}

std::vector<float> logits_row(const Engine& e, const StepResult& r) {
  const size_t vocab = size_t(e.spec().vocab);
  const float* p = e.last_logits().data() + size_t(r.logits_row) * vocab;
  return std::vector<float>(p, p + vocab);
}

absl::StatusOr<json> evaluate(Engine& e, const std::vector<int32_t>& prompt, int steps,
                              const std::vector<int32_t>* forced) {
  json out = {{"prompt_len", prompt.size()}};
  SeqId id = 1;
  KVFUSE_RETURN_IF_ERROR(e.add_sequence(id, prompt, SamplingParams{}));
  std::vector<int32_t> greedy;
  for (int i = 0; i < steps; ++i) {
    auto r = run_pending(e, id, /*sample=*/true);
    if (!r.ok()) return r.status();
    if (i == 0) out["prompt_logits"] = logits_row(e, *r);
    greedy.push_back(*r->token);
  }
  KVFUSE_RETURN_IF_ERROR(e.release(id));
  out["greedy"] = greedy;

  if (forced) {
    id = 2;
    KVFUSE_RETURN_IF_ERROR(e.add_sequence(id, prompt, SamplingParams{}));
    json rows = json::array();
    for (size_t j = 0; j < forced->size(); ++j) {
      auto r = run_pending(e, id, /*sample=*/false);
      if (!r.ok()) return r.status();
      rows.push_back(logits_row(e, *r));
      if (j + 1 == forced->size()) break;
      KVFUSE_RETURN_IF_ERROR(e.append_tokens(id, {(*forced)[j]}));
    }
    KVFUSE_RETURN_IF_ERROR(e.release(id));
    out["forced_logits"] = std::move(rows);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-eval: greedy tokens and logits of prompts as JSON"};
  std::string config_path, input_path, output_path, export_dir;
  std::vector<std::string> overrides;
  app.add_option("-c,--config", config_path, "JSON config file");
  app.add_option("-s,--set", overrides, "override a config key: key=value (repeatable), e.g. model_path=DIR");
  app.add_option("-i,--input", input_path, "JSON input: prompts, steps, forced");
  app.add_option("-o,--output", output_path, "write the JSON here instead of stdout");
  app.add_option("--export-synthetic", export_dir,
                 "write the synthetic preset as a checkpoint directory and exit");
  CLI11_PARSE(app, argc, argv);

  auto cj = tools::config_json(config_path, overrides);
  if (!cj.ok()) return tools::fail(kTool, cj.status());
  auto cfg = config_from_json(*cj);
  if (!cfg.ok()) return tools::fail(kTool, cfg.status());
  if (!export_dir.empty()) {
    if (!cfg->model_path.empty()) {
      return tools::fail(kTool,
                         absl::InvalidArgumentError("--export-synthetic exports a preset; unset model_path"));
    }
    auto spec = resolve_model_spec(*cfg);
    if (!spec.ok()) return tools::fail(kTool, spec.status());
    auto weights = make_synthetic_weights(*spec, cfg->seed);
    if (absl::Status st = export_checkpoint(export_dir, *spec, *weights); !st.ok())
      return tools::fail(kTool, st);
    return 0;
  }
  if (input_path.empty()) return tools::fail(kTool, absl::InvalidArgumentError("--input is required"));
  auto input = tools::read_json_file(input_path);
  if (!input.ok()) return tools::fail(kTool, input.status());
  // A bare list of prompts, as kvfuse-calibrate takes, stands for {"prompts": [...]}.
  if (input->is_array()) *input = json{{"prompts", std::move(*input)}};
  if (!input->is_object() || !input->contains("prompts")) {
    return tools::fail(
        kTool, absl::InvalidArgumentError(input_path + ": needs a list of prompts, or an object with a "
                                                       "\"prompts\" list"));
  }
  auto prompts = tools::token_lists(input->at("prompts"), input_path + ": prompts");
  if (!prompts.ok()) return tools::fail(kTool, prompts.status());
  std::vector<std::vector<int32_t>> forced;
  if (input->contains("forced")) {
    auto f = tools::token_lists(input->at("forced"), input_path + ": forced");
    if (!f.ok()) return tools::fail(kTool, f.status());
    if (f->size() != prompts->size()) {
      return tools::fail(kTool,
                         absl::InvalidArgumentError(input_path + ": forced needs one list per prompt"));
    }
    forced = std::move(*f);
  }
  const json steps_j = input->value("steps", json(32));
  if (!steps_j.is_number_integer() || steps_j.get<int64_t>() < 1 || steps_j.get<int64_t>() > 100000) {
    return tools::fail(kTool,
                       absl::InvalidArgumentError(input_path + ": steps must be an integer in [1, 100000]"));
  }

  auto engine = Engine::create(*cfg);
  if (!engine.ok()) return tools::fail(kTool, engine.status());
  Engine& e = **engine;
  const ModelSpec& s = e.spec();
  json out = {{"model",
               {{"name", s.name},
                {"arch", s.arch},
                {"vocab", s.vocab},
                {"hidden", s.hidden},
                {"num_layers", s.num_layers},
                {"num_q_heads", s.num_q_heads},
                {"num_kv_heads", s.num_kv_heads},
                {"head_dim", s.head_dim},
                {"rope_theta", s.rope_theta},
                {"rope_scaling", rope_scaling_json(s.rope_scaling)},
                {"max_position", s.max_position},
                {"rms_eps", s.rms_eps},
                {"tie_embeddings", s.tie_embeddings},
                {"qkv_bias", s.qkv_bias},
                {"sliding_window", s.sliding_window},
                {"layer_is_swa", s.layer_is_swa}}},
              {"backend", e.backend().description()},
              {"kv_dtype", kv_format_name(e.kv_format())},
              {"k_scale", e.pool().config().k_scale},
              {"v_scale", e.pool().config().v_scale},
              {"results", json::array()}};
  for (size_t i = 0; i < prompts->size(); ++i) {
    auto r = evaluate(e, (*prompts)[i], int(steps_j.get<int64_t>()), forced.empty() ? nullptr : &forced[i]);
    if (!r.ok()) {
      return tools::fail(
          kTool, absl::Status(r.status().code(), absl::StrCat("prompt ", i, ": ", r.status().message())));
    }
    out["results"].push_back(std::move(*r));
  }
  const std::string text = out.dump() + "\n";
  if (output_path.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (absl::Status st = tools::write_text_file(output_path, text); !st.ok()) return tools::fail(kTool, st);
  return 0;
}
