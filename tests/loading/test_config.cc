// Config loading: every key validated, clear errors, overrides, the shipped files.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include "tests/util/catch.h"

#include "src/backends/backend.h"
#include "src/loading/config.h"
#include "src/loading/config_docs.h"
#include "src/loading/model_spec.h"
#include "src/runtime/memory_plan.h"
#include "tests/util/checkpoint_test_util.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;
using nlohmann::json;

namespace {
std::string error_of(const json& j) {
  auto c = config_from_json(j);
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// What config_from_json (or load_config_file) says of a config: "accepted", or the
// message it refuses it with, its code checked to be INVALID_ARGUMENT. Unlike error_of,
// an accepted config does not end the test case: each source is checked on its own.
std::string verdict(const absl::StatusOr<Config>& c) {
  if (c.ok()) return "accepted";
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

// An environment variable set for a scope; what it was (or its absence) comes back after.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::string name) : name_(std::move(name)) {
    if (const char* v = std::getenv(name_.c_str())) old_ = v;
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  void set(const std::string& value) { REQUIRE(setenv(name_.c_str(), value.c_str(), 1) == 0); }

 private:
  std::string name_;
  std::optional<std::string> old_;
};
}  // namespace

TEST_CASE("config: defaults, and every key round-trips through JSON", "[config]") {
  auto c = config_from_json(json::object());
  REQUIRE(c.ok());
  CHECK(c->model == "tiny");
  CHECK(c->kv_cache_dtype == KvCacheDtype::fp8_e4m3);
  CHECK(c->kv_write == KvWritePath::fused);
  CHECK(c->overlap_fanout);
  const json j = config_to_json(*c);
  for (const auto& d : config_key_docs()) CHECK(j.contains(d.key));
  auto again = config_from_json(j);
  REQUIRE(again.ok());
  CHECK(config_to_json(*again) == j);
}

TEST_CASE("config: bad values name the key and the allowed values", "[config][errors]") {
  std::string e = error_of({{"kv_write", "fuse"}});
  CHECK(contains(e, "kv_write"));
  CHECK(contains(e, "fused"));
  CHECK(contains(e, "unfused"));
  CHECK(contains(e, "fused_rope"));
  e = error_of({{"kv_write", "rope"}});
  CHECK(contains(e, "'kv_write'"));
  CHECK(contains(e, "\"rope\" is not one of fused, fused_rope, unfused"));
  e = error_of({{"kv_cache_dtype", "fp8"}});
  CHECK(contains(e, "kv_cache_dtype"));
  CHECK(contains(e, "fp8_e4m3"));
  e = error_of({{"attention", 3}});
  CHECK(contains(e, "attention"));
  e = error_of({{"page_size", 0}});
  CHECK(contains(e, "page_size"));
  e = error_of({{"page_size", 16.5}});
  CHECK(contains(e, "integer"));
  e = error_of({{"k_scale", -1.0}});
  CHECK(contains(e, "k_scale"));
  e = error_of({{"v_scale", json::array()}});
  CHECK(contains(e, "v_scale"));
  e = error_of({{"model", "gpt-5"}});
  CHECK(contains(e, "llama3-8b"));
  e = error_of({{"swa_layers", "some"}});
  CHECK(contains(e, "alternate"));
  e = error_of({{"overlap_fanout", true}});
  CHECK(contains(e, "'overlap_fanout'"));
  CHECK(contains(e, "on"));
  auto off = config_from_json({{"overlap_fanout", "off"}});
  REQUIRE(off.ok());
  CHECK_FALSE(off->overlap_fanout);
  e = error_of({{"kv_wrte", "fused"}});
  CHECK(contains(e, "unknown key 'kv_wrte'"));
  e = error_of(json::array());
  CHECK(contains(e, "object"));
}

TEST_CASE("config: overrides and model-dependent checks", "[config]") {
  json j = json::object();
  REQUIRE(apply_config_override(j, "kv_write=unfused").ok());
  REQUIRE(apply_config_override(j, "page_size=32").ok());
  REQUIRE(apply_config_override(j, "k_scale=[0.5,1,1,1]").ok());
  CHECK_FALSE(apply_config_override(j, "no-equals").ok());
  auto c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->kv_write == KvWritePath::unfused);
  CHECK(c->page_size == 32);
  {
    json r = j;
    REQUIRE(apply_config_override(r, "kv_write=fused_rope").ok());
    auto cr = config_from_json(r);
    REQUIRE(cr.ok());
    CHECK(cr->kv_write == KvWritePath::fused_rope);
    CHECK(config_to_json(*cr)["kv_write"] == "fused_rope");
    CHECK(std::string(to_string(KvWritePath::fused_rope)) == "fused_rope");
  }
  CHECK(c->k_scale.size() == 4);
  CHECK(resolve_model_spec(*c).ok());

