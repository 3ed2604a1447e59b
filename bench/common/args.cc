#include "bench/common/args.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "bench/common/peak_bandwidth.h"

namespace kvfuse::bench {

namespace {

const char* g_program = "bench";

std::string usage(const KernelBenchSpec& spec) {
  return std::string("usage: ") + spec.program + " [--json PATH] [--rounds N] [--peak-gbs GBS]" +
         (spec.target_only ? " [--target-only]" : "") +
         (spec.grid ? " [--batch N,...] [--context N,...]" : "");
}

// "1,64,256" into {1, 64, 256}; false (and `out` untouched) for anything but
// comma-separated positive integers. Not the tools' kvfuse::parse_int_list
// (src/loading/int_list.h): that one needs absl, which the standalone GPU build lacks.
bool parse_int_list(const char* text, std::vector<int>& out) {
  std::vector<int> values;
  const char* p = text;
  for (;;) {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p || v <= 0 || v > 1L << 30) return false;
    values.push_back(int(v));
    if (*end == '\0') break;
    if (*end != ',') return false;
    p = end + 1;
  }
  out = std::move(values);
  return true;
}

}  // namespace

const char* program_name() { return g_program; }

std::optional<int> parse_kernel_bench_args(int argc, char** argv, const KernelBenchSpec& spec,
                                           KernelBenchArgs& args) {
  g_program = spec.program;
  args = KernelBenchArgs{};
  args.rounds = spec.default_rounds;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--json") && has_value) {
      args.json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--rounds") && has_value) {
      args.rounds = std::max(3, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--peak-gbs") && has_value) {
      char* end = nullptr;
      const double v = std::strtod(argv[++i], &end);
      if (end == argv[i] || *end != '\0' || !(v > 0)) {
        std::fprintf(stderr, "%s: --peak-gbs takes a positive number, got '%s'\n%s\n", spec.program, argv[i],
                     usage(spec).c_str());
        return 2;
      }
      args.peak_gbs = v;
    } else if (spec.target_only && !std::strcmp(argv[i], "--target-only")) {
      args.target_only = true;
    } else if (spec.grid && (!std::strcmp(argv[i], "--batch") || !std::strcmp(argv[i], "--context")) &&
               has_value) {
      const char* flag = argv[i];
      std::vector<int>& list = !std::strcmp(flag, "--batch") ? args.batches : args.contexts;
      if (!parse_int_list(argv[++i], list)) {
        std::fprintf(stderr, "%s: %s takes comma-separated positive integers, got '%s'\n%s\n", spec.program,
                     flag, argv[i], usage(spec).c_str());
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf("%s\n  --peak-gbs: %s\n", usage(spec).c_str(), kPeakGbsHelp);
      return 0;
    } else {
      std::fprintf(stderr, "%s\n", usage(spec).c_str());
      return 2;
    }
  }
  return std::nullopt;
}

}  // namespace kvfuse::bench
