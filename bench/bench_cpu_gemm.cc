// kvfuse-bench-cpu-gemm: the CPU backend's batch-invariant GEMM against OpenBLAS's sgemm
// on the same machine, one thread each, for the Linear shapes of a model (default: the
// llama3-8b layer shapes) at decode and prefill row counts. Prints GFLOP/s for every
// kernel this CPU runs and the ratio to OpenBLAS. Both compute y = x * w^T in fp32 from
// bf16-representable inputs; OpenBLAS gets x already widened and w row-major, so its time
// excludes the widening and packing that kvfuse does (kvfuse's includes widening x, and
// its weights are bf16, widened in the kernel: half the bytes OpenBLAS's fp32 weights are).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/cpu/gemm/gemm.h"
#include "src/loading/int_list.h"

extern "C" void openblas_set_num_threads(int num_threads);
extern "C" char* openblas_get_corename(void);

namespace {

using namespace kvfuse;
using Clock = std::chrono::steady_clock;

struct Shape {
  std::string name;
  int64_t n, k;
};

// Median seconds of `reps` runs of fn after one warm-up run.
template <class F>
double median_seconds(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-bench-cpu-gemm: the batch-invariant CPU GEMM against OpenBLAS, one thread"};
  std::string rows_arg = "1,8,64,512", shapes_arg = "llama3-8b";
  int reps = 3;
  app.add_option("--rows", rows_arg, "comma-separated row counts m");
  app.add_option("--shapes", shapes_arg, "llama3-8b (qkv, o, gate_up, down) or tiny");
  app.add_option("--reps", reps, "timed repetitions per cell (median reported)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  const auto rows = parse_int_list(rows_arg);
  if (!rows.ok() || rows->empty() || *std::min_element(rows->begin(), rows->end()) < 1) {
    fprintf(stderr, "kvfuse-bench-cpu-gemm: --rows needs positive integers (%s)\n",
            rows.ok() ? rows_arg.c_str() : std::string(rows.status().message()).c_str());
    return 2;
  }
  std::vector<Shape> shapes;
  if (shapes_arg == "llama3-8b") {
    shapes = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}};
  } else if (shapes_arg == "tiny") {
    shapes = {{"qkv", 512, 256},
              {"o", 256, 256},
              {"gate_up", 1536, 256},
              {"down", 256, 768},
              {"lm_head", 1024, 256}};
  } else {
    fprintf(stderr, "kvfuse-bench-cpu-gemm: --shapes must be llama3-8b or tiny\n");
    return 2;
  }
  openblas_set_num_threads(1);
  std::vector<cpu::GemmIsa> isas;
  for (cpu::GemmIsa isa : {cpu::GemmIsa::avx512, cpu::GemmIsa::avx2, cpu::GemmIsa::generic}) {
    if (cpu::gemm_isa_supported(isa)) isas.push_back(isa);
  }
  printf("kvfuse-bench-cpu-gemm: one thread; OpenBLAS core %s; median of %d runs\n", openblas_get_corename(),
         reps);
  printf("%-8s %6s %6s %6s  %-8s %10s %10s %8s\n", "shape", "m", "n", "k", "kernel", "ms", "GFLOP/s",
         "/OpenBLAS");
  for (const Shape& s : shapes) {
    // Weights and activations on a 1/64 grid: exact in bf16, so both sides see the same
    // numbers.
    std::vector<bf16_t> w(size_t(s.n * s.k));
    for (size_t i = 0; i < w.size(); ++i) w[i] = f32_to_bf16(float(int(i * 2654435761u % 129) - 64) / 64.0f);
    std::vector<float> w_f32(w.size());
    std::vector<bf16_t> packed(cpu::gemm_packed_elems(s.n, s.k));
    for (size_t i = 0; i < w.size(); ++i) w_f32[i] = bf16_to_f32(w[i]);
    cpu::gemm_pack_weight(w.data(), s.n, s.k, packed.data());
    for (int64_t m : *rows) {
      std::vector<bf16_t> x(size_t(m * s.k));
      for (size_t i = 0; i < x.size(); ++i) x[i] = f32_to_bf16(float(int(i * 40503u % 65) - 32) / 32.0f);
      std::vector<float> x_f32(x.size()), y(size_t(m * s.n)), scratch(cpu::gemm_scratch_floats(m, s.k, s.n));
      for (size_t i = 0; i < x.size(); ++i) x_f32[i] = bf16_to_f32(x[i]);
      const double flop = 2.0 * double(m) * double(s.n) * double(s.k);
      const double blas = median_seconds(reps, [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(s.n), int(s.k), 1.0f, x_f32.data(),
                    int(s.k), w_f32.data(), int(s.k), 0.0f, y.data(), int(s.n));
      });
      printf("%-8s %6lld %6lld %6lld  %-8s %10.3f %10.1f %8s\n", s.name.c_str(), (long long)m, (long long)s.n,
             (long long)s.k, "OpenBLAS", blas * 1e3, flop / blas * 1e-9, "1.00");
      for (cpu::GemmIsa isa : isas) {
        if (isa == cpu::GemmIsa::generic && isas.size() > 1 && m > 8) continue;  // scalar: decode rows only
        const double ours = median_seconds(reps, [&] {
          cpu::linear_f32_out(x.data(), m, s.k, packed.data(), s.n, y.data(), scratch.data(), isa);
        });
        printf("%-8s %6lld %6lld %6lld  %-8s %10.3f %10.1f %8.2f\n", s.name.c_str(), (long long)m,
               (long long)s.n, (long long)s.k, cpu::gemm_isa_name(isa), ours * 1e3, flop / ours * 1e-9,
               blas / ours);
      }
      fflush(stdout);
    }
  }
  return 0;
}