  c->k_scale = {1, 2};
  CHECK_FALSE(resolve_model_spec(*c).ok());
  c->k_scale = {1};
  c->swa_layers = "list";
  c->swa_layer_list = {0, 9};
  auto s = resolve_model_spec(*c);
  REQUIRE_FALSE(s.ok());
  CHECK(contains(std::string(s.status().message()), "swa_layers"));
  c->swa_layer_list = {1, 3};
  s = resolve_model_spec(*c);
  REQUIRE_FALSE(s.ok());  // tiny has no window of its own
  CHECK(contains(std::string(s.status().message()), "sliding_window"));
  c->sliding_window = 64;
  s = resolve_model_spec(*c);
  REQUIRE(s.ok());
  CHECK(s->layer_is_swa == std::vector<bool>{false, true, false, true});

  auto m = model_preset("mistral-7b");
  REQUIRE(m.ok());
  CHECK(m->sliding_window == 4096);
  CHECK(m->any_swa());
  auto q = model_preset("qwen2.5-7b");
  REQUIRE(q.ok());
  CHECK(q->qkv_bias);
  auto l = model_preset("llama3-8b");
  REQUIRE(l.ok());
  CHECK(l->num_params() > 7'900'000'000);
  CHECK(l->num_params() < 8'100'000'000);
  auto big = model_preset("llama3-70b");  // Llama 3.1 70B: 70.6 B parameters
  REQUIRE(big.ok());
  CHECK(big->num_params() > 70'000'000'000);
  CHECK(big->num_params() < 71'000'000'000);
  CHECK(check_tensor_parallel(*big, 2).ok());
  CHECK(check_tensor_parallel(*big, 8).ok());
}

// A shipped config that serves a checkpoint names it as /models/<name>, the folder an
// operator mounts; tests/data/checkpoints/<name> holds that checkpoint's config.json. A
// config whose file name starts with a GPU's name must fit that GPU: the model's weights,
// the pool and the headroom within its memory (these configs are validated here, not run).
TEST_CASE("config: every shipped config/*.json loads", "[config]") {
  const std::map<std::string, int64_t> gpu_bytes = {{"mi300x", 192'000'000'000}, {"mi355x", 288'000'000'000},
                                                    {"h200", 141'000'000'000}, {"nvidia", 141'000'000'000}};
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(KVFUSE_SOURCE_DIR "/config")) {
    if (f.path().extension() != ".json") continue;
    CAPTURE(f.path().string());
    auto c = load_config_file(f.path().string());
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    if (!c->model_path.empty()) {
      const std::string name = std::filesystem::path(c->model_path).filename().string();
      CHECK(c->model_path == "/models/" + name);
      c->model_path = KVFUSE_SOURCE_DIR "/tests/data/checkpoints/" + name;
    }
    auto spec = resolve_model_spec(*c);
    INFO(spec.status().ToString());
    REQUIRE(spec.ok());
    const std::string file = f.path().filename().string();
    for (const auto& [gpu, bytes] : gpu_bytes) {
      if (file.rfind(gpu, 0) != 0 || c->num_pages == 0) continue;
      const int64_t pool =
          kv_pool_bytes(*spec, c->page_size, kv_format_for(c->kv_cache_dtype, false), c->num_pages, 0);
      const int64_t need = spec->weight_bytes() + pool + (c->memory_headroom_mib << 20);
      CAPTURE(gpu, spec->weight_bytes(), pool, need, bytes);
      CHECK(need < bytes);
    }
    ++n;
  }
  CHECK(n >= 1);
  auto missing = load_config_file("/nonexistent/kvfuse.json");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
}

// config/cpu-default.json is the server's default config (scripts/serve.sh, the CPU
// image): it names the CPU and otherwise restates no default differently, so that the
// built-in defaults (what kvfuse-run and kvfuse-server take without --config) are the one
// source of every value, the KV pool's included.
TEST_CASE("config: the CPU default config differs from the built-in defaults only in the device",
          "[config]") {
  auto file = load_config_file(KVFUSE_SOURCE_DIR "/config/cpu-default.json");
  REQUIRE(file.ok());
  auto built_in = config_from_json(json{{"device", "cpu"}});
  REQUIRE(built_in.ok());
  CHECK(file->num_pages == built_in->num_pages);
  CHECK(config_to_json(*file) == config_to_json(*built_in));
}

// docs/configuration.md carries the key and switch tables exactly as the code renders
// them, so that a key, range, default or switch changed in the code fails here until the
// page is regenerated.
TEST_CASE("config: docs/configuration.md carries the generated key and switch tables", "[config][docs]") {
  std::ifstream in(KVFUSE_SOURCE_DIR "/docs/configuration.md");
  REQUIRE(in);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string begin = "<!-- generated by kvfuse-server --config-keys=markdown: begin -->\n";
  const std::string end = "<!-- generated by kvfuse-server --config-keys=markdown: end -->";
  const size_t b = text.find(begin);
  REQUIRE(b != std::string::npos);
  const size_t e = text.find(end, b);
  REQUIRE(e != std::string::npos);
  const std::string block = text.substr(b + begin.size(), e - b - begin.size());
  const std::string want = config_keys_markdown();
  // The first line that differs, rather than both tables whole.
  std::istringstream page_lines(block), code_lines(want);
  std::string page_line, code_line;
  int line = 0;
  while (true) {
    const bool more_page = bool(std::getline(page_lines, page_line));
    const bool more_code = bool(std::getline(code_lines, code_line));
    ++line;
    if (!more_page && !more_code) break;
    if (more_page != more_code || page_line != code_line) {
      if (!more_page) page_line = "(end of the block)";
      if (!more_code) code_line = "(end of the tables)";
      break;
    }
  }
  INFO("docs/configuration.md's generated tables differ from the code's at line "
       << line << " of the block:\n  page: " << page_line << "\n  code: " << code_line
       << "\nRegenerate them: replace everything between the begin and end markers with the output of\n"
          "  ./build/kvfuse-server --config-keys=markdown");
  const bool same = block == want;
  CHECK(same);
}

TEST_CASE("config: keys with dashes, and KVFUSE_<KEY> environment variables under the command line",
          "[config]") {
  // Both spellings, in a file and in an override; the later override wins over either.
  json j = {{"kv-write", "unfused"}, {"num_pages", 64}};
  auto c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->kv_write == KvWritePath::unfused);
  CHECK(contains(error_of({{"kv-write", "unfused"}, {"kv_write", "fused"}}), "set twice"));
  REQUIRE(apply_config_override(j, "kv_write=fused").ok());
  REQUIRE(config_from_json(j).ok());
  CHECK(config_from_json(j)->kv_write == KvWritePath::fused);
  REQUIRE(apply_config_override(j, "max-seq-len=128").ok());
  CHECK(config_from_json(j)->max_seq_len == 128);

  CHECK(config_env_name("kv_write") == "KVFUSE_KV_WRITE");
  CHECK(config_env_name("max-seq-len") == "KVFUSE_MAX_SEQ_LEN");
  // file < environment < command line
  json layered = {{"kv_write", "fused"}, {"page_size", 32}, {"num_pages", 64}};
  setenv("KVFUSE_KV_WRITE", "unfused", 1);
  setenv("KVFUSE_PAGE_SIZE", "8", 1);
  REQUIRE(apply_config_env(layered).ok());
  REQUIRE(apply_config_override(layered, "page_size=64").ok());
  unsetenv("KVFUSE_KV_WRITE");
  unsetenv("KVFUSE_PAGE_SIZE");
  auto lc = config_from_json(layered);
  REQUIRE(lc.ok());
  CHECK(lc->kv_write == KvWritePath::unfused);
  CHECK(lc->page_size == 64);
  CHECK(lc->num_pages == 64);
}

TEST_CASE("config: tensor-parallel keys (tensor_parallel, devices, tp_rendezvous, tp_rank)", "[config][tp]") {
  auto c = config_from_json(json::object());
  REQUIRE(c.ok());
  CHECK(c->tensor_parallel == 1);
  CHECK(c->devices.empty());
  CHECK(c->tp_rendezvous.empty());
  CHECK(c->tp_local_ranks() == 1);

  c = config_from_json({{"tensor_parallel", 4}});
  REQUIRE(c.ok());
  CHECK(c->tp_local_ranks() == 4);
  CHECK(c->tp_device(3) == 3);
  c = config_from_json({{"tensor_parallel", 2}, {"devices", {6, 7}}});
  REQUIRE(c.ok());
  CHECK(c->tp_device(1) == 7);
  // The command line and the environment spell a list as "6,7".
  c = config_from_json({{"tensor_parallel", 2}, {"devices", "6,7"}});
  REQUIRE(c.ok());
  CHECK(c->devices == std::vector<int32_t>{6, 7});

  CHECK(contains(error_of({{"tensor_parallel", 0}}), "config key 'tensor_parallel'"));
  CHECK(contains(error_of({{"tensor_parallel", "2"}}), "'tensor_parallel'"));
  std::string e = error_of({{"tensor_parallel", 2}, {"devices", {0, 1, 2}}});
  CHECK(contains(e, "config key 'devices'"));
  CHECK(contains(e, "3 GPU(s) listed for tensor_parallel 2"));
  e = error_of({{"tensor_parallel", 2}, {"devices", {1, 1}}});
  CHECK(contains(e, "'devices'"));
  CHECK(contains(e, "GPU 1 is listed twice"));
  CHECK(contains(error_of({{"devices", {-1}}}), "'devices'"));
  CHECK(contains(error_of({{"devices", "0,x"}}), "'devices'"));
  CHECK(contains(error_of({{"devices", "0,,1"}}), "'0,,1' has an empty item"));
  CHECK(contains(error_of({{"devices", 1024}}), "'devices'"));
  CHECK(contains(error_of({{"devices", 1.5}}), "'devices'"));
  CHECK(contains(error_of({{"tp_rank", 1}}), "config key 'tp_rank': set only with tp_rendezvous"));

  // Several processes: each lists its own GPUs and its first rank.
  c = config_from_json(
      {{"tensor_parallel", 4}, {"tp_rendezvous", "node0:29500"}, {"tp_rank", 2}, {"devices", {0, 1}}});
  REQUIRE(c.ok());
  CHECK(c->tp_local_ranks() == 2);
  c = config_from_json({{"tensor_parallel", 4}, {"tp_rendezvous", "node0:29500"}, {"tp_rank", 3}});
  REQUIRE(c.ok());
  CHECK(c->tp_local_ranks() == 1);
  e = error_of(
      {{"tensor_parallel", 4}, {"tp_rendezvous", "node0:29500"}, {"tp_rank", 3}, {"devices", {0, 1}}});
  CHECK(contains(e, "'devices'"));
  CHECK(contains(e, "go past tensor_parallel 4"));
  CHECK(
      contains(error_of({{"tensor_parallel", 4}, {"tp_rendezvous", "node0"}}), "config key 'tp_rendezvous'"));
  CHECK(contains(error_of({{"tensor_parallel", 4}, {"tp_rendezvous", "node0:0"}}), "'tp_rendezvous'"));
  CHECK(
      contains(error_of({{"tp_rendezvous", "node0:29500"}}), "'tp_rendezvous': needs tensor_parallel >= 2"));
  CHECK(contains(error_of({{"tensor_parallel", 2}, {"tp_rendezvous", "n:1"}, {"tp_rank", 2}}), "'tp_rank'"));
  CHECK(contains(error_of({{"tp_rendezvous_timeout_s", 0}}), "'tp_rendezvous_timeout_s'"));

  // Round trip, and the environment.
  c = config_from_json({{"tensor_parallel", 2}, {"devices", {3, 5}}});
  REQUIRE(c.ok());
  auto again = config_from_json(config_to_json(*c));
  REQUIRE(again.ok());
  CHECK(again->devices == std::vector<int32_t>{3, 5});
  json j = json::object();
  REQUIRE(apply_config_override(j, "devices=2,3").ok());
  REQUIRE(apply_config_override(j, "tensor-parallel=2").ok());
  c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->devices == std::vector<int32_t>{2, 3});
  // One GPU per process (--set devices=1, KVFUSE_DEVICES=1): the value reads as a number.
  j = json::object();
  REQUIRE(apply_config_override(j, "devices=1").ok());
  REQUIRE(apply_config_override(j, "tensor_parallel=2").ok());
  REQUIRE(apply_config_override(j, "tp_rendezvous=node0:29500").ok());
  REQUIRE(apply_config_override(j, "tp_rank=1").ok());
  c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->devices == std::vector<int32_t>{1});
  CHECK(c->tp_device(0) == 1);
  c = config_from_json({{"devices", 3}});
  REQUIRE(c.ok());
  CHECK(c->devices == std::vector<int32_t>{3});
}

