// The GPU backend (CUDA or HIP, one source): device memory through the vendor runtime,
// GEMMs through cuBLASLt / hipBLASLt, every other op through the kernels in kernels/.
// All work is queued on one stream; the host waits only when it reads results back
// (copy_to_host, synchronize), so a step has no host synchronisation inside it.
#include "kernels/gpu.h"

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/attention.cuh"
#include "kernels/kv_write.cuh"
#include "kernels/model_ops.cuh"
#include "src/backend.h"
#include "src/cpu_backend.h"
#include "src/gpu/blaslt.h"

namespace kvfuse {
namespace {

absl::Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(KVFUSE_GPU_VENDOR, " error in ", what, ": ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

absl::Status blas_status(blasStatus_t st, const char* what) {
  if (st == BLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(KVFUSE_BLASLT_NAME, " error ", int(st), " in ", what));
}

#define KVFUSE_CUDA(expr)                                             \
  do {                                                                \
    if (auto _st = cuda_status((expr), #expr); !_st.ok()) return _st; \
  } while (0)
#define KVFUSE_BLAS(expr)                                             \
  do {                                                                \
    if (auto _st = blas_status((expr), #expr); !_st.ok()) return _st; \
  } while (0)

constexpr int32_t kSplitPartition = 512;  // keys per split-KV partition
constexpr size_t kBlasWorkspace = size_t(32) << 20;

class GpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> create(int device) {
    std::unique_ptr<GpuBackend> b(new GpuBackend());
    if (auto st = b->init(device); !st.ok()) return st;
    return std::unique_ptr<Backend>(std::move(b));
  }
  ~GpuBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
    blas_workspace_.reset();
    split_scratch_.reset();
    gemm_f32_.reset();
    if (blas_) blasLtDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Device device() const override {
#if defined(KVFUSE_HIP)
    return Device::hip;
#else
    return Device::cuda;
#endif
  }
  std::string description() const override { return description_; }
  KvDtype resolve_kv_dtype(KvCacheDtype d) const override { return kv_dtype_for(d, fnuz_); }

  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed allocation
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s: cannot allocate %.1f MiB of device memory (%s)", KVFUSE_GPU_VENDOR,
                          double(bytes) / double(1 << 20), cudaGetErrorString(err)));
    }
    return DeviceBuffer(p, bytes, [](void* q) { cudaFree(q); });
  }
  absl::Status memset(void* dst, int value, size_t bytes) override {
    KVFUSE_CUDA(cudaMemsetAsync(dst, value, bytes, stream_));
    return absl::OkStatus();
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    // From pageable host memory the copy has taken the source by the time it returns,
    // so the caller may reuse its buffer at once.
    if (bytes) KVFUSE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) KVFUSE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    KVFUSE_CUDA(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status synchronize() override {
    KVFUSE_CUDA(cudaStreamSynchronize(stream_));
    KVFUSE_CUDA(cudaGetLastError());
    return absl::OkStatus();
  }

  absl::StatusOr<LinearWeight> upload_linear(const bf16_t* w, int64_t n, int64_t k,
                                             const bf16_t* bias) override {
    LinearWeight lw;
    lw.n = n;
    lw.k = k;
    auto wb = alloc(size_t(n * k) * sizeof(bf16_t));
    if (!wb.ok()) return wb.status();
    lw.w = std::move(*wb);
    if (auto st = copy_to_device(lw.w.get(), w, size_t(n * k) * sizeof(bf16_t)); !st.ok()) return st;
    if (bias) {
      // Bias in fp32, added to the fp32 GEMM result before the one rounding (see linear).
      std::vector<float> b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) b[size_t(i)] = bf16_to_f32(bias[i]);
      auto bb = alloc(size_t(n) * sizeof(float));
      if (!bb.ok()) return bb.status();
      lw.bias = std::move(*bb);
      if (auto st = copy_to_device(lw.bias.get(), b.data(), b.size() * sizeof(float)); !st.ok()) return st;
      if (auto st = synchronize(); !st.ok()) return st;  // b is a local
    }
    return lw;
  }

  absl::Status embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden,
                         bf16_t* out) override {
    return cuda_status(gpu::launch_embedding(ids, n, table, hidden, out, stream_), "embedding");
  }
  absl::Status rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out) override {
    return cuda_status(gpu::launch_rmsnorm(x, w, rows, cols, eps, out, stream_), "rmsnorm");
  }
  absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out) override {
    if (!w.bias.get()) return gemm(x, m, w, out, BLAS_R_16BF);
    // With a bias the GEMM result stays fp32 until the bias is in: one bf16 rounding.
    const size_t need = size_t(m * w.n) * sizeof(float);
    if (need > gemm_f32_.bytes()) {
      if (auto st = synchronize(); !st.ok()) return st;  // the old buffer may still be in use
      auto b = alloc(need * 2);
      if (!b.ok()) return b.status();
      gemm_f32_ = std::move(*b);
    }
    if (auto st = gemm(x, m, w, gemm_f32_.get(), BLAS_R_32F); !st.ok()) return st;
    return cuda_status(
        gpu::launch_bias_round(gemm_f32_.as<float>(), w.bias.as<float>(), m, w.n, out, stream_),
        "bias_round");
  }
  absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) override {
    return gemm(x, m, w, out, BLAS_R_32F);
  }
  absl::Status rope(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                    int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                    float theta) override {
    return cuda_status(gpu::launch_rope_neox(q, q_stride, q_heads, k, k_stride, kv_heads, head_dim, positions,
                                             n, theta, stream_),
                       "rope");
  }
  absl::Status silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) override {
    return cuda_status(gpu::launch_silu_mul(gate_up, n, inter, out, stream_), "silu_mul");
  }
  absl::Status residual_add(bf16_t* x, const bf16_t* y, int64_t count) override {
    return cuda_status(gpu::launch_residual_add(x, y, count, stream_), "residual_add");
  }
  absl::Status gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           bf16_t* out) override {
    return cuda_status(gpu::launch_gather_rows(x, cols, rows, n, out, stream_), "gather_rows");
  }

  absl::Status kv_write(const KvWriteArgs& args, KvWritePath path, void* scratch) override {
    if (path == KvWritePath::fused) {
      return cuda_status(gpu::launch_kv_write_fused(args, stream_, kv_launch_), "kv_write_fused");
    }
    return cuda_status(gpu::launch_kv_write_unfused(args, scratch, stream_, kv_launch_), "kv_write_unfused");
  }
  size_t kv_write_scratch_bytes(int64_t num_tokens, int64_t row_elems) const override {
    return gpu::kv_write_scratch_bytes(num_tokens, row_elems);
  }
  absl::Status attention(const AttnArgs& args, AttentionPath path) override {
    if (const std::string why = gpu::attention_unsupported(args); !why.empty()) {
      return absl::InvalidArgumentError(why);
    }
    if (path == AttentionPath::unified) {
      return cuda_status(gpu::launch_attention_unified(args, stream_), "attention_unified");
    }
    const size_t need =
        gpu::attention_split_scratch_bytes(args.batch.num_tokens, args.num_q_heads, args.cache.head_dim,
                                           args.batch.max_context_len, kSplitPartition);
    if (need > split_scratch_.bytes()) {
      if (auto st = synchronize(); !st.ok()) return st;  // the old buffer may still be in use
      auto b = alloc(need * 2);
      if (!b.ok()) return b.status();
      split_scratch_ = std::move(*b);
    }
    return cuda_status(gpu::launch_attention_split(args, split_scratch_.get(), kSplitPartition, stream_),
                       "attention_split");
  }

 private:
  GpuBackend() = default;

  absl::Status init(int device) {
    KVFUSE_CUDA(cudaSetDevice(device));
    cudaDeviceProp prop{};
    KVFUSE_CUDA(cudaGetDeviceProperties(&prop, device));
#if defined(KVFUSE_HIP)
    // gfx942 (MI300X/MI325X) stores e4m3 as FNUZ; gfx950 and later use OCP e4m3fn.
    const std::string arch = prop.gcnArchName;
    fnuz_ = arch.rfind("gfx942", 0) == 0;
    description_ =
        absl::StrFormat("hip %s (%s, %.0f GiB)", prop.name, arch, double(prop.totalGlobalMem) / (1 << 30));
#else
    fnuz_ = false;
    // Programmatic dependent launch lets the write's launch overlap the kernel before it
    // (about 0.3 us a call on an H200, bench/results/kv_write_h200.txt); the kernels wait
    // in-kernel before touching memory, so it is safe after any kernel.
    kv_launch_.pdl = prop.major >= 9;
    description_ = absl::StrFormat("cuda %s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
                                   double(prop.totalGlobalMem) / (1 << 30));
#endif
    KVFUSE_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KVFUSE_BLAS(blasLtCreate(&blas_));
    auto ws = alloc(kBlasWorkspace);
    if (!ws.ok()) return ws.status();
    blas_workspace_ = std::move(*ws);
    return absl::OkStatus();
  }

  // out[m, n] = x[m, k] * w[n, k]^T, fp32 accumulation. Column-major view: out^T (n x m)
  // = op(W) (n x k, W stored k x n, transposed) * x^T (k x m).
  absl::Status gemm(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                    decltype(BLAS_R_32F) out_type) {
    if (m <= 0) return absl::OkStatus();
    // Descriptors are created per call: a few microseconds of host work, no device
    // work. (A per-shape cache belongs with graph capture.)
    struct Descs {
      blasLtMatmulDesc_t desc = nullptr;
      blasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
      blasLtMatmulPreference_t pref = nullptr;
      ~Descs() {
        if (pref) blasLtMatmulPreferenceDestroy(pref);
        if (d) blasLtMatrixLayoutDestroy(d);
        if (b) blasLtMatrixLayoutDestroy(b);
        if (a) blasLtMatrixLayoutDestroy(a);
        if (desc) blasLtMatmulDescDestroy(desc);
      }
    } h;
    auto& desc = h.desc;
    auto& a = h.a;
    auto& b = h.b;
    auto& d = h.d;
    auto& pref = h.pref;
    const auto t = BLAS_OP_T, n = BLAS_OP_N;
    KVFUSE_BLAS(blasLtMatmulDescCreate(&desc, BLAS_COMPUTE_32F, BLAS_R_32F));
    KVFUSE_BLAS(blasLtMatmulDescSetAttribute(desc, BLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    KVFUSE_BLAS(blasLtMatmulDescSetAttribute(desc, BLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&a, BLAS_R_16BF, uint64_t(w.k), uint64_t(w.n), int64_t(w.k)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&b, BLAS_R_16BF, uint64_t(w.k), uint64_t(m), int64_t(w.k)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&d, out_type, uint64_t(w.n), uint64_t(m), int64_t(w.n)));
    KVFUSE_BLAS(blasLtMatmulPreferenceCreate(&pref));
    const size_t ws = blas_workspace_.bytes();
    KVFUSE_BLAS(
        blasLtMatmulPreferenceSetAttribute(pref, BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    blasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    KVFUSE_BLAS(blasLtMatmulAlgoGetHeuristic(blas_, desc, a, b, d, d, pref, 1, &heur, &found));
    if (found == 0) {
      return absl::InternalError(
          absl::StrCat(KVFUSE_BLASLT_NAME, ": no algorithm for a ", m, "x", w.n, "x", w.k, " bf16 GEMM"));
    }
    const float alpha = 1.0f, beta = 0.0f;
    KVFUSE_BLAS(blasLtMatmul(blas_, desc, &alpha, w.w.get(), a, x, b, &beta, out, d, out, d, &heur.algo,
                             blas_workspace_.get(), ws, stream_));
    return absl::OkStatus();
  }

  std::string description_;
  bool fnuz_ = false;
  gpu::KvWriteLaunch kv_launch_;
  cudaStream_t stream_ = nullptr;
  blasLtHandle_t blas_ = nullptr;
  DeviceBuffer blas_workspace_;
  DeviceBuffer split_scratch_;
  DeviceBuffer gemm_f32_;  // fp32 GEMM results of biased linear layers
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
#if defined(KVFUSE_HIP)
  const Device built = Device::hip;
#else
  const Device built = Device::cuda;
#endif
  if (device == Device::cpu || (device == Device::auto_ && count == 0)) return make_cpu_backend();
  if (device != Device::auto_ && device != built) {
    return absl::FailedPreconditionError(absl::StrCat(
        "config key 'device': '", to_string(device), "' is not built into this binary (built for ",
        to_string(built), "); use cpu, auto or ", to_string(built)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(absl::StrCat("config key 'device': '", to_string(device),
                                                      "' but no ", KVFUSE_GPU_VENDOR, " device is visible (",
                                                      cudaGetErrorString(err), "); use cpu or auto"));
  }
  return GpuBackend::create(0);
}

}  // namespace kvfuse
