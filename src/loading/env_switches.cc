#include "src/loading/env_switches.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/loading/config.h"

namespace kvfuse {

const std::vector<EnvSwitch>& env_switches() {
  static const std::vector<EnvSwitch> switches = {
      // Engine: backends and libraries.
      {"KVFUSE_CPU_GEMM", "avx512 | avx2 | generic", "the widest the CPU runs",
       "the CPU backend's GEMM kernel (all give the same bits)", "engine"},
      {"KVFUSE_NCCL_LIBRARY", "a path", "libnccl.so.2 (CUDA) / librccl.so.1 (HIP)",
       "the NCCL/RCCL library tensor parallelism loads, instead of searching for it", "engine"},
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
      {"KVFUSE_GEMV_PUSH_STAGED", "0 | 1", "1",
       "pushed partial sums go to the peers a token row at a time through shared memory (A/B)", "engine"},
      {"KVFUSE_ATTN_MERGE_KERNEL", "0 | 1", "0", "the split attention's merge as a kernel of its own (A/B)",
       "engine"},
      {"KVFUSE_SPLIT_MIN_KEYS", "16 .. 65536, a multiple of 16", "the device's",
       "fewest keys per partition of the split attention at decode", "engine"},
      {"KVFUSE_ROPE_IN_ATTENTION", "0 | 1", "1",
       "with kv_write fused_rope, decode attention rotates the queries and writes the new K/V itself (A/B)",
       "engine"},
      {"KVFUSE_PDL_OPS", "0 | 1", "1",
       "the step's kernels launch as programmatic dependents (sm_90); 0 keeps all but the KV write plain",
       "engine"},
      {"KVFUSE_PINNED_HOST", "0 | 1", "1", "batch metadata is staged in pinned host memory (A/B)", "engine"},
      {"KVFUSE_PEER_ALLREDUCE", "0 | 1", "1",
       "tensor parallelism runs small all-reduces over peer memory; 0 sends all through NCCL/RCCL", "engine"},
      {"KVFUSE_PEER_PDL", "0 | 1", "1", "the peer all-reduce launches as a programmatic dependent", "engine"},
      // Benchmarks and tests.
      {"KVFUSE_TRACE_OUT", "a path", "kvfuse_trace.csv", "where the kernel tracer of scripts/gpu/profile.sh writes",
       "benchmarks"},
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
      {"KVFUSE_WITH_HIP_CHECK", "0 | 1", "0", "install-deps.sh also installs mmdebstrap, for the HIP build check",
       "scripts"},
      {"KVFUSE_WITH_CONTAINERS", "0 | 1", "0", "also build and check the container images", "scripts"},
      {"KVFUSE_FUZZ_SECONDS", "seconds", "30", "how long scripts/ci/fuzz.sh runs each fuzzer", "scripts"},
      {"KVFUSE_SANITIZER_TIMEOUT", "seconds", "150", "limit of a GPU test under the sanitizer", "scripts"},
      {"KVFUSE_SID_MIRROR", "a URL", "http://deb.debian.org/debian", "Debian mirror of the sid root", "scripts"},
      {"KVFUSE_SID_ROOT_CACHE", "a path", "/var/cache/kvfuse", "where the sid root is kept between builds", "scripts"},
      {"KVFUSE_SID_ROOT_MAX_AGE_DAYS", "days", "30", "age at which the sid root is made anew", "scripts"},
      {"KVFUSE_IMAGE_CACHE", "a path", "/var/cache/kvfuse/images", "base images of scripts/ci/container-check.sh",
       "scripts"},
      {"KVFUSE_CI_GPU_DIR", "a path", "build-ci-gpu", "build folder of scripts/ci/ci-gpu-compile.sh", "scripts"},
      {"KVFUSE_CUDA_BUILD_DIR", "a path", "build-cuda", "CUDA build folder of the GPU scripts", "scripts"},
      {"KVFUSE_GPU_BUILD_DIR", "a path", "build-gpu-check", "GPU test build folder of the GPU scripts", "scripts"},
      {"KVFUSE_BUNDLE_KERNEL_TESTS", "target names", "", "scripts/gpu/bundle.sh packs the kernel tests", "scripts"},
      {"KVFUSE_BUNDLE_KERNEL_BENCHES", "target names", "", "scripts/gpu/bundle.sh packs the kernel benchmarks",
       "scripts"},
      {"KVFUSE_CHECK_BUILD_ONLY", "0 | 1", "0", "scripts/gpu/check.sh builds without running", "scripts"},
      {"KVFUSE_CHECK_BENCHES_ONLY", "0 | 1", "0", "scripts/gpu/check.sh runs the benchmarks only", "scripts"},
      {"KVFUSE_BENCH_ROUNDS", "a count", "15", "rounds of the GPU scripts' benchmarks", "scripts"},
      {"KVFUSE_ATTN_BENCH_ROUNDS", "a count", "9", "rounds of the attention benchmark", "scripts"},
  };
  return switches;
}

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> known_names() {
  std::vector<std::string> names;
  for (const auto& d : config_key_docs()) names.push_back(config_env_name(d.key));
  for (const auto& s : env_switches()) names.push_back(s.name);
  return names;
}

}  // namespace

std::vector<UnknownEnv> unknown_kvfuse_env(char** environ_entries) {
  std::vector<UnknownEnv> out;
  if (environ_entries == nullptr) return out;
  const std::vector<std::string> names = known_names();
  const std::set<std::string> known(names.begin(), names.end());
  for (char** e = environ_entries; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    const std::string name = eq ? std::string(*e, size_t(eq - *e)) : std::string(*e);
    if (name.rfind("KVFUSE_", 0) != 0 || known.count(name)) continue;
    UnknownEnv u{name, ""};
    size_t best = SIZE_MAX;
    for (const std::string& k : names) {
      if (const size_t d = edit_distance(name, k); d < best) {
        best = d;
        u.closest = k;
      }
    }
    out.push_back(std::move(u));
  }
  std::sort(out.begin(), out.end(), [](const UnknownEnv& a, const UnknownEnv& b) { return a.name < b.name; });
  return out;
}

std::string env_help() {
  std::string out = "Config keys (precedence: --set/--<key> > KVFUSE_<KEY> > --config file > defaults):\n";
  for (const auto& d : config_key_docs()) {
    absl::StrAppendFormat(&out, "  %-34s %s\n", config_env_name(d.key), d.values);
  }
  out += "\nSwitches (A/B variants, libraries, files; read by the engine unless marked):\n";
  for (const auto& s : env_switches()) {
    absl::StrAppendFormat(&out, "  %-34s %s (default %s)%s\n      %s\n", s.name, s.values,
                          *s.dflt ? s.dflt : "unset",
                          std::strcmp(s.read_by, "engine") == 0 ? "" : absl::StrCat(" [", s.read_by, "]"), s.meaning);
  }
  return out;
}

}  // namespace kvfuse
