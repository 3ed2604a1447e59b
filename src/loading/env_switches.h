// Every KVFUSE_* environment variable kvfuse knows, in one table: the config keys'
// KVFUSE_<KEY> variables (config_key_docs) and the switches below, which select an A/B
// variant of a kernel path, a library or a file, or steer a script. kvfuse-server
// --help-env lists them, and the server warns about a KVFUSE_* variable that is in
// neither table (a misspelling would otherwise change nothing without a word).
//
// Code reads a switch through env_flag / env_value below, never with getenv: the name is
// checked against the table where it is written (a name not in it does not compile), and
// the default is the table's. The table and its readers are in this header, so that code
// below the engine library (src/parallel: kvfuse_parallel, kvfuse_nccl) reads through them too.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvfuse {

struct EnvSwitch {
  const char* name;    // KVFUSE_...
  const char* values;  // what it takes
  const char* dflt;    // what applies when it is unset; "0" or "1" for a flag ("0 | 1")
  const char* meaning;
  const char* read_by;  // engine (server, tools, benchmarks) | benchmarks | tests | scripts
};

inline constexpr EnvSwitch kEnvSwitches[] = {
    // Engine: backends and libraries.
    // Read by kernels/cpu/gemm/gemm.cc with getenv: kernels/ never includes src/.
    {"KVFUSE_CPU_GEMM", "avx512 | avx2 | generic", "the widest the CPU runs",
     "the CPU backend's GEMM kernel (all give the same bits)", "engine"},
    {"KVFUSE_NCCL_LIBRARY", "a path", "libnccl.so.2 (CUDA) / librccl.so.1 (HIP)",
     "the NCCL/RCCL library tensor parallelism loads, instead of searching for it", "engine"},
    // Read by GemmAlgoCache::default_path with env_raw: "" (set, empty) turns the file off,
    // where env_value takes an empty variable for unset.
    {"KVFUSE_GEMM_CACHE", "a path, or \"\"", "~/.cache/kvfuse/gemm-algos.json",
     "file of the GPU GEMM choices timed at warm-up; \"\" keeps them in memory only", "engine"},
    {"KVFUSE_GEMM_TUNE", "graph | isolated | 0", "graph",
     "how the GPU GEMM candidates are timed: in a graph as the step runs them, each call alone after "
     "a cache flush, or not at all (the library heuristic's first choice)",
     "engine"},
    {"KVFUSE_GEMM_TUNE_LOG", "0 | 1", "0", "print each GEMM tuning decision to stderr", "engine"},
    {"KVFUSE_GEMM_TUNE_WHILE_SERVING", "0 | 1", "0",
     "keep timing new GEMM shapes after the server's warm-up (A/B)", "engine"},
    {"KVFUSE_GEMM_SKINNY", "0 | 1", "1", "offer kvfuse's skinny GEMM to the GEMM tuner (sm_90)", "engine"},
    {"KVFUSE_GEMM_SKINNY_ROWS", "0 .. 64", "16", "the most rows the skinny GEMM is offered for", "engine"},
    {"KVFUSE_GEMM_SKINNY_EARLY", "0 | 1", "1",
     "the skinny GEMM reads its first weights before the kernel in front of it ends (A/B)", "engine"},
    {"KVFUSE_GEMV", "0 | 1", "1", "offer kvfuse's GEMV for small row counts to the GEMM tuner", "engine"},
    {"KVFUSE_GEMV_STREAM", "0 | 1", "1", "the GEMV streams its weights past L1 (A/B)", "engine"},
    {"KVFUSE_GEMV_SILU", "0 | 1", "1", "the gate/up GEMV applies SiLU-mul in its epilogue (A/B)", "engine"},
    {"KVFUSE_GEMV_FP8_QUANT", "0 | 1", "1",
     "the FP8 GEMV quantizes W8A8 activations as it reads them; 0: a quantizing kernel first (A/B)", "engine"},
    {"KVFUSE_FP8_NORM_QUANT", "0 | 1", "1",
     "the RMSNorm before an FP8 W8A8 projection also writes its output's FP8 codes, which the projection reads; "
     "0: the projection quantizes them (A/B)",
     "engine"},
    {"KVFUSE_GEMV_PUSH_STAGED", "0 | 1", "1",
     "pushed partial sums go to the peers a token row at a time through shared memory (A/B)", "engine"},
    {"KVFUSE_ATTN_MERGE_KERNEL", "0 | 1", "0", "the split attention's merge as a kernel of its own (A/B)",
     "engine"},
    {"KVFUSE_SPLIT_MIN_KEYS", "16 .. 65536, a multiple of 16", "the device's",
     "fewest keys per partition of the split attention at decode", "engine"},
    {"KVFUSE_ROPE_IN_ATTENTION", "0 | 1", "1",
     "with kv_write fused_rope, decode attention rotates the queries and writes the new K/V itself (A/B)",
     "engine"},
    // KVFUSE_PDL_OPS has two readers that disagree on "off": the GPU backend's
    // (env_flag, FlagOff::zero: only "0" is off) and the peer all-reduce's, which also
    // follows it (FlagOff::zero_off_false: "0", "off" or "false"). Each keeps its meaning.
    {"KVFUSE_PDL_OPS", "0 | 1", "1",
     "the step's kernels launch as programmatic dependents (sm_90); 0 keeps all but the KV write plain",
     "engine"},
    {"KVFUSE_PINNED_HOST", "0 | 1", "1", "batch metadata is staged in pinned host memory (A/B)", "engine"},
    // The peer all-reduce's two switches are off at "0", "off" or "false"
    // (FlagOff::zero_off_false), the GPU backend's flags above at "0" only.
    {"KVFUSE_PEER_ALLREDUCE", "0 | 1", "1",
     "tensor parallelism runs small all-reduces over peer memory; 0 sends all through NCCL/RCCL", "engine"},
    {"KVFUSE_PEER_PDL", "0 | 1", "1", "the peer all-reduce launches as a programmatic dependent", "engine"},
    // Benchmarks and tests.
    // Read by bench/profile/kvfuse_trace.cc with getenv: a CUPTI injection library that
    // scripts/gpu/profile.sh compiles alone, without src/.
    {"KVFUSE_TRACE_OUT", "a path", "kvfuse_trace.csv",
     "where the kernel tracer of scripts/gpu/profile.sh writes", "benchmarks"},
    // The two below are read by tests/gpu/gpu_test_util.h with getenv: the standalone GPU
    // test build has no src/.
    {"KVFUSE_GPU_TEST_QUICK", "0 | 1", "0", "the GPU parity tests run a smaller grid (under the sanitizer)",
     "tests"},
    {"KVFUSE_TEST_DATA_DIR", "a path", "tests/data", "where the GPU tests find their data", "tests"},
    // Scripts.
    {"KVFUSE_JOBS", "a count", "nproc", "parallel build and test jobs", "scripts"},
    {"KVFUSE_TARGETS", "target names", "all", "what scripts/build.sh builds", "scripts"},
    {"KVFUSE_GPU", "CUDA | HIP", "CUDA where nvcc is found", "the GPU backend scripts build", "scripts"},
    {"KVFUSE_CUDA_ARCH", "e.g. 90a", "90a", "the CUDA architecture scripts build for", "scripts"},
    {"KVFUSE_HIP_ARCH", "e.g. gfx942", "", "the AMD architecture scripts build for", "scripts"},
    {"KVFUSE_HIP_ARCHS", "e.g. gfx942;gfx950", "gfx942;gfx950", "the AMD architectures of the HIP build",
     "scripts"},
    {"KVFUSE_HIP_CXX", "a path", "", "the HIP compiler of the HIP build", "scripts"},
    {"KVFUSE_WITH_HIP_CHECK", "0 | 1", "0",
     "install-deps.sh also installs mmdebstrap, for the HIP build check", "scripts"},
    {"KVFUSE_WITH_CONTAINERS", "0 | 1", "0", "also build and check the container images", "scripts"},
    {"KVFUSE_FUZZ_SECONDS", "seconds", "30", "how long scripts/ci/fuzz.sh runs each fuzzer", "scripts"},
    {"KVFUSE_SANITIZER_TIMEOUT", "seconds", "150", "limit of a GPU test under the sanitizer", "scripts"},
    {"KVFUSE_SID_MIRROR", "a URL", "http://deb.debian.org/debian", "Debian mirror of the sid root",
     "scripts"},
    {"KVFUSE_SID_ROOT_CACHE", "a path", "/var/cache/kvfuse", "where the sid root is kept between builds",
     "scripts"},
    {"KVFUSE_SID_ROOT_MAX_AGE_DAYS", "days", "30", "age at which the sid root is made anew", "scripts"},
    {"KVFUSE_IMAGE_CACHE", "a path", "/var/cache/kvfuse/images",
     "base images of scripts/ci/container-check.sh", "scripts"},
    {"KVFUSE_CI_GPU_DIR", "a path", "build-ci-gpu", "build folder of scripts/ci/ci-gpu-compile.sh",
     "scripts"},
    {"KVFUSE_CUDA_BUILD_DIR", "a path", "build-cuda", "CUDA build folder of the GPU scripts", "scripts"},
    {"KVFUSE_GPU_BUILD_DIR", "a path", "build-gpu-check", "GPU test build folder of the GPU scripts",
     "scripts"},
    {"KVFUSE_BUNDLE_KERNEL_TESTS", "target names", "", "scripts/gpu/bundle.sh packs the kernel tests",
     "scripts"},
    {"KVFUSE_BUNDLE_KERNEL_BENCHES", "target names", "", "scripts/gpu/bundle.sh packs the kernel benchmarks",
     "scripts"},
    {"KVFUSE_CHECK_BUILD_ONLY", "0 | 1", "0", "scripts/gpu/check.sh builds without running", "scripts"},
    {"KVFUSE_CHECK_BENCHES_ONLY", "0 | 1", "0", "scripts/gpu/check.sh runs the benchmarks only", "scripts"},
    {"KVFUSE_BENCH_ROUNDS", "a count", "15", "rounds of the GPU scripts' benchmarks", "scripts"},
    {"KVFUSE_ATTN_BENCH_ROUNDS", "a count", "9", "rounds of the attention benchmark", "scripts"},
};

