// Command-line arguments of the kernel benchmarks (bench_kv_write, bench_attention):
// [--json PATH] [--rounds N] [--peak-gbs GBS] and, where the program has them,
// [--target-only] and [--batch N,...] [--context N,...]. Plain C++: the benchmarks also build on the device
// machine, which has no CLI11.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kvfuse::bench {

struct KernelBenchArgs {
  std::string json_path;           // empty: no JSON
  int rounds = 0;                  // timed rounds per figure, at least 3
  bool target_only = false;        // only with KernelBenchSpec::target_only
  std::optional<double> peak_gbs;  // --peak-gbs: replaces the device's peak
  std::vector<int> batches;        // --batch 1,64: only with KernelBenchSpec::grid (empty: the default grid)
  std::vector<int> contexts;       // --context 512,4096: likewise
};

struct KernelBenchSpec {
  const char* program = "";
  int default_rounds = 7;
  bool target_only = false;  // accepts --target-only
  bool grid = false;         // accepts --batch and --context (comma-separated positive integers)
};

// Parses argv into `args`. Returns the exit code when the program should stop at once
// (2 after a usage message on stderr, 0 after --help on stdout), nullopt to go on.
// Also makes spec.program the name in program_name().
std::optional<int> parse_kernel_bench_args(int argc, char** argv, const KernelBenchSpec& spec,
                                           KernelBenchArgs& args);

// The running benchmark's name, for its error messages ("bench" before parsing).
const char* program_name();

}  // namespace kvfuse::bench
