#include "src/backends/gpu/gemm/gemm_tuning.h"

#include <string>

#include "src/backends/gpu/gpu_status.h"
#include "src/loading/env_switches.h"

namespace kvfuse::gemm {

TuneMode tune_mode() {
  const std::string s = env_value("KVFUSE_GEMM_TUNE").value_or(env_default("KVFUSE_GEMM_TUNE"));
  if (s == "0" || s == "off") return TuneMode::off;
  if (s == "isolated") return TuneMode::isolated;
  return TuneMode::graph;
}

bool tune_log() { return env_flag("KVFUSE_GEMM_TUNE_LOG"); }

const char* tune_mode_name(TuneMode mode) {
  return mode == TuneMode::graph ? "graph" : mode == TuneMode::isolated ? "isolated" : "0";
}

namespace {

std::mutex& tuned_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::pair<int, GemmKey>, GemmChoice>& tuned_algos() {
  static auto* m = new std::map<std::pair<int, GemmKey>, GemmChoice>();
  return *m;
}

}  // namespace

std::optional<GemmChoice> TunedChoices::find(int device, const GemmKey& key) {
  std::lock_guard<std::mutex> lock(tuned_mutex());
  auto it = tuned_algos().find({device, key});
  if (it == tuned_algos().end()) return std::nullopt;
  return it->second;
}

void TunedChoices::keep(int device, const GemmKey& key, const GemmChoice& choice) {
  std::lock_guard<std::mutex> lock(tuned_mutex());
  tuned_algos().emplace(std::pair<int, GemmKey>{device, key}, choice);
}

GemmAlgoCache& algo_cache() {
  static auto* c = new GemmAlgoCache(GemmAlgoCache::default_path());
  return *c;
}

int kernel_variant_of(const std::string& kernel, const std::string& prefix, int variants) {
  if (kernel.rfind(prefix, 0) != 0) return -1;
  const std::string rest = kernel.substr(prefix.size());
  if (rest.empty() || rest.size() > 2 || rest.find_first_not_of("0123456789") != std::string::npos) return -1;
  const int v = std::stoi(rest);
  return v < variants ? v : -1;
}

absl::Status GemmTimer::begin(const LinearWeight& w, TuneMode mode) {
  // Timed on the real operands (the output is rewritten by the call that follows).
  if (l2_flush_.bytes() == 0) {
    auto f = alloc_(kL2FlushBytes);
    if (!f.ok()) return f.status();
    l2_flush_ = std::move(*f);
  }
  weights_ = {w.w.get()};
  const size_t wbytes = w.w.bytes();
  for (size_t at = 0;
       mode == TuneMode::graph && at + wbytes <= l2_flush_.bytes() && weights_.size() < size_t(kTuneCalls);
       at += wbytes) {
    char* dst = l2_flush_.as<char>() + at;
    KVFUSE_CUDA(cudaMemcpyAsync(dst, w.w.get(), wbytes, cudaMemcpyDeviceToDevice, stream_));
    weights_.push_back(dst);
  }
  KVFUSE_CUDA(cudaEventCreate(&e0_));
  KVFUSE_CUDA(cudaEventCreate(&e1_));
  return absl::OkStatus();
}

absl::Status GemmTimer::end() {
  KVFUSE_CUDA(cudaEventDestroy(e0_));
  KVFUSE_CUDA(cudaEventDestroy(e1_));
  e0_ = e1_ = nullptr;
  KVFUSE_CUDA(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

float GemmTimer::replay_best(cudaGraphExec_t exec, bool ok) {
  float best = -1.0f;
  // One warm replay, then the fastest of three: the others are the machine's noise.
  for (int r = 0; r < 4 && ok; ++r) {
    ok = cudaEventRecord(e0_, stream_) == cudaSuccess && cudaGraphLaunch(exec, stream_) == cudaSuccess &&
         cudaEventRecord(e1_, stream_) == cudaSuccess && cudaEventSynchronize(e1_) == cudaSuccess;
    float t_ms = 0.0f;
    ok = ok && cudaEventElapsedTime(&t_ms, e0_, e1_) == cudaSuccess;
    if (ok && r > 0 && (best < 0 || t_ms < best)) best = t_ms;
  }
  if (exec) (void)cudaGraphExecDestroy(exec);
  if (!ok) {
    (void)cudaGetLastError();
    return -1.0f;
  }
  return best / float(kTuneCalls);
}

float GemmTimer::isolated(const std::function<bool()>& launch) {
  if (!launch()) return -1.0f;
  float total = 0.0f;
  bool ok = true;
  for (int r = 0; r < 3 && ok; ++r) {
    ok = cudaMemsetAsync(l2_flush_.get(), r, l2_flush_.bytes(), stream_) == cudaSuccess &&
         cudaEventRecord(e0_, stream_) == cudaSuccess && launch() &&
         cudaEventRecord(e1_, stream_) == cudaSuccess;
    float t_ms = 0.0f;
    ok = ok && cudaEventSynchronize(e1_) == cudaSuccess &&
         cudaEventElapsedTime(&t_ms, e0_, e1_) == cudaSuccess;
    total += t_ms;
  }
  return ok ? total / 3.0f : -1.0f;
}

}  // namespace kvfuse::gemm