// kEnvSwitches as a vector (docs, --help-env).
const std::vector<EnvSwitch>& env_switches();

namespace env_detail {

constexpr bool same(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

constexpr const EnvSwitch* find(const char* name) {
  for (const EnvSwitch& s : kEnvSwitches) {
    if (same(s.name, name)) return &s;
  }
  return nullptr;
}

}  // namespace env_detail

// A switch's name as a reader writes it: a name that is not in kEnvSwitches does not
// compile ("not a constant expression" at the throw), so no switch skips the table.
class EnvName {
 public:
  consteval EnvName(const char* name) : entry_(env_detail::find(name)) {  // NOLINT: implicit by design
    if (entry_ == nullptr) throw "a KVFUSE_* switch that is not in kEnvSwitches (src/loading/env_switches.h)";
  }
  constexpr const EnvSwitch& entry() const { return *entry_; }

 private:
  const EnvSwitch* entry_;
};

// A flag's name: registered, with "0" or "1" as its default.
class EnvFlagName {
 public:
  consteval EnvFlagName(const char* name) : entry_(env_detail::find(name)) {  // NOLINT: implicit by design
    if (entry_ == nullptr) throw "a KVFUSE_* switch that is not in kEnvSwitches (src/loading/env_switches.h)";
    if (!env_detail::same(entry_->dflt, "0") && !env_detail::same(entry_->dflt, "1")) {
      throw "a flag's default in kEnvSwitches must be \"0\" or \"1\"";
    }
  }
  constexpr const EnvSwitch& entry() const { return *entry_; }

