// libFuzzer target: the safetensors header parser, the shard index parser, and the
// checkpoint loader behind them. Built and run by scripts/ci/fuzz.sh (clang only).
//
// Each input is parsed as a safetensors file held in memory; the parser must either
// reject it or return tensors that lie inside the buffer. Inputs that parse are then
// written as the model.safetensors of a micro checkpoint (config.json from
// LLVMFuzzerInitialize) and loaded: validation against the architecture, KV and weight
// scales, and conversion of every weight to bf16 must fail cleanly or succeed.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "src/loading/checkpoint.h"
#include "src/loading/safetensors.h"

namespace {

std::string g_dir;

// One layer, GQA 2:1, head_dim 4: tensors of a few dozen bytes (scripts/ci/fuzz.sh
// writes a valid model.safetensors of this shape as a seed).
constexpr const char* kConfig = R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
  "head_dim": 4, "tie_word_embeddings": true})";

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/kvfuse-fuzz-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::abort();
  g_dir = tmpl;
  std::ofstream(g_dir + "/config.json") << kConfig;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(g_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)kvfuse::parse_safetensors_index(absl::string_view(reinterpret_cast<const char*>(data), size),
                                        "fuzz.json");
  auto h = kvfuse::parse_safetensors(data, size, "fuzz.safetensors");
  if (!h.ok()) return 0;
  uint64_t sum = 0;
  for (const kvfuse::StTensorInfo& t : h->tensors) {
    if (h->data_start + t.end > size || t.begin > t.end) __builtin_trap();  // the parser's promise
    if (t.end > t.begin) sum += data[h->data_start + t.end - 1];            // readable to its last byte
    if (h->find(t.name) == nullptr) __builtin_trap();
  }
  (void)sum;

  std::ofstream(g_dir + "/model.safetensors", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  auto c = kvfuse::Checkpoint::open(g_dir);
  if (!c.ok()) return 0;
  auto w = (*c)->weights();
  kvfuse::HostGlobalWeights g;
  (void)w->globals(g);
  for (int32_t l = 0; l < (*c)->spec().num_layers; ++l) {
    kvfuse::HostLayerWeights L;
    (void)w->layer(l, L);
  }
  return 0;
}
