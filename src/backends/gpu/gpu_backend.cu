// The GPU backend (CUDA or HIP, one source): device memory through the vendor runtime,
// GEMMs through cuBLASLt / hipBLASLt, every other op through the kernels in kernels/.
// All work is queued on one stream; the host waits only when it reads results back
// (copy_to_host, synchronize), so a step has no host synchronisation inside it.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/attention/attention.cuh"
#include "kernels/common/dispatch.h"
#include "kernels/gemm/gemm_skinny.cuh"
#include "kernels/gemm/gemv.cuh"
#include "kernels/kv_write/kv_write.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/ops/sampling.cuh"
#include "kernels/parallel/tp_push.cuh"
#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/backends/gemm_cache.h"
#include "src/backends/gpu/blaslt.h"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {
namespace {

absl::Status blas_status(blasStatus_t st, const char* what) {
  if (st == BLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(KVFUSE_BLASLT_NAME, " error ", int(st), " in ", what));
}

#define KVFUSE_BLAS(expr)                                             \
  do {                                                                \
    if (auto _st = blas_status((expr), #expr); !_st.ok()) return _st; \
  } while (0)

// Fewest keys per split-KV partition. A decode-only batch may split down to 64 keys (a
// tile per group of the block kernel): at batch 1 x 1024 keys the heuristic picks 8
// partitions of 128 keys per KV head where a floor of 512 left two. Its scratch holds a
// partial result per decode row and partition, and the wave heuristic keeps the
// partitions near what the multiprocessors hold, so it stays a few MiB. A batch with
// prefill rows indexes that scratch by token row: its partitions keep 512 keys.
// KVFUSE_SPLIT_MIN_KEYS overrides the decode minimum (a multiple of 16; for the A/B).
constexpr int32_t kSplitPartition = 512;
constexpr int32_t kSplitPartitionDecode = 64;
constexpr size_t kBlasWorkspace = size_t(32) << 20;

class GpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> create(int device) {
    std::unique_ptr<GpuBackend> b(new GpuBackend());
    KVFUSE_RETURN_IF_ERROR(b->init(device));
    return std::unique_ptr<Backend>(std::move(b));
  }
  ~GpuBackend() override {
    // Teardown is best effort: a destructor has no one to report a failure to.
    if (stream_) (void)cudaStreamSynchronize(stream_);
    plans_.clear();
    blas_workspace_.reset();
    split_scratch_.reset();
    split_counters_.reset();
    kv_scratch_.reset();
    gemm_f32_.reset();
    if (blas_) blasLtDestroy(blas_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }

  Device device() const override {
#if defined(KVFUSE_HIP)
    return Device::hip;
#else
    return Device::cuda;
#endif
  }
  std::string description() const override { return description_; }
  KvFormat resolve_kv_format(KvCacheDtype d) const override { return kv_format_for(d, fnuz_); }
  absl::Status check_supported(const ModelSpec& spec, KvFormat format) const override {
    const std::string why =
        gpu::model_shape_unsupported(spec.head_dim, spec.num_q_heads, spec.num_kv_heads, format);
    if (why.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(KVFUSE_GPU_VENDOR, " backend does not support ", why,
                                                   " for model ", spec.name, " with a ",
                                                   kv_format_name(format), " KV cache"));
  }

  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override {
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the error state of the failed allocation
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s: cannot allocate %.1f MiB of device memory (%s)", KVFUSE_GPU_VENDOR,
                          double(bytes) / double(1 << 20), cudaGetErrorString(err)));
    }
    return DeviceBuffer(p, bytes, [](void* q) { (void)cudaFree(q); });  // a deleter cannot report
  }
  // Page-locked, so that a copy_to_device from it is a true asynchronous DMA (from
  // pageable memory the runtime stages the bytes through its own pinned buffer first,
  // on the host's time). Portable: pinned for every device's context, not only this one.
  absl::StatusOr<HostBuffer> alloc_host(size_t bytes) override {
    // KVFUSE_PINNED_HOST=0: ordinary memory instead (an A/B of the staging copy: the
    // runtime may carry a small pageable copy inside its command stream, where a pinned
    // one takes the copy engine).
    if (!env_flag("KVFUSE_PINNED_HOST")) return Backend::alloc_host(bytes);
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s: cannot allocate %.1f KiB of pinned host memory (%s)", KVFUSE_GPU_VENDOR,
                          double(bytes) / 1024.0, cudaGetErrorString(err)));
    }
    return HostBuffer(p, bytes, [](void* q) { (void)cudaFreeHost(q); });  // a deleter cannot report
  }
  absl::Status memset(void* dst, int value, size_t bytes) override {
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    KVFUSE_CUDA(cudaMemsetAsync(dst, value, bytes, stream_));
    return absl::OkStatus();
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    // From pageable host memory the copy has taken the source by the time it returns,
    // so the caller may reuse its buffer at once; from pinned memory (alloc_host) it has
    // not: the source must stay untouched until the stream is synchronised.
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    if (bytes) KVFUSE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    if (bytes) KVFUSE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    KVFUSE_CUDA(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status synchronize() override {
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    KVFUSE_CUDA(cudaStreamSynchronize(stream_));
    KVFUSE_CUDA(cudaGetLastError());
    return absl::OkStatus();
  }

  absl::Status copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width_bytes,
                       int64_t rows) override {
    if (rows > 0 && width_bytes > 0) {
      KVFUSE_CUDA(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, size_t(rows),
                                    cudaMemcpyDeviceToDevice, stream_));
    }
    return absl::OkStatus();
  }
  absl::Status bind_thread() override {
    KVFUSE_CUDA(cudaSetDevice(device_));
    return absl::OkStatus();
  }
  // Memory management and copies work from any thread (a tensor-parallel engine sets up
  // every rank's memory from one): they make the device current first when it is not.
  absl::Status bind_if_needed() {
    int current = -1;
    KVFUSE_CUDA(cudaGetDevice(&current));
    if (current != device_) KVFUSE_CUDA(cudaSetDevice(device_));
    return absl::OkStatus();
  }
  void* native_stream() const override { return static_cast<void*>(stream_); }

  absl::StatusOr<LinearWeight> upload_linear(const bf16_t* w, int64_t n, int64_t k,
                                             const bf16_t* bias) override {
    LinearWeight lw;
    lw.n = n;
    lw.k = k;
    auto wb = alloc(size_t(n * k) * sizeof(bf16_t));
    if (!wb.ok()) return wb.status();
    lw.w = std::move(*wb);
    KVFUSE_RETURN_IF_ERROR(copy_to_device(lw.w.get(), w, size_t(n * k) * sizeof(bf16_t)));
    if (bias) {
      // Bias in fp32, added to the fp32 GEMM result before the one rounding (see linear).
      std::vector<float> b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) b[size_t(i)] = bf16_to_f32(bias[i]);
      auto bb = alloc(size_t(n) * sizeof(float));
      if (!bb.ok()) return bb.status();
      lw.bias = std::move(*bb);
      KVFUSE_RETURN_IF_ERROR(copy_to_device(lw.bias.get(), b.data(), b.size() * sizeof(float)));
      KVFUSE_RETURN_IF_ERROR(synchronize());  // b is a local
    }
    return lw;
  }

  absl::Status embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden,
                         bf16_t* out) override {
    return gpu_status(gpu::launch_embedding(ids, n, table, hidden, out, stream_, ops_pdl_), "embedding");
  }
  absl::Status rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out) override {
    return gpu_status(gpu::launch_rmsnorm(x, w, rows, cols, eps, out, stream_, ops_pdl_), "rmsnorm");
  }
  absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out) override {
    if (!w.bias.get()) return gemm(x, m, w, out, BLAS_R_16BF);
    // With a bias the GEMM result stays fp32 until the bias is in: one bf16 rounding.
    KVFUSE_RETURN_IF_ERROR(reserve_scratch(gemm_f32_, size_t(m * w.n) * sizeof(float), "linear: fp32"));
    KVFUSE_RETURN_IF_ERROR(gemm(x, m, w, gemm_f32_.get(), BLAS_R_32F));
    return gpu_status(
        gpu::launch_bias_round(gemm_f32_.as<float>(), w.bias.as<float>(), m, w.n, out, stream_, ops_pdl_),
        "bias_round");
  }
  absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) override {
    return gemm(x, m, w, out, BLAS_R_32F);
  }
  // Where the tuner picked kvfuse's GEMV for this shape, it stores into the targets from its
  // epilogue; elsewhere linear, then launch_push_copy.
  absl::Status linear_push(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out,
                           const PushTargets& push) override {
    if (m <= 0) return absl::OkStatus();
    if (push.count < 0 || push.count > PushTargets::kMax) {
      return absl::InvalidArgumentError(absl::StrCat("linear_push: ", push.count, " targets"));
    }
    if (!w.bias.get() && gemv_usable(x, m, w, out)) {
      auto plan = gemm_plan(x, m, w, out, BLAS_R_16BF);
      if (!plan.ok()) return plan.status();
      if ((*plan)->gemv >= 0) {
        return gpu_status(
            gpu::launch_gemv_push_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, push, stream_, ops_pdl_,
                                       (*plan)->gemv, gemv_stream_, gemv_push_staged_),
            "gemv push");
      }
    }
    KVFUSE_RETURN_IF_ERROR(linear(x, m, w, out));
    return gpu_status(gpu::launch_push_copy(out, m * w.n, push, stream_, ops_pdl_), "push_copy");
  }
  absl::Status rope(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                    int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                    const float* inv_freq, float attention_scaling) override {
    return gpu_status(gpu::launch_rope_neox(q, q_stride, q_heads, k, k_stride, kv_heads, head_dim, positions,
                                            n, inv_freq, attention_scaling, stream_, ops_pdl_),
                      "rope");
  }
  absl::Status silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) override {
    return gpu_status(gpu::launch_silu_mul(gate_up, n, inter, out, stream_, ops_pdl_), "silu_mul");
  }
  // At the sizes where the tuner picked kvfuse's GEMV for gate/up, the GEMV writes act
  // from its epilogue (no silu_mul launch, no gate_up rows); elsewhere linear, then
  // silu_mul. KVFUSE_GEMV_SILU=0 keeps the two launches (the A/B).
  absl::Status linear_silu_mul(const bf16_t* x, int64_t m, const LinearWeight& w, int64_t inter, bf16_t* gate_up,
                               bf16_t* act) override {
    static const bool fuse = env_flag("KVFUSE_GEMV_SILU");
    if (fuse && m > 0 && !w.bias.get() && w.n == 2 * inter && gemv_usable(x, m, w, gate_up) &&
        gpu::gemv_unsupported(x, m, w.w.get(), w.n, w.k, act).empty()) {
      auto plan = gemm_plan(x, m, w, gate_up, BLAS_R_16BF);
      if (!plan.ok()) return plan.status();
      if ((*plan)->gemv >= 0) {
        return gpu_status(gpu::launch_gemv_silu_mul_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, act, stream_,
                                                         ops_pdl_, (*plan)->gemv, gemv_stream_),
                          "gemv silu_mul");
      }
    }
    return Backend::linear_silu_mul(x, m, w, inter, gate_up, act);
  }
  absl::Status add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out) override {
    return gpu_status(gpu::launch_add_rmsnorm(x, y, w, rows, cols, eps, out, stream_, ops_pdl_),
                      "add_rmsnorm");
  }
  absl::Status residual_add(bf16_t* x, const bf16_t* y, int64_t count) override {
    return gpu_status(gpu::launch_residual_add(x, y, count, stream_, ops_pdl_), "residual_add");
  }
  absl::Status gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           bf16_t* out) override {
    return gpu_status(gpu::launch_gather_rows(x, cols, rows, n, out, stream_, ops_pdl_), "gather_rows");
  }

  absl::Status kv_write(const KvWriteArgs& args, KvWritePath path) override {
    if (path == KvWritePath::fused) {
      return gpu_status(gpu::launch_kv_write_fused(args, stream_, kv_launch_), "kv_write_fused");
    }
    if (path != KvWritePath::unfused) {
      return absl::InvalidArgumentError("kv_write: the fused_rope path runs through kv_write_rope");
    }
    KVFUSE_RETURN_IF_ERROR(reserve_scratch(
        kv_scratch_, gpu::kv_write_scratch_bytes(args.num_tokens, args.cache.row_elems()), "kv_write: unfused"));
    return gpu_status(gpu::launch_kv_write_unfused(args, kv_scratch_.get(), stream_, kv_launch_),
                      "kv_write_unfused");
  }
  absl::Status kv_write_rope(const KvWriteRopeArgs& args) override {
    return gpu_status(gpu::launch_kv_write_rope(args, stream_, kv_launch_), "kv_write_rope");
  }
  absl::Status reserve_kv_write(int64_t max_tokens, int64_t row_elems) override {
    return reserve_scratch(kv_scratch_, gpu::kv_write_scratch_bytes(max_tokens, row_elems), "kv_write: unfused",
                           /*slack=*/1);
  }
  absl::Status attention(const AttnArgs& args, AttentionPath path) override {
    return attention_launch(args, path, nullptr);
  }
  // At decode-only steps the attention kernel takes RoPE and the KV write in (one launch
  // instead of two, the same bytes; gpu::attention_rope_unsupported says where it cannot);
  // elsewhere, and with KVFUSE_ROPE_IN_ATTENTION=0 (the A/B), kv_write_rope then attention.
  // Attention arguments the kernel refuses are refused before anything is written
  // (attention_launch checks them first; the two launches are checked here).
  absl::Status attention_rope(const AttnArgs& args, const KvWriteRopeArgs& rope,
                              AttentionPath path) override {
    if (rope_in_attention_ && gpu::attention_rope_unsupported(args, rope, attn_launch_).empty()) {
      return attention_launch(args, path, &rope);
    }
    if (const std::string why = gpu::attention_unsupported(args); !why.empty()) {
      return absl::InvalidArgumentError(why);
    }
    return Backend::attention_rope(args, rope, path);
  }
  absl::Status attention_launch(const AttnArgs& args, AttentionPath path, const KvWriteRopeArgs* rope) {
    if (const std::string why = gpu::attention_unsupported(args); !why.empty()) {
      return absl::InvalidArgumentError(why);
    }
    // The unified kernel gives a decode row one block: a decode-only batch too small to
    // fill the device with (sequence, KV head) blocks would leave most multiprocessors
    // idle on long contexts (batch 1 x 32768 keys: 22 ms against 6.3 ms a step for
    // llama3-8b on an H200). Such a batch takes the split-KV kernel; any batch with
    // prefill rows, or a decode batch the split heuristic would not split, stays on the
    // one unified launch.
    const bool decode_only = args.batch.max_query_len == 1;
    const int32_t min_keys = decode_only ? split_min_keys_decode_ : kSplitPartition;
    const bool small_decode =
        decode_only &&
        int64_t(gpu::attention_split_partition(args, min_keys, attn_launch_)) < int64_t(args.batch.max_context_len);
    if (path == AttentionPath::unified && !small_decode) {
      return gpu_status(gpu::launch_attention_unified(args, stream_, attn_launch_, rope),
                        "attention_unified");
    }
    const size_t partials = gpu::attention_split_scratch_bytes(args, min_keys, attn_launch_);
    KVFUSE_RETURN_IF_ERROR(reserve_scratch(split_scratch_, partials, "attention: split"));
    // Counters only where there are partitions to merge: a prefill step that splits into
    // one partition must not grow them (a growth recaptures every graph).
    int32_t* counters = nullptr;
    if (!merge_kernel_ && partials > 0) {
      KVFUSE_RETURN_IF_ERROR(reserve_scratch(split_counters_,
                                             size_t(gpu::attention_split_merge_counters(args)) * sizeof(int32_t),
                                             "attention: split merge counters", /*slack=*/2, /*zero=*/true));
      counters = split_counters_.as<int32_t>();
    }
    return gpu_status(gpu::launch_attention_split(args, split_scratch_.get(), min_keys, stream_, attn_launch_,
                                                  counters, rope),
                      "attention_split");
  }
  absl::Status argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                           int32_t* finite) override {
    return gpu_status(gpu::launch_argmax_rows(logits, rows, vocab, tokens, finite, stream_, ops_pdl_),
                      "argmax_rows");
  }

  absl::Status sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                           int32_t* tokens) override {
    return gpu_status(gpu::launch_sample_rows(logits, rows, vocab, params, tokens, stream_), "sample_rows");
  }

  absl::Status logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                             const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                             LogprobOut* out) override {
    return gpu_status(
        gpu::launch_logprobs_rows(logits, rows, vocab, req, greedy, sampled, params, out, stream_),
        "logprobs_rows");
  }

  // KVFUSE_GEMM_TUNE_WHILE_SERVING=1 keeps timing new shapes (the behaviour before the
  // server ended tuning after its warm-up), for A/B runs.
  bool end_gemm_tuning() override {
    static const bool keep = env_flag("KVFUSE_GEMM_TUNE_WHILE_SERVING");
    if (!keep) tuning_ended_.store(true, std::memory_order_relaxed);
    return !keep;
  }
  int64_t gemm_shapes_timed() const override { return shapes_timed_.load(std::memory_order_relaxed); }

  bool supports_graphs() const override { return true; }
  absl::Status begin_capture() override {
    if (capturing_) return absl::FailedPreconditionError("begin_capture: a capture is already open");
    // Thread-local mode: other threads' runtime calls neither join nor break the capture.
    KVFUSE_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<BackendGraph>> end_capture() override {
    if (!capturing_) return absl::FailedPreconditionError("end_capture without begin_capture");
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    KVFUSE_CUDA(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    const cudaError_t destroyed = cudaGraphDestroy(graph);  // the exec holds what it needs
    KVFUSE_CUDA(err);
    KVFUSE_CUDA(destroyed);
    return std::unique_ptr<BackendGraph>(new Graph(exec, stream_));
  }
  uint64_t graph_epoch() const override { return graph_epoch_; }

 private:
  GpuBackend() = default;

  // Grows one of the backend's scratch buffers to at least `need` bytes (`slack` times
  // that, so growth is rare). Growth replaces memory a captured graph may use: it synchronizes
  // first, bumps graph_epoch, and is refused during a capture (the runner's eager first
  // step of each graph bucket grows every buffer before it captures).
  // zero: the new buffer starts zero-filled (the split attention's merge counters).
  absl::Status reserve_scratch(DeviceBuffer& buf, size_t need, const char* what, size_t slack = 2,
                               bool zero = false) {
    if (need <= buf.bytes()) return absl::OkStatus();
    if (capturing_) return absl::FailedPreconditionError(absl::StrCat(what, " scratch must grow during a capture"));
    KVFUSE_RETURN_IF_ERROR(synchronize());  // the old buffer may still be in use
    auto b = alloc(need * slack);
    if (!b.ok()) return b.status();
    if (zero) KVFUSE_CUDA(cudaMemsetAsync(b->get(), 0, b->bytes(), stream_));
    buf = std::move(*b);
    ++graph_epoch_;
    return absl::OkStatus();
  }

  absl::Status init(int device) {
    device_ = device;
    KVFUSE_CUDA(cudaSetDevice(device));
    cudaDeviceProp prop{};
    KVFUSE_CUDA(cudaGetDeviceProperties(&prop, device));
#if defined(KVFUSE_HIP)
    // gfx940/gfx941/gfx942 (MI300A/X, MI325X) store e4m3 as FNUZ; gfx950 and later use
    // OCP e4m3fn. gcnArchName carries feature suffixes ("gfx942:sramecc+:xnack-").
    const std::string arch = prop.gcnArchName;
    fnuz_ = arch.rfind("gfx940", 0) == 0 || arch.rfind("gfx941", 0) == 0 || arch.rfind("gfx942", 0) == 0;
    // The kernels are built for 64-lane wavefronts (kernels/common/vendor/hip.h).
    if (prop.warpSize != gpu::kWarpSize) {
      return absl::FailedPreconditionError(
          absl::StrFormat("hip: %s (%s) runs %d-lane wavefronts; kvfuse's kernels need %d (CDNA)", prop.name,
                          arch, prop.warpSize, gpu::kWarpSize));
    }
    description_ =
        absl::StrFormat("hip %s (%s, %.0f GiB)", prop.name, arch, double(prop.totalGlobalMem) / (1 << 30));
#else
    fnuz_ = false;
    // Programmatic dependent launch lets the write's launch overlap the kernel before it
    // (about 0.3 us a call on an H200, bench/journal/results/kv_write_h200.txt); the kernels wait
    // in-kernel before touching memory, so it is safe after any kernel.
    kv_launch_.pdl = prop.major >= 9;
    // The other kernels of a step too (each waits for the kernel before it in-kernel);
    // KVFUSE_PDL_OPS=0 leaves them as plain launches, for the A/B.
    ops_pdl_ = kv_launch_.pdl && env_flag("KVFUSE_PDL_OPS");
    attn_launch_.pdl = ops_pdl_;
    // KVFUSE_ATTN_MERGE_KERNEL=1: the split path's merge as a kernel of its own (the A/B).
    merge_kernel_ = env_flag("KVFUSE_ATTN_MERGE_KERNEL");
    // KVFUSE_GEMV_STREAM=0: the GEMV loads its weights as it loads x (through L1), the A/B
    // of its streaming loads.
    gemv_stream_ = env_flag("KVFUSE_GEMV_STREAM");
    gemv_push_staged_ = env_flag("KVFUSE_GEMV_PUSH_STAGED");
    // KVFUSE_ROPE_IN_ATTENTION=0: fused_rope's write as a kernel of its own before
    // attention at every step (the A/B of taking it into attention).
    rope_in_attention_ = env_flag("KVFUSE_ROPE_IN_ATTENTION");
    description_ = absl::StrFormat("cuda %s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
                                   double(prop.totalGlobalMem) / (1 << 30));
#endif
    if (const std::optional<std::string> v = env_value("KVFUSE_SPLIT_MIN_KEYS")) {
      int32_t keys = 0;
      if (!absl::SimpleAtoi(*v, &keys) || keys < 16 || keys > 65536 || keys % 16 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("KVFUSE_SPLIT_MIN_KEYS=", *v, ": a multiple of 16 from 16 to 65536 expected"));
      }
      split_min_keys_decode_ = keys;
    }
    KVFUSE_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KVFUSE_BLAS(blasLtCreate(&blas_));
#if defined(KVFUSE_HIP)
    algo_device_ = absl::StrCat(prop.name, " ", prop.gcnArchName, " ", KVFUSE_BLASLT_NAME, " ", blaslt_version(blas_));
#else
    algo_device_ = absl::StrCat(prop.name, " sm_", prop.major, prop.minor, " ", KVFUSE_BLASLT_NAME, " ",
                                blaslt_version(blas_));
#endif
    auto ws = alloc(kBlasWorkspace);
    if (!ws.ok()) return ws.status();
    blas_workspace_ = std::move(*ws);
    return absl::OkStatus();
  }

  // GEMM plans: descriptors per shape (host objects, made once), and the algorithm.
  struct GemmKey {
    int64_t m, n, k;
    int out_type;
    bool operator<(const GemmKey& o) const {
      return std::tie(m, n, k, out_type) < std::tie(o.m, o.n, o.k, o.out_type);
    }
  };
  struct GemmPlan {
    blasLtMatmulDesc_t desc = nullptr;
    blasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    blasLtMatmulAlgo_t algo{};
    int gemv = -1;  // >= 0: kvfuse's GEMV (kernels/gemm/gemv.cuh) of that variant instead of the library
    int skinny = -1;  // >= 0: kvfuse's skinny GEMM (kernels/gemm/gemm_skinny.cuh) of that variant
    GemmPlan() = default;
    GemmPlan(const GemmPlan&) = delete;
    GemmPlan& operator=(const GemmPlan&) = delete;
    ~GemmPlan() {
      if (d) blasLtMatrixLayoutDestroy(d);
      if (b) blasLtMatrixLayoutDestroy(b);
      if (a) blasLtMatrixLayoutDestroy(a);
      if (desc) blasLtMatmulDescDestroy(desc);
    }
  };
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
  // Choices are shared by every backend in the process and kept in the GEMM cache file
  // (src/backends/gemm_cache.h: KVFUSE_GEMM_CACHE, default ~/.cache/kvfuse/gemm-algos.json),
  // keyed by device, library version and shape, so that every process on the machine (two
  // servers A/B-ed side by side) runs the same kernels and a restart does not tune again.
  // KVFUSE_GEMM_TUNE_LOG=1 prints each decision to stderr. Shapes of at most
  // gpu::kGemvMaxRows rows also time kvfuse's GEMV (kernels/gemm/gemv.cuh) the same way, and
  // run it where it is the fastest (KVFUSE_GEMV=0 leaves it out).
  static constexpr int64_t kTuneMaxRows = 512;
  static constexpr int kTuneCandidates = 8;
  static constexpr int kTuneCalls = 16;
  // Twice the largest last-level cache kvfuse runs on: MI300X and MI355X have a 256 MB
  // Infinity Cache behind their L2 (an H200's L2 is 60 MB).
  static constexpr size_t kL2FlushBytes = size_t(512) << 20;
  enum class TuneMode { off, graph, isolated };
  static TuneMode tune_mode() {
    const std::string s = env_value("KVFUSE_GEMM_TUNE").value_or(env_default("KVFUSE_GEMM_TUNE"));
    if (s == "0" || s == "off") return TuneMode::off;
    if (s == "isolated") return TuneMode::isolated;
    return TuneMode::graph;
  }
  static std::mutex& tuned_mutex() {
    static std::mutex m;
    return m;
  }
  struct TunedChoice {
    blasLtMatmulAlgo_t algo;
    int gemv;    // as GemmPlan::gemv
    int skinny;  // as GemmPlan::skinny
  };
  static std::map<std::pair<int, GemmKey>, TunedChoice>& tuned_algos() {
    static auto* m = new std::map<std::pair<int, GemmKey>, TunedChoice>();
    return *m;
  }
  static GemmAlgoCache& algo_cache() {
    static auto* c = new GemmAlgoCache(GemmAlgoCache::default_path());
    return *c;
  }
  // Choices made with the skinny GEMM among the candidates are kept apart from those made
  // without it (KVFUSE_GEMM_SKINNY=0, m above KVFUSE_GEMM_SKINNY_ROWS, or a file written
  // before it existed), so raising KVFUSE_GEMM_SKINNY_ROWS tunes the newly offered shapes.
  GemmCacheKey cache_key(const GemmKey& k) const {
    const bool skinny = skinny_enabled() && k.m <= skinny_rows();
    return GemmCacheKey{skinny ? algo_device_ + " +skinny" : algo_device_, k.m, k.n, k.k,
                        k.out_type == int(BLAS_R_32F) ? "f32" : "bf16"};
  }

  // Milliseconds per call of `algo`, timed as TuneMode::graph says; negative when the
  // candidate cannot run. `weights` are the copies to rotate over.
  float time_in_graph(GemmPlan& plan, const bf16_t* x, void* out, const blasLtMatmulAlgo_t& algo,
                      const std::vector<const void*>& weights, cudaEvent_t e0, cudaEvent_t e1) {
    const float alpha = 1.0f, beta = 0.0f;
    return time_calls_in_graph(
        [&](const void* w) {
          return blasLtMatmul(blas_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, out, plan.d, out, plan.d, &algo,
                              blas_workspace_.get(), blas_workspace_.bytes(), stream_) == BLAS_STATUS_SUCCESS;
        },
        weights, e0, e1);
  }

  // The same for kvfuse's GEMV.
  float time_gemv_in_graph(const bf16_t* x, int64_t m, const LinearWeight& w, void* out, bool out_f32, int variant,
                           const std::vector<const void*>& weights, cudaEvent_t e0, cudaEvent_t e1) {
    return time_calls_in_graph(
        [&](const void* wc) {
          return gpu::launch_gemv_bf16(x, m, static_cast<const bf16_t*>(wc), w.n, w.k, out, out_f32, stream_,
                                       ops_pdl_, variant, gemv_stream_)
              .ok();
        },
        weights, e0, e1);
  }

  // The same for kvfuse's skinny GEMM.
  float time_skinny_in_graph(const bf16_t* x, int64_t m, const LinearWeight& w, void* out, bool out_f32,
                             int variant, const std::vector<const void*>& weights, cudaEvent_t e0,
                             cudaEvent_t e1) {
    return time_calls_in_graph(
        [&](const void* wc) {
          return gpu::launch_gemm_skinny_bf16(x, m, static_cast<const bf16_t*>(wc), w.n, w.k, out, out_f32,
                                              stream_, ops_pdl_, variant, skinny_early_weights())
              .ok();
        },
        weights, e0, e1);
  }

  // kTuneCalls calls of `call(weights)` captured back to back in a graph: one warm replay,
  // then the fastest of three, per call; negative when a call fails.
  template <class Call>
  float time_calls_in_graph(Call&& call, const std::vector<const void*>& weights, cudaEvent_t e0, cudaEvent_t e1) {
    // Once eagerly: the candidate runs at all, and its kernel is loaded before the capture.
    if (!call(weights[0]) || cudaStreamSynchronize(stream_) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1.0f;
    }
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0f;
    bool ok = true;
    for (int i = 0; i < kTuneCalls; ++i) ok = call(weights[size_t(i) % weights.size()]) && ok;
    cudaGraph_t graph = nullptr;
    ok = cudaStreamEndCapture(stream_, &graph) == cudaSuccess && ok;
    cudaGraphExec_t exec = nullptr;
    ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (graph) (void)cudaGraphDestroy(graph);
    float best = -1.0f;
    // One warm replay, then the fastest of three: the others are the machine's noise.
    for (int r = 0; r < 4 && ok; ++r) {
      ok = cudaEventRecord(e0, stream_) == cudaSuccess && cudaGraphLaunch(exec, stream_) == cudaSuccess &&
           cudaEventRecord(e1, stream_) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess;
      float t_ms = 0.0f;
      ok = ok && cudaEventElapsedTime(&t_ms, e0, e1) == cudaSuccess;
      if (ok && r > 0 && (best < 0 || t_ms < best)) best = t_ms;
    }
    if (exec) (void)cudaGraphExecDestroy(exec);
    if (!ok) {
      (void)cudaGetLastError();
      return -1.0f;
    }
    return best / float(kTuneCalls);
  }

  // The older method (TuneMode::isolated): each call alone after a cache flush.
  float time_isolated(GemmPlan& plan, const bf16_t* x, void* out, const void* w, const blasLtMatmulAlgo_t& algo,
                      cudaEvent_t e0, cudaEvent_t e1) {
    const float alpha = 1.0f, beta = 0.0f;
    auto launch = [&] {
      return blasLtMatmul(blas_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, out, plan.d, out, plan.d, &algo,
                          blas_workspace_.get(), blas_workspace_.bytes(), stream_);
    };
    if (launch() != BLAS_STATUS_SUCCESS) return -1.0f;
    float total = 0.0f;
    bool ok = true;
    for (int r = 0; r < 3 && ok; ++r) {
      ok = cudaMemsetAsync(l2_flush_.get(), r, l2_flush_.bytes(), stream_) == cudaSuccess &&
           cudaEventRecord(e0, stream_) == cudaSuccess && launch() == BLAS_STATUS_SUCCESS &&
           cudaEventRecord(e1, stream_) == cudaSuccess;
      float t_ms = 0.0f;
      ok = ok && cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&t_ms, e0, e1) == cudaSuccess;
      total += t_ms;
    }
    return ok ? total / 3.0f : -1.0f;
  }

  // The variant a cache entry's "kernel" names ("<prefix>N", N < variants), or -1.
  static int kernel_variant_of(const std::string& kernel, const std::string& prefix, int variants) {
    if (kernel.rfind(prefix, 0) != 0) return -1;
    const std::string rest = kernel.substr(prefix.size());
    if (rest.empty() || rest.size() > 2 || rest.find_first_not_of("0123456789") != std::string::npos) return -1;
    const int v = std::stoi(rest);
    return v < variants ? v : -1;
  }

  // kvfuse's GEMV may run this call (it is a candidate and the operands suit it).
  static bool gemv_enabled() {
    static const bool on = env_flag("KVFUSE_GEMV");  // read once: gemm() asks on every call
    return on;
  }
  static bool gemv_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out) {
    return gemv_enabled() && gpu::gemv_unsupported(x, m, w.w.get(), w.n, w.k, out).empty();
  }
  // kvfuse's skinny GEMM the same way (KVFUSE_GEMM_SKINNY=0 leaves it out: the A/B), for
  // calls of at most KVFUSE_GEMM_SKINNY_ROWS rows (default 16, at most 64). Above 16 rows
  // its calls won in the tuner's graphs and the llama3-8b step still lost 1-2% at batch 32
  // on an H200, attention before it slower by about 3.5 us a layer (bench/journal/2026-12-02.md).
  static bool skinny_enabled() {
    static const bool on = env_flag("KVFUSE_GEMM_SKINNY");
    return on;
  }
  static int64_t skinny_rows() {
    static const int64_t rows = [] {
      const std::optional<std::string> v = env_value("KVFUSE_GEMM_SKINNY_ROWS");
      const long long r = std::atoll(v ? v->c_str() : env_default("KVFUSE_GEMM_SKINNY_ROWS"));
      return int64_t(std::clamp<long long>(r, 0, gpu::kSkinnyMaxRows));
    }();
    return rows;
  }
  // Whether its first weights are read before the kernel in front of it has finished
  // (KVFUSE_GEMM_SKINNY_EARLY=0: after).
  static bool skinny_early_weights() {
    static const bool on = env_flag("KVFUSE_GEMM_SKINNY_EARLY");
    return on;
  }
  static bool skinny_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out, int variant) {
    return skinny_enabled() && m <= skinny_rows() &&
           gpu::skinny_unsupported(x, m, w.w.get(), w.n, w.k, out, variant).empty();
  }

  absl::StatusOr<GemmPlan*> gemm_plan(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                                      decltype(BLAS_R_32F) out_type) {
    const GemmKey key{m, w.n, w.k, int(out_type)};
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second.get();
    auto plan = std::make_unique<GemmPlan>();
    const auto t = BLAS_OP_T, n = BLAS_OP_N;
    KVFUSE_BLAS(blasLtMatmulDescCreate(&plan->desc, BLAS_COMPUTE_32F, BLAS_R_32F));
    KVFUSE_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    KVFUSE_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan->a, BLAS_R_16BF, uint64_t(w.k), uint64_t(w.n), int64_t(w.k)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan->b, BLAS_R_16BF, uint64_t(w.k), uint64_t(m), int64_t(w.k)));
    KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan->d, out_type, uint64_t(w.n), uint64_t(m), int64_t(w.n)));

    const TuneMode mode = capturing_ || m > kTuneMaxRows ? TuneMode::off : tune_mode();
    // After end_gemm_tuning(): choices already made are still taken, none is timed.
    const bool may_time = !tuning_ended_.load(std::memory_order_relaxed);
    const std::pair<int, GemmKey> tuned_key{device_, key};
    int cached_gemv = -1, cached_skinny = -1;
    if (mode != TuneMode::off) {
      std::lock_guard<std::mutex> lock(tuned_mutex());
      auto it = tuned_algos().find(tuned_key);
      if (it != tuned_algos().end()) {
        plan->algo = it->second.algo;
        plan->gemv = it->second.gemv;
        plan->skinny = it->second.skinny;
        return plans_.emplace(key, std::move(plan)).first->second.get();
      }
      // Another process's choice for this device, library and shape.
      auto cached = algo_cache().find(cache_key(key));
      // kvfuse's GEMV: the library's first choice is still looked up below, for calls
      // whose operands the GEMV does not take.
      cached_gemv = cached ? kernel_variant_of(cached->kernel, "kvfuse-gemv/", gpu::gemv_variants(m)) : -1;
      if (!gemv_usable(x, m, w, out)) cached_gemv = -1;
      cached_skinny = cached ? kernel_variant_of(cached->kernel, "kvfuse-skinny/", gpu::kSkinnyVariants) : -1;
      if (cached_skinny >= 0 && !skinny_usable(x, m, w, out, cached_skinny)) cached_skinny = -1;
      if (cached && cached->kernel.empty() && cached->algo.size() == sizeof(blasLtMatmulAlgo_t)) {
        std::memcpy(&plan->algo, cached->algo.data(), sizeof(blasLtMatmulAlgo_t));
        const float alpha = 1.0f, beta = 0.0f;
        // It must run here (the file could come from another build of the same version).
        if (blasLtMatmul(blas_, plan->desc, &alpha, w.w.get(), plan->a, x, plan->b, &beta, out, plan->d, out, plan->d,
                         &plan->algo, blas_workspace_.get(), blas_workspace_.bytes(), stream_) == BLAS_STATUS_SUCCESS) {
          tuned_algos().emplace(tuned_key, TunedChoice{plan->algo, -1, -1});
          return plans_.emplace(key, std::move(plan)).first->second.get();
        }
        (void)cudaGetLastError();
      }
    }
    struct Pref {
      blasLtMatmulPreference_t p = nullptr;
      ~Pref() {
        if (p) blasLtMatmulPreferenceDestroy(p);
      }
    } pref;
    KVFUSE_BLAS(blasLtMatmulPreferenceCreate(&pref.p));
    const size_t ws = blas_workspace_.bytes();
    KVFUSE_BLAS(
        blasLtMatmulPreferenceSetAttribute(pref.p, BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    blasLtMatmulHeuristicResult_t heur[kTuneCandidates] = {};
    int found_n = 0;
    const bool timed = mode != TuneMode::off && may_time && cached_gemv < 0 && cached_skinny < 0;
    KVFUSE_BLAS(blasLtMatmulAlgoGetHeuristic(blas_, plan->desc, plan->a, plan->b, plan->d, plan->d, pref.p,
                                             timed ? kTuneCandidates : 1, heur, &found_n));
    if (found_n == 0) {
      return absl::InternalError(
          absl::StrCat(KVFUSE_BLASLT_NAME, ": no algorithm for a ", m, "x", w.n, "x", w.k, " bf16 GEMM"));
    }
    int best = 0;
    std::vector<float> ms(size_t(found_n), -1.0f);
    float gemv_ms = -1.0f, skinny_ms = -1.0f;
    int gemv_best = -1, skinny_best = -1;
    if (timed && found_n > 1) {
      // Timed on the real operands (the output is rewritten by the call that follows).
      if (l2_flush_.bytes() == 0) {
        auto f = alloc(kL2FlushBytes);
        if (!f.ok()) return f.status();
        l2_flush_ = std::move(*f);
      }
      // The graph method's weight copies: the weights themselves, then as many copies as
      // fit in the flush buffer (none for weights of its size or more).
      std::vector<const void*> weights = {w.w.get()};
      const size_t wbytes = w.w.bytes();
      for (size_t at = 0; mode == TuneMode::graph && at + wbytes <= l2_flush_.bytes() && weights.size() < size_t(kTuneCalls);
           at += wbytes) {
        char* dst = l2_flush_.as<char>() + at;
        KVFUSE_CUDA(cudaMemcpyAsync(dst, w.w.get(), wbytes, cudaMemcpyDeviceToDevice, stream_));
        weights.push_back(dst);
      }
      cudaEvent_t e0 = nullptr, e1 = nullptr;
      KVFUSE_CUDA(cudaEventCreate(&e0));
      KVFUSE_CUDA(cudaEventCreate(&e1));
      for (int c = 0; c < found_n; ++c) {
        ms[size_t(c)] = mode == TuneMode::graph ? time_in_graph(*plan, x, out, heur[c].algo, weights, e0, e1)
                                                : time_isolated(*plan, x, out, w.w.get(), heur[c].algo, e0, e1);
      }
      for (int v = 0; mode == TuneMode::graph && gemv_usable(x, m, w, out) && v < gpu::gemv_variants(m); ++v) {
        const float t_ms = time_gemv_in_graph(x, m, w, out, out_type == BLAS_R_32F, v, weights, e0, e1);
        if (t_ms >= 0 && (gemv_ms < 0 || t_ms < gemv_ms)) {
          gemv_ms = t_ms;
          gemv_best = v;
        }
      }
      for (int v = 0; mode == TuneMode::graph && v < gpu::kSkinnyVariants; ++v) {
        if (!skinny_usable(x, m, w, out, v)) continue;
        const float t_ms = time_skinny_in_graph(x, m, w, out, out_type == BLAS_R_32F, v, weights, e0, e1);
        if (env_flag("KVFUSE_GEMM_TUNE_LOG")) {
          std::fprintf(
              stderr,
              "kvfuse gemm tune %lldx%lldx%lld: kvfuse skinny variant %d (%d splits, %d rows) %.4f ms\n",
              (long long)m, (long long)w.n, (long long)w.k, v, gpu::skinny_splits(v),
              gpu::skinny_block_rows(v), double(t_ms));
        }
        if (t_ms >= 0 && (skinny_ms < 0 || t_ms < skinny_ms)) {
          skinny_ms = t_ms;
          skinny_best = v;
        }
      }
      KVFUSE_CUDA(cudaEventDestroy(e0));
      KVFUSE_CUDA(cudaEventDestroy(e1));
      KVFUSE_CUDA(cudaStreamSynchronize(stream_));
      shapes_timed_.fetch_add(1, std::memory_order_relaxed);
      for (int c = 0; c < found_n; ++c) {
        if (ms[size_t(c)] >= 0 && (ms[size_t(best)] < 0 || ms[size_t(c)] < ms[size_t(best)])) best = c;
      }
      // The fastest of the three kinds; the library on a tie.
      const auto faster = [](float a, float b) { return a >= 0 && (b < 0 || a < b); };
      const float lib_ms = ms[size_t(best)];
      if (faster(gemv_ms, lib_ms) && !faster(skinny_ms, gemv_ms)) {
        plan->gemv = gemv_best;
      } else if (faster(skinny_ms, lib_ms)) {
        plan->skinny = skinny_best;
      }
      if (env_flag("KVFUSE_GEMM_TUNE_LOG")) {
        std::fprintf(stderr,
                     "kvfuse gemm tune (%s) %lldx%lldx%lld %s: %d candidates, heuristic first %.4f ms, best #%d "
                     "%.4f ms, kvfuse gemv %.4f ms (variant %d), kvfuse skinny %.4f ms (variant %d): %s\n",
                     mode == TuneMode::graph ? "graph" : "isolated", (long long)m, (long long)w.n, (long long)w.k,
                     out_type == BLAS_R_32F ? "f32" : "bf16", found_n, double(ms[0]), best, double(lib_ms),
                     double(gemv_ms), gemv_best, double(skinny_ms), skinny_best,
                     plan->gemv >= 0 ? "gemv" : plan->skinny >= 0 ? "skinny" : "library");
      }
    }
    plan->algo = heur[best].algo;
    if (cached_gemv >= 0) plan->gemv = cached_gemv;
    if (cached_gemv < 0 && cached_skinny >= 0) plan->skinny = cached_skinny;
    // An untimed pick after end_gemm_tuning() stays with this backend: the process's
    // choices (and the file) are for timed ones and the file's.
    if (mode != TuneMode::off && (may_time || cached_gemv >= 0 || cached_skinny >= 0)) {
      std::lock_guard<std::mutex> lock(tuned_mutex());
      tuned_algos().emplace(tuned_key, TunedChoice{plan->algo, plan->gemv, plan->skinny});
      // A choice made without the GEMV (KVFUSE_GEMV=0) stays in this process: the file is
      // for choices among every candidate.
      const bool every_candidate = gemv_enabled() || m > gpu::kGemvMaxRows;
      if (timed && every_candidate && mode == TuneMode::graph && found_n > 1 && ms[size_t(best)] >= 0) {
        GemmCacheEntry e;
        if (plan->gemv >= 0) {
          e.kernel = "kvfuse-gemv/" + std::to_string(plan->gemv);
          e.us = double(gemv_ms) * 1e3;
        } else if (plan->skinny >= 0) {
          e.kernel = "kvfuse-skinny/" + std::to_string(plan->skinny);
          e.us = double(skinny_ms) * 1e3;
        } else {
          e.algo.resize(sizeof(blasLtMatmulAlgo_t));
          std::memcpy(e.algo.data(), &plan->algo, sizeof(blasLtMatmulAlgo_t));
          e.us = double(ms[size_t(best)]) * 1e3;
        }
        e.method = "graph";
        if (absl::Status st = algo_cache().store(cache_key(key), e); !st.ok() && !cache_warned_) {
          cache_warned_ = true;  // once: the choice still holds for this process
          std::fprintf(stderr, "kvfuse: %s (GEMM choices are not shared with other processes)\n",
                       std::string(st.message()).c_str());
        }
      }
    }
    return plans_.emplace(key, std::move(plan)).first->second.get();
  }

  // out[m, n] = x[m, k] * w[n, k]^T, fp32 accumulation. Column-major view: out^T (n x m)
  // = op(W) (n x k, W stored k x n, transposed) * x^T (k x m).
  absl::Status gemm(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                    decltype(BLAS_R_32F) out_type) {
    if (m <= 0) return absl::OkStatus();
    auto plan = gemm_plan(x, m, w, out, out_type);
    if (!plan.ok()) return plan.status();
    GemmPlan& p = **plan;
    if (p.gemv >= 0 && gemv_usable(x, m, w, out)) {
      return gpu_status(gpu::launch_gemv_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, out_type == BLAS_R_32F,
                                              stream_, ops_pdl_, p.gemv, gemv_stream_),
                        "gemv");
    }
    if (p.skinny >= 0 && skinny_usable(x, m, w, out, p.skinny)) {
      return gpu_status(
          gpu::launch_gemm_skinny_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, out_type == BLAS_R_32F, stream_,
                                       ops_pdl_, p.skinny, skinny_early_weights()),
          "skinny gemm");
    }
    const float alpha = 1.0f, beta = 0.0f;
    KVFUSE_BLAS(blasLtMatmul(blas_, p.desc, &alpha, w.w.get(), p.a, x, p.b, &beta, out, p.d, out, p.d, &p.algo,
                             blas_workspace_.get(), blas_workspace_.bytes(), stream_));
    return absl::OkStatus();
  }

  class Graph final : public BackendGraph {
   public:
    Graph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
    ~Graph() override { (void)cudaGraphExecDestroy(exec_); }  // best effort, as in ~GpuBackend
    absl::Status replay() override {
      KVFUSE_CUDA(cudaGraphLaunch(exec_, stream_));
      return absl::OkStatus();
    }

   private:
    cudaGraphExec_t exec_;
    cudaStream_t stream_;
  };

  std::string description_;
  std::string algo_device_;  // the GEMM cache's device key: name, architecture, library and version
  std::atomic<bool> tuning_ended_{false};  // end_gemm_tuning()
  std::atomic<int64_t> shapes_timed_{0};   // gemm_shapes_timed()
  bool cache_warned_ = false;
  int device_ = 0;
  std::map<GemmKey, std::unique_ptr<GemmPlan>> plans_;
  bool fnuz_ = false;
  bool capturing_ = false;
  uint64_t graph_epoch_ = 0;
  gpu::KvWriteLaunch kv_launch_;
  gpu::AttnLaunch attn_launch_;
  int32_t split_min_keys_decode_ = kSplitPartitionDecode;
  bool merge_kernel_ = false;  // split attention: a merge kernel, not the merge in the decode blocks
  bool gemv_stream_ = true;    // the GEMV's weights as streaming loads (KVFUSE_GEMV_STREAM)
  bool gemv_push_staged_ = true;  // the GEMV's pushed stores a token row at a time (KVFUSE_GEMV_PUSH_STAGED)
  bool rope_in_attention_ = false;  // fused_rope's write inside attention (KVFUSE_ROPE_IN_ATTENTION)
  bool ops_pdl_ = false;  // model ops and attention launched as programmatic dependents
  cudaStream_t stream_ = nullptr;
  blasLtHandle_t blas_ = nullptr;
  DeviceBuffer blas_workspace_;
  DeviceBuffer split_scratch_;  // split-KV attention partials
  DeviceBuffer split_counters_;  // split-KV merge counters, zero between launches
  DeviceBuffer kv_scratch_;     // the unfused KV write's fp32 and cast intermediates
  DeviceBuffer gemm_f32_;  // fp32 GEMM results of biased linear layers
  DeviceBuffer l2_flush_;  // written between timed GEMM candidates (tuning only)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device) { return make_backend(device, 0); }

absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device, int gpu_ordinal) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no device (or no driver): clear the error, use the CPU
    count = 0;
  }
#if defined(KVFUSE_HIP)
  const Device built = Device::hip;
#else
  const Device built = Device::cuda;
#endif
  if (device == Device::cpu || (device == Device::auto_ && count == 0)) return make_cpu_backend_from_env();
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
  if (gpu_ordinal < 0 || gpu_ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("config key 'devices': GPU ", gpu_ordinal, " does not exist (",
                                                   count, " ", KVFUSE_GPU_VENDOR, " device(s) visible)"));
  }
  return GpuBackend::create(gpu_ordinal);
}

}  // namespace kvfuse