TEST_CASE("config: tp_allreduce (auto, nccl, push): default, values, errors, environment", "[config][tp]") {
  auto c = config_from_json(json::object());
  REQUIRE(c.ok());
  CHECK(c->tp_allreduce == TpAllReduce::auto_);
  CHECK(config_to_json(*c)["tp_allreduce"] == "auto");
  c = config_from_json({{"tp_allreduce", "nccl"}, {"tensor_parallel", 2}});
  REQUIRE(c.ok());
  CHECK(c->tp_allreduce == TpAllReduce::nccl);
  auto again = config_from_json(config_to_json(*c));
  REQUIRE(again.ok());
  CHECK(again->tp_allreduce == TpAllReduce::nccl);
  c = config_from_json({{"tp_allreduce", "push"}, {"tensor_parallel", 2}});
  REQUIRE(c.ok());
  CHECK(c->tp_allreduce == TpAllReduce::push);
  CHECK(config_to_json(*c)["tp_allreduce"] == "push");
  again = config_from_json(config_to_json(*c));
  REQUIRE(again.ok());
  CHECK(again->tp_allreduce == TpAllReduce::push);
  std::string e = error_of({{"tp_allreduce", "peer"}});
  CHECK(contains(e, "config key 'tp_allreduce'"));
  CHECK(contains(e, "auto, nccl, push"));
  CHECK(contains(error_of({{"tp_allreduce", 1}}), "'tp_allreduce'"));
  // KVFUSE_TP_ALLREDUCE=nccl, and --set tp-allreduce=auto above it.
  json j = json::object();
  setenv("KVFUSE_TP_ALLREDUCE", "nccl", 1);
  const absl::Status env = apply_config_env(j);
  unsetenv("KVFUSE_TP_ALLREDUCE");
  REQUIRE(env.ok());
  c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->tp_allreduce == TpAllReduce::nccl);
  REQUIRE(apply_config_override(j, "tp-allreduce=auto").ok());
  c = config_from_json(j);
  REQUIRE(c.ok());
  CHECK(c->tp_allreduce == TpAllReduce::auto_);
}

