// The GPU side of the kernel benchmarks (included only from .cu files): the device
// query behind the banner, a check that ends the program on a runtime error, and the
// timing of a call as CUDA-graph replay or as eager launches between two events.
#pragma once

#include "kernels/common/gpu.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench/common/args.h"
#include "bench/common/device_info.h"

namespace kvfuse::bench {

// Exits with status 2, naming the failed call. `status` is a cudaError_t or anything
// that compares with cudaSuccess (a launcher's status).
template <class Status>
[[noreturn]] void gpu_failed(const char* call, const Status& status, int line) {
  const char* text = "error";
  if constexpr (std::is_convertible_v<Status, cudaError_t>) text = cudaGetErrorString(cudaError_t(status));
  std::fprintf(stderr, "%s: %s failed: %s (line %d)\n", program_name(), call, text, line);
  std::exit(2);
}

#define BENCH_GPU(call)                                                                   \
  do {                                                                                    \
    const auto status_ = (call);                                                          \
    if (!(status_ == cudaSuccess)) ::kvfuse::bench::gpu_failed(#call, status_, __LINE__); \
  } while (0)

// Device `dev`, or nullopt when there is no GPU (the benchmark then skips).
inline std::optional<DeviceInfo> query_device(int dev = 0) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return std::nullopt;
  cudaDeviceProp prop{};
  BENCH_GPU(cudaGetDeviceProperties(&prop, dev));
  DeviceInfo d;
  d.name = prop.name;
  d.multiprocessors = prop.multiProcessorCount;
  d.l2_bytes = prop.l2CacheSize;
  d.memory_bytes = int64_t(prop.totalGlobalMem);
  // BENCH_RT(cuda name, hip name): the runtime's own name where kernels/common/vendor/hip.h
  // maps none. Attributes, not cudaDeviceProp fields: CUDA 13 dropped the clock fields.
#if defined(KVFUSE_HIP) || defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#define BENCH_RT(cuda, hip) hip
  d.arch = prop.gcnArchName;
#else
#define BENCH_RT(cuda, hip) cuda
  d.arch = "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
#endif
  d.hip = BENCH_RT(false, true);
  const auto attribute = [dev](int* value, BENCH_RT(cudaDeviceAttr, hipDeviceAttribute_t) a) {
    (void)BENCH_RT(cudaDeviceGetAttribute, hipDeviceGetAttribute)(value, a, dev);
  };
  attribute(&d.bus_width_bits, BENCH_RT(cudaDevAttrGlobalMemoryBusWidth, hipDeviceAttributeMemoryBusWidth));
  attribute(&d.memory_clock_khz, BENCH_RT(cudaDevAttrMemoryClockRate, hipDeviceAttributeMemoryClockRate));
  attribute(&d.clock_khz, BENCH_RT(cudaDevAttrClockRate, hipDeviceAttributeClockRate));
  (void)BENCH_RT(cudaDriverGetVersion, hipDriverGetVersion)(&d.driver_version);
  (void)BENCH_RT(cudaRuntimeGetVersion, hipRuntimeGetVersion)(&d.runtime_version);
#undef BENCH_RT
  return d;
}

// A kernel benchmark's start: its arguments, its device and the device's peak.
struct KernelBench {
  KernelBenchArgs args;
  DeviceInfo device;
  PeakBandwidth peak;
};

// Parses the arguments and queries device 0. Returns the exit code when the program
// should stop at once (a usage error, --help, or no GPU: "SKIP <program>: no GPU"),
// nullopt to go on with `b` filled in after printing "<program> on <device><headline>"
// and the device banner.
inline std::optional<int> start_kernel_bench(int argc, char** argv, const KernelBenchSpec& spec,
                                             const std::string& headline, KernelBench& b) {
  if (auto rc = parse_kernel_bench_args(argc, argv, spec, b.args)) return rc;
  std::optional<DeviceInfo> d = query_device();
  if (!d) {
    std::printf("SKIP %s: no GPU\n", spec.program);
    return 0;
  }
  b.device = *std::move(d);
  b.peak = device_peak(b.device, b.args.peak_gbs);
  std::printf("%s on %s%s\n%s", spec.program, device_label(b.device).c_str(), headline.c_str(),
              device_banner(b.device, b.peak).c_str());
  return std::nullopt;
}

// A stream and two events for timing; the figures are the median over timed rounds
// (the upper one of an even count) of microseconds per call.
class GpuTimer {
 public:
  GpuTimer() {
    BENCH_GPU(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BENCH_GPU(cudaEventCreate(&e0_));
    BENCH_GPU(cudaEventCreate(&e1_));
  }
  ~GpuTimer() {
    (void)cudaEventDestroy(e0_);
    (void)cudaEventDestroy(e1_);
    (void)cudaStreamDestroy(stream_);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;

  cudaStream_t stream() const { return stream_; }

  // `calls` calls of call(stream) captured in one graph, replayed twice, then timed
  // `rounds` times (time / calls). ready() runs between the graph's instantiation and its
  // first launch (ranks sharing a GPU wait there for each other: an instantiation may wait
  // for the kernels running on the GPU, a peer's spinning all-reduce among them).
  template <class Call, class Ready>
  double graph_us(Call&& call, int calls, int rounds, Ready&& ready) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_GPU(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) call(stream_);
    BENCH_GPU(cudaStreamEndCapture(stream_, &graph));
    BENCH_GPU(cudaGraphInstantiate(&exec, graph, 0));
    ready();
    for (int i = 0; i < 2; ++i) BENCH_GPU(cudaGraphLaunch(exec, stream_));
    const double us = median_us(rounds, calls, [&] { BENCH_GPU(cudaGraphLaunch(exec, stream_)); });
    BENCH_GPU(cudaGraphExecDestroy(exec));
    BENCH_GPU(cudaGraphDestroy(graph));
    return us;
  }
  template <class Call>
  double graph_us(Call&& call, int calls, int rounds) {
    return graph_us(call, calls, rounds, [] {});
  }

  // `warmup` calls, then `rounds` timed rounds of `calls` back-to-back calls.
  template <class Call>
  double eager_us(Call&& call, int calls, int warmup, int rounds) {
    for (int i = 0; i < warmup; ++i) call(stream_);
    return median_us(rounds, calls, [&] {
      for (int i = 0; i < calls; ++i) call(stream_);
    });
  }

 private:
  template <class Run>
  double median_us(int rounds, int calls, Run&& run) {
    std::vector<double> us;
    for (int r = 0; r < rounds; ++r) {
      BENCH_GPU(cudaEventRecord(e0_, stream_));
      run();
      BENCH_GPU(cudaEventRecord(e1_, stream_));
      BENCH_GPU(cudaEventSynchronize(e1_));
      float ms = 0;
      BENCH_GPU(cudaEventElapsedTime(&ms, e0_, e1_));
      us.push_back(1000.0 * ms / calls);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }

  cudaStream_t stream_{};
  cudaEvent_t e0_{}, e1_{};
};

}  // namespace kvfuse::bench
