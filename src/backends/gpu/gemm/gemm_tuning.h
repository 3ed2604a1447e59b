// What every GEMM family's tuner shares (docs/gpus.md#the-gemm-tuner-and-its-cache): how
// candidates are timed (KVFUSE_GEMM_TUNE), the timing itself on the backend's stream, the
// choices already made in this process, and the file of choices every process on the
// machine reads (src/backends/gemm_cache.h). A family (the bf16 GEMMs of gemm_planner.cu,
// the FP8-weight ones of gemm_planner_fp8.cu) brings its candidates and launches; the rest
// is here.
#pragma once

#include "kernels/common/gpu.h"

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/backends/gemm_cache.h"
#include "src/backends/gpu/gemm/blaslt.h"

namespace kvfuse::gemm {

// Decode-sized GEMMs (m <= kTuneMaxRows) are memory bound, and the library's first
// heuristic choice is often not its fastest there: each such shape is timed once over
// the heuristic's candidates and the fastest kept. KVFUSE_GEMM_TUNE picks how:
// - graph (default): as a step runs it, kTuneCalls calls back to back in a CUDA/HIP
//   graph, each reading its own copy of the weights (as every layer of a step reads its
//   own), so they come from device memory and no launch gap or cache flush is counted;
// - isolated: each call alone after a write larger than the last-level cache (the older
//   method: the flush's tail and the launch land in the timing, and it ranked some
//   shapes wrongly — a gate/up choice 13% slower inside a graph);
// - 0: the heuristic's first choice, untimed.
// Choices are shared by every backend in the process (TunedChoices) and kept in the GEMM
// cache file (src/backends/gemm_cache.h: KVFUSE_GEMM_CACHE, default
// ~/.cache/kvfuse/gemm-algos.json), keyed by device, library version and shape, so that
// every process on the machine (two servers A/B-ed side by side) runs the same kernels and
// a restart does not tune again. KVFUSE_GEMM_TUNE_LOG=1 prints each decision to stderr.
enum class TuneMode { off, graph, isolated };
TuneMode tune_mode();  // KVFUSE_GEMM_TUNE, read at every call
bool tune_log();       // KVFUSE_GEMM_TUNE_LOG, read at every call
const char* tune_mode_name(TuneMode mode);

inline constexpr int64_t kTuneMaxRows = 512;
inline constexpr int kTuneCandidates = 8;
inline constexpr int kTuneCalls = 16;
// Twice the largest last-level cache kvfuse runs on: MI300X and MI355X have a 256 MB
// Infinity Cache behind their L2 (an H200's L2 is 60 MB).
inline constexpr size_t kL2FlushBytes = size_t(512) << 20;

// The GEMM families; each keeps its choices apart from the others'. fp8_w8a16 and
// fp8_w8a8: FP8 weights with bf16 activations, or with FP8 activations
// (src/backends/gpu/gemm/gemm_planner_fp8.cu).
// fp8_w8a8_codes: W8A8 whose activations come as codes from the kernel before
// (Backend::norm_to_fp8): no quantizing, in the GEMV or a launch of its own.
enum class GemmFamily : int { bf16, fp8_w8a16, fp8_w8a8, fp8_w8a8_codes };
enum class GemmOut : int { bf16, f32 };

// One GEMM shape: out[m, n] = x[m, k] * w[n, k]^T of a family, with its output type.
struct GemmKey {
  GemmFamily family = GemmFamily::bf16;
  int64_t m = 0, n = 0, k = 0;
  GemmOut out = GemmOut::bf16;
  bool operator<(const GemmKey& o) const {
    return std::tie(family, m, n, k, out) < std::tie(o.family, o.m, o.n, o.k, o.out);
  }
};

// What a shape runs: the library's algorithm, or one of kvfuse's kernels in its place.
struct GemmChoice {
  blasLtMatmulAlgo_t algo{};
  int gemv = -1;    // >= 0: kvfuse's GEMV (kernels/gemm/gemv.cuh; FP8: gemv_fp8.cuh) of that variant
  int skinny = -1;  // >= 0: kvfuse's skinny GEMM (kernels/gemm/gemm_skinny.cuh) of that variant
};

// The choices made in this process, by device and shape: every backend on a device runs
// what the first one chose.
class TunedChoices {
 public:
  static std::optional<GemmChoice> find(int device, const GemmKey& key);
  // Keeps the first choice for the shape (a later one is dropped, as std::map::emplace).
  static void keep(int device, const GemmKey& key, const GemmChoice& choice);
};

// The process's GEMM cache file (GemmAlgoCache::default_path()).
GemmAlgoCache& algo_cache();

// The variant a cache entry's "kernel" names ("<prefix>N", N < variants), or -1.
int kernel_variant_of(const std::string& kernel, const std::string& prefix, int variants);

// Times a shape's candidates on the backend's stream as the TuneMode says: begin() makes
// the weight copies the graph method rotates over and the events, in_graph() or
// isolated() time one candidate each, end() releases the events and waits for the stream.
class GemmTimer {
 public:
  using Alloc = std::function<absl::StatusOr<DeviceBuffer>(size_t)>;
  GemmTimer(cudaStream_t stream, Alloc alloc) : stream_(stream), alloc_(std::move(alloc)) {}
  GemmTimer(const GemmTimer&) = delete;
  GemmTimer& operator=(const GemmTimer&) = delete;

  // The graph method's weight copies: the weights themselves, then as many copies as fit
  // in the flush buffer (none for weights of its size or more); only w itself otherwise.
  absl::Status begin(const LinearWeight& w, TuneMode mode);
  absl::Status end();
  // The weights to time on: the copies for the graph method; weights().front() is w's own.
  const std::vector<const void*>& weights() const { return weights_; }

  // Milliseconds per call of `call(weights)` (true when it launched), kTuneCalls calls
  // captured back to back in a graph, each on the next copy of the weights: one warm
  // replay, then the fastest of three, per call; negative when a call fails.
  template <class Call>
  float in_graph(Call&& call) {
    // Once eagerly: the candidate runs at all, and its kernel is loaded before the capture.
    if (!call(weights_[0]) || cudaStreamSynchronize(stream_) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1.0f;
    }
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0f;
    bool ok = true;
    for (int i = 0; i < kTuneCalls; ++i) ok = call(weights_[size_t(i) % weights_.size()]) && ok;
    cudaGraph_t graph = nullptr;
    ok = cudaStreamEndCapture(stream_, &graph) == cudaSuccess && ok;
    cudaGraphExec_t exec = nullptr;
    ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (graph) (void)cudaGraphDestroy(graph);
    return replay_best(exec, ok);
  }

  // The older method (TuneMode::isolated): `launch()` (true when it launched) alone
  // after a cache flush, the mean of three; negative when it fails.
  float isolated(const std::function<bool()>& launch);

 private:
  // One warm replay of `exec`, then the fastest of three (the others are the machine's
  // noise), per call; destroys exec.
  float replay_best(cudaGraphExec_t exec, bool ok);

  cudaStream_t stream_;
  Alloc alloc_;
  DeviceBuffer l2_flush_;  // written between isolated calls; holds the graph method's weight copies
  std::vector<const void*> weights_;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};

}  // namespace kvfuse::gemm