TEST_CASE("config: every model preset of the model registry is accepted by name", "[config]") {
  // llama3-70b (the tensor-parallel preset) was missing from the config's list, so
  // `kvfuse-run --set model=llama3-70b` was refused although the registry has it.
  for (const char* name : {"tiny", "llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b", "hybrid-swa"}) {
    json j = json::object();
    REQUIRE(apply_config_override(j, std::string("model=") + name).ok());
    auto c = config_from_json(j);
    INFO(name);
    REQUIRE(c.ok());
    CHECK(c->model == name);
  }
}

TEST_CASE("config: k_scale and v_scale of 0, below 0, NaN or infinite are refused from every source, named",
          "[config][errors]") {
  // The pool would refuse such a scale only when the engine starts (KvPool::set_scales);
  // the parser refuses it first, from a program's JSON, a file, --set or the environment.
  for (const std::string key : {"k_scale", "v_scale"}) {
    CAPTURE(key);
    const std::string named = "config key '" + key + "'";
    // JSON a program builds: NaN and the infinities too, which JSON text cannot spell.
    for (double bad : {0.0, -0.0, -1.0, -1e-30, double(NAN), double(INFINITY), -double(INFINITY)}) {
      CAPTURE(bad);
      CHECK_THAT(verdict(config_from_json({{key, bad}})), ContainsSubstring(named));
      // One scale per layer, one of them bad.
      CHECK_THAT(verdict(config_from_json({{key, {1.0, bad, 1.0, 1.0}}})), ContainsSubstring(named));
    }
    // A file, in what a user can write: 1e-999 reads as 0, and "nan" is a string.
    kvfuse::testing::TempDir dir;
    const std::string path = dir / "kvfuse.json";
    for (const char* text :
         {"0", "0.0", "-0", "-1", "-1e-30", "1e-999", "\"nan\"", "\"inf\"", "[1, 0, 1, 1]"}) {
      CAPTURE(text);
      kvfuse::testing::write_file(path, "{\"" + key + "\": " + std::string(text) + "}");
      CHECK_THAT(verdict(load_config_file(path)), ContainsSubstring(path + ": " + named));
    }
    // NaN, Infinity and 1e999 are no JSON numbers: the file is refused as not JSON.
    for (const char* text : {"NaN", "Infinity", "-Infinity", "1e999", "-1e999"}) {
      CAPTURE(text);
      kvfuse::testing::write_file(path, "{\"" + key + "\": " + std::string(text) + "}");
      CHECK_THAT(verdict(load_config_file(path)), ContainsSubstring(path + "' is not valid JSON"));
    }
    // --set key=value and KVFUSE_K_SCALE / KVFUSE_V_SCALE: a value that is not JSON
    // ("nan", "inf") is taken as a string, and config_from_json checks what was set.
    const std::vector<std::string> values = {"0",   "-0",   "-1",    "nan",    "NaN",
                                             "inf", "-inf", "1e999", "1e-999", "[1,0,1,1]"};
    for (const std::string& value : values) {
      CAPTURE(value);
      json j = json::object();
      REQUIRE(apply_config_override(j, key + "=" + value).ok());
      CHECK_THAT(verdict(config_from_json(j)), ContainsSubstring(named));
    }
    const std::string var = config_env_name(key);
    ScopedEnv env(var);
    for (const std::string& value : values) {
      CAPTURE(var, value);
      env.set(value);
      json j = json::object();
      REQUIRE(apply_config_env(j).ok());
      CHECK_THAT(verdict(config_from_json(j)), ContainsSubstring(named));
    }
    // The same sources take a good scale.
    const auto scales = [&](const Config& c) { return key == "k_scale" ? c.k_scale : c.v_scale; };
    env.set("0.5");
    json j = json::object();
    REQUIRE(apply_config_env(j).ok());
    auto c = config_from_json(j);
    REQUIRE(c.ok());
    CHECK(scales(*c) == std::vector<float>{0.5f});
    REQUIRE(apply_config_override(j, key + "=0.25").ok());
    c = config_from_json(j);
    REQUIRE(c.ok());
    CHECK(scales(*c) == std::vector<float>{0.25f});
    kvfuse::testing::write_file(path, "{\"" + key + "\": [0.5, 1, 2, 448]}");
    c = load_config_file(path);
    REQUIRE(c.ok());
    CHECK(scales(*c) == std::vector<float>{0.5f, 1.0f, 2.0f, 448.0f});
  }
}
