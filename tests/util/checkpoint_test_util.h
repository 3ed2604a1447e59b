// Helpers of the loader tests: temporary directories, small specs, exporting synthetic
// weights as a checkpoint, and rewriting a checkpoint's tensors to corrupt it.
#pragma once

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "tests/util/catch.h"

#include "src/loading/checkpoint.h"
#include "src/loading/hf_config.h"
#include "src/loading/model_spec.h"
#include "src/loading/safetensors.h"

namespace kvfuse::testing {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "kvfuse-test-XXXXXX").string();
    REQUIRE(mkdtemp(t.data()) != nullptr);
    path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const {
    return (std::filesystem::path(path_) / name).string();
  }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(f.good());
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A Llama-shaped spec small enough that a checkpoint is a few KB: GQA 2:1, head_dim 16.
inline ModelSpec mini_spec(const std::string& arch = "llama") {
  ModelSpec s;
  s.name = "mini";
  s.arch = arch;
  s.vocab = 64;
  s.hidden = 32;
  s.intermediate = 48;
  s.num_layers = 2;
  s.num_q_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = 16;
  s.rope_theta = 10000.0f;
  s.rms_eps = 1e-5f;
  s.qkv_bias = arch == "qwen2";
  s.layer_is_swa.assign(2, false);
  s.max_position = 4096;
  return s;
}

// Exports the synthetic weights of `spec` (seed) as a checkpoint in `dir`.
inline void export_synthetic(const std::string& dir, const ModelSpec& spec, uint64_t seed,
                             const ExportOptions& opts = {}) {
  auto w = make_synthetic_weights(spec, seed);
  const absl::Status st = export_checkpoint(dir, spec, *w, opts);
  INFO(st.ToString());
  REQUIRE(st.ok());
}

// Reads every tensor of a safetensors file, lets `edit` change the list, writes it back.
inline void rewrite_tensors(const std::string& path,
                            const std::function<void(std::vector<StWriteTensor>&)>& edit) {
  std::vector<StWriteTensor> all;
  {
    auto f = SafetensorsFile::open(path);
    INFO(f.status().ToString());
    REQUIRE(f.ok());
    for (const StTensorInfo& t : (*f)->header().tensors) {
      const uint8_t* p = (*f)->data(t);
      all.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(p, p + (t.end - t.begin))});
    }
  }
  edit(all);
  REQUIRE(write_safetensors(path, all).ok());
}

inline StWriteTensor* tensor_named(std::vector<StWriteTensor>& all, const std::string& name) {
  for (auto& t : all) {
    if (t.name == name) return &t;
  }
  FAIL("no tensor " << name);
  return nullptr;
}

inline StWriteTensor f32_scalar(const std::string& name, float x) {
  return {name, StDtype::F32, {}, bytes_of(std::vector<float>{x})};
}

// The error message of a checkpoint that must fail to open.
inline std::string open_error(const std::string& dir) {
  auto c = Checkpoint::open(dir);
  REQUIRE_FALSE(c.ok());
  return std::string(c.status().message());
}

// Llama 3 8B's config.json (plain RoPE, 8192 positions), as transformers 4.x writes it.
inline nlohmann::json llama3_8b_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 4096},
          {"intermediate_size", 14336},
          {"num_attention_heads", 32},
          {"num_hidden_layers", 32},
          {"num_key_value_heads", 8},
          {"rms_norm_eps", 1e-05},
          {"rope_scaling", nullptr},
          {"rope_theta", 500000.0},
          {"max_position_embeddings", 8192},
          {"tie_word_embeddings", false},
          {"vocab_size", 128256},
          {"attention_bias", false},
          {"hidden_act", "silu"}};
}

// The spec an HF config.json gives (the parse must succeed), or the message of its
// error (the parse must fail with `code`).
inline ModelSpec hf(const nlohmann::json& j) {
  auto s = spec_from_hf_config(j, "config.json", "m");
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return *s;
}

inline std::string hf_error(const nlohmann::json& j, absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  auto s = spec_from_hf_config(j, "config.json", "m");
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().code() == code);
  return std::string(s.status().message());
}

}  // namespace kvfuse::testing
