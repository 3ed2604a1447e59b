// libFuzzer target: the config parsers. Built and run by scripts/ci/fuzz.sh (clang only).
//
// Each input is tried as a kvfuse config (and, when it is accepted, must survive
// config_to_json -> config_from_json unchanged), as a Hugging Face config.json (an
// accepted one must give a consistent ModelSpec), as a kv_scales_file, and as a
// --set key=value override.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "src/loading/config.h"
#include "src/loading/hf_config.h"
#include "src/loading/kv_scales.h"
#include "src/loading/model_spec.h"

using nlohmann::json;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded()) {
    auto c = kvfuse::config_from_json(j);
    if (c.ok()) {
      const json back = kvfuse::config_to_json(*c);
      auto again = kvfuse::config_from_json(back);
      if (!again.ok() || kvfuse::config_to_json(*again) != back) __builtin_trap();
      // Paths from the input are not opened: a fuzzer must not read arbitrary files.
      c->model_path.clear();
      c->kv_scales_file.clear();
      (void)kvfuse::resolve_model_spec(*c);
    }
    auto s = kvfuse::spec_from_hf_config(j, "fuzz/config.json", "fuzz");
    if (s.ok()) {
      if (s->head_dim <= 0 || s->head_dim % 2 || s->num_q_heads % s->num_kv_heads ||
          s->layer_is_swa.size() != size_t(s->num_layers) || (s->sliding_window > 0) != s->any_swa()) {
        __builtin_trap();
      }
    }
    (void)kvfuse::kv_scales_from_json(j, "fuzz/scales.json", 4);
  }
  json o = json::object();
  if (kvfuse::apply_config_override(o, text).ok()) (void)kvfuse::config_from_json(o);
  return 0;
}