 private:
  const EnvSwitch* entry_;
};

// The switch's value when the variable is set and not empty (an empty variable counts as
// unset, as for the config keys' variables); nullopt otherwise. Read at every call.
inline std::optional<std::string> env_value(EnvName name) {
  const char* v = std::getenv(name.entry().name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The variable as the environment holds it: nullopt when unset, "" when set and empty. For
// the one switch where an empty value means something (KVFUSE_GEMM_CACHE=""). Read at every call.
inline std::optional<std::string> env_raw(EnvName name) {
  const char* v = std::getenv(name.entry().name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// The table's default for the switch, as the table writes it ("16", "graph").
constexpr const char* env_default(EnvName name) { return name.entry().dflt; }

// What a flag's reader takes for off. Readers that predate this table differ, and each
// keeps its meaning: the GPU backend's flags are off at "0" only (any other value is on),
// the peer all-reduce's at "0", "off" or "false".
enum class FlagOff { zero, zero_off_false };

// A 0 | 1 switch: the table's default when unset or empty, else on unless the value
// spells off (FlagOff). Read at every call.
inline bool env_flag(EnvFlagName name, FlagOff off = FlagOff::zero) {
  const char* v = std::getenv(name.entry().name);
  if (v == nullptr || *v == '\0') return env_detail::same(name.entry().dflt, "1");
  const std::string s = v;
  if (off == FlagOff::zero_off_false) return s != "0" && s != "off" && s != "false";
  return s != "0";
}

// A KVFUSE_* variable of `environ` (NAME=value entries, as the C runtime's) that names
// neither a config key nor a switch, with the closest known name to suggest.
struct UnknownEnv {
  std::string name;
  std::string closest;
};
std::vector<UnknownEnv> unknown_kvfuse_env(char** environ_entries);

// The --help-env text: every config key's variable, then every switch.
std::string env_help();

}  // namespace kvfuse
