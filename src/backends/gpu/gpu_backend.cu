// The GPU backend (CUDA or HIP, one source): device memory through the vendor runtime,
// GEMMs through the GEMM planner (gemm/gemm_planner.h: cuBLASLt / hipBLASLt, kvfuse's GEMV
// and skinny GEMM, as its tuner chose), every other op through the kernels in kernels/.
// All work is queued on one stream; the host waits only when it reads results back
// (copy_to_host, synchronize), so a step has no host synchronisation inside it.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/attention/attention.cuh"
#include "kernels/common/dispatch.h"
#include "kernels/gemm/gemv.cuh"
#include "kernels/kv_write/kv_write.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/ops/sampling.cuh"
#include "kernels/parallel/tp_push.cuh"
#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/backends/gpu/fp8_projections.h"
#include "src/backends/gpu/gemm/gemm_planner.h"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {
namespace {

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
    planner_.reset();
    split_scratch_.reset();
    split_counters_.reset();
    kv_scratch_.reset();
    gemm_f32_.reset();
    if (fp8_) fp8_->release();
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
    return DeviceBuffer(p, bytes, counted_free(bytes, [](void* q) { (void)cudaFree(q); }));  // a deleter cannot report
  }
  absl::StatusOr<DeviceMemory> device_memory() override {
    KVFUSE_RETURN_IF_ERROR(bind_if_needed());
    size_t free_b = 0, total_b = 0;
    KVFUSE_CUDA(cudaMemGetInfo(&free_b, &total_b));
    return DeviceMemory{int64_t(free_b), int64_t(total_b)};
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
    KVFUSE_RETURN_IF_ERROR(upload(lw.w, w, size_t(n * k) * sizeof(bf16_t)));
    KVFUSE_RETURN_IF_ERROR(upload_bias(lw, bias));
    return lw;
  }

  // FP8 weights stay FP8: the codes row-major [n, k] (e4m3fnuz on gfx942: byte 0x80 -> 0,
  // every scale x 2, exact), fp32 channel scales, the bias as upload_linear's, and a static
  // input scale in device memory for the quantizing kernel.
  absl::StatusOr<LinearWeight> upload_linear_fp8(const Fp8LinearHost& h, int64_t n, int64_t k,
                                                 const bf16_t* bias) override {
    if (k % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          description_, ": FP8 weights of in_features ", k, " are not served (a multiple of 16 is)"));
    }
    LinearWeight lw;
    lw.n = n;
    lw.k = k;
    lw.fp8 = true;
    lw.fp8_format = fnuz_ ? Fp8Format::e4m3fnuz : Fp8Format::e4m3fn;
    lw.act = h.act;
    lw.input_scale = h.input_scale * (fnuz_ ? 2.0f : 1.0f);
    std::vector<uint8_t> codes;
    std::vector<float> scales(h.scale, h.scale + n);
    if (fnuz_) {
      codes.assign(h.w, h.w + n * k);
      for (uint8_t& c : codes) c = fp8_e4m3fn_to_fnuz(c);
      for (float& sc : scales) sc *= 2.0f;
    }
    KVFUSE_RETURN_IF_ERROR(upload(lw.w, fnuz_ ? codes.data() : h.w, size_t(n * k)));
    KVFUSE_RETURN_IF_ERROR(upload(lw.scale, scales.data(), scales.size() * sizeof(float)));
    KVFUSE_RETURN_IF_ERROR(upload_bias(lw, bias));
    if (lw.act == Fp8Act::static_tensor) {
      KVFUSE_RETURN_IF_ERROR(upload(lw.act_scale, &lw.input_scale, sizeof(float)));
    }
    KVFUSE_RETURN_IF_ERROR(synchronize());  // codes and scales are locals
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
    if (w.fp8) return fp8_->linear(x, m, w, w.bias.get() ? w.bias.as<float>() : nullptr, out, GemmOut::bf16);
    if (!w.bias.get()) return planner_->gemm(x, m, w, out, GemmOut::bf16, capturing_);
    // With a bias the GEMM result stays fp32 until the bias is in: one bf16 rounding.
    KVFUSE_RETURN_IF_ERROR(reserve_scratch(gemm_f32_, size_t(m * w.n) * sizeof(float), "linear: fp32"));
    KVFUSE_RETURN_IF_ERROR(planner_->gemm(x, m, w, gemm_f32_.get(), GemmOut::f32, capturing_));
    return gpu_status(
        gpu::launch_bias_round(gemm_f32_.as<float>(), w.bias.as<float>(), m, w.n, out, stream_, ops_pdl_),
        "bias_round");
  }
  absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) override {
    if (w.fp8) return fp8_->linear(x, m, w, nullptr, out, GemmOut::f32);
    return planner_->gemm(x, m, w, out, GemmOut::f32, capturing_);
  }
  // Where the tuner picked kvfuse's GEMV for this shape, it stores into the targets from its
  // epilogue; elsewhere linear, then launch_push_copy.
  absl::Status linear_push(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out,
                           const PushTargets& push) override {
    if (m <= 0) return absl::OkStatus();
    if (push.count < 0 || push.count > PushTargets::kMax) {
      return absl::InvalidArgumentError(absl::StrCat("linear_push: ", push.count, " targets"));
    }
    if (!w.fp8 && !w.bias.get() && GemmPlanner::gemv_usable(x, m, w, out)) {
      auto gemv = planner_->gemv_variant(x, m, w, out, capturing_);
      if (!gemv.ok()) return gemv.status();
      if (*gemv >= 0) {
        return gpu_status(gpu::launch_gemv_push_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, push, stream_,
                                                     ops_pdl_, *gemv, gemv_stream_, gemv_push_staged_),
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
  // At the sizes where the tuner picked kvfuse's GEMV for gate/up (bf16 or FP8 weights), the
  // GEMV writes act from its epilogue (no silu_mul launch, no gate_up rows); elsewhere
  // linear, then silu_mul. KVFUSE_GEMV_SILU=0 keeps the two launches (the A/B).
  absl::Status linear_silu_mul(const bf16_t* x, int64_t m, const LinearWeight& w, int64_t inter, bf16_t* gate_up,
                               bf16_t* act) override {
    static const bool fuse = env_flag("KVFUSE_GEMV_SILU");
    if (fuse && m > 0 && !w.fp8 && !w.bias.get() && w.n == 2 * inter && GemmPlanner::gemv_usable(x, m, w, gate_up) &&
        gpu::gemv_unsupported(x, m, w.w.get(), w.n, w.k, act).empty()) {
      auto gemv = planner_->gemv_variant(x, m, w, gate_up, capturing_);
      if (!gemv.ok()) return gemv.status();
      if (*gemv >= 0) {
        return gpu_status(gpu::launch_gemv_silu_mul_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, act, stream_,
                                                         ops_pdl_, *gemv, gemv_stream_),
                          "gemv silu_mul");
      }
    }
    if (auto fused = fp8_->gemv_silu_mul(x, m, w, inter, act, nullptr); !fused.ok() || *fused) {
      return fused.status();
    }
    return Backend::linear_silu_mul(x, m, w, inter, gate_up, act);
  }
  absl::Status add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out) override {
    return gpu_status(gpu::launch_add_rmsnorm(x, y, w, rows, cols, eps, out, stream_, ops_pdl_),
                      "add_rmsnorm");
  }
  // The norm before an FP8 W8A8 projection writes its output's codes too, where
  // Fp8Projections::norm applies; elsewhere the plain norm.
  absl::StatusOr<Fp8Acts> norm_to_fp8(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols,
                                      float eps, bf16_t* out, const LinearWeight& next) override {
    auto acts = fp8_->norm(x, y, w, rows, cols, eps, out, next);
    if (!acts.ok() || acts->given()) return acts;
    return Backend::norm_to_fp8(x, y, w, rows, cols, eps, out, next);
  }
  absl::Status linear_from_fp8(const bf16_t* x, const Fp8Acts& xq, int64_t m, const LinearWeight& w,
                               bf16_t* out) override {
    if (!xq.given() || !w.fp8) return linear(x, m, w, out);
    return fp8_->linear(x, m, w, w.bias.get() ? w.bias.as<float>() : nullptr, out, GemmOut::bf16, &xq);
  }
  absl::Status linear_silu_mul_from_fp8(const bf16_t* x, const Fp8Acts& xq, int64_t m, const LinearWeight& w,
                                        int64_t inter, bf16_t* gate_up, bf16_t* act) override {
    if (!xq.given() || !w.fp8) return linear_silu_mul(x, m, w, inter, gate_up, act);
    if (auto fused = fp8_->gemv_silu_mul(x, m, w, inter, act, &xq); !fused.ok() || *fused) return fused.status();
    KVFUSE_RETURN_IF_ERROR(linear_from_fp8(x, xq, m, w, gate_up));
    return silu_mul(gate_up, m, inter, act);
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
    if (select::write_in_attention(rope_in_attention_,
                                   gpu::attention_rope_unsupported(args, rope, attn_launch_).empty())) {
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
    // The unified kernel, or the split path (select::attention_kernel: small decode-only
    // batches on long contexts split even under `unified`).
    const bool decode_only = args.batch.max_query_len == 1;
    const int32_t min_keys = select::split_min_keys(decode_only, split_min_keys_decode_);
    const select::AttentionKernel kernel = select::attention_kernel(
        path, decode_only, decode_only ? gpu::attention_split_partition(args, min_keys, attn_launch_) : 0,
        args.batch.max_context_len);
    if (kernel == select::AttentionKernel::unified) {
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

  absl::Status adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                           bool restore) override {
    return gpu_status(gpu::launch_adjust_rows(logits, rows, vocab, start, entries, restore, stream_),
                      "adjust_rows");
  }

  absl::Status logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                             const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                             LogprobOut* out) override {
    return gpu_status(
        gpu::launch_logprobs_rows(logits, rows, vocab, req, greedy, sampled, params, out, stream_),
        "logprobs_rows");
  }

  // GEMMs: linear, linear_logits and the GEMV epilogues above run the planner's choice for
  // their shape (src/backends/gpu/gemm/gemm_planner.h).
  bool end_gemm_tuning() override { return planner_->end_tuning(); }
  int64_t gemm_shapes_timed() const override { return planner_->shapes_timed(); }

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

  // `bytes` of host memory into a new device buffer (pageable memory: taken on return).
  absl::Status upload(DeviceBuffer& dst, const void* src, size_t bytes) {
    auto buf = alloc(bytes);
    if (!buf.ok()) return buf.status();
    dst = std::move(*buf);
    return copy_to_device(dst.get(), src, bytes);
  }
  // A projection's bias in fp32, added to the fp32 GEMM result before the one rounding
  // (see linear); none when bias is null.
  absl::Status upload_bias(LinearWeight& lw, const bf16_t* bias) {
    if (bias == nullptr) return absl::OkStatus();
    std::vector<float> b(static_cast<size_t>(lw.n));
    for (int64_t i = 0; i < lw.n; ++i) b[size_t(i)] = bf16_to_f32(bias[i]);
    KVFUSE_RETURN_IF_ERROR(upload(lw.bias, b.data(), b.size() * sizeof(float)));
    return synchronize();  // b is a local
  }

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
    auto planner = GemmPlanner::create(device, prop, GemmPlanner::Launch{stream_, ops_pdl_, gemv_stream_},
                                       [this](size_t bytes) { return alloc(bytes); });
    if (!planner.ok()) return planner.status();
    planner_ = std::move(*planner);
    fp8_ = std::make_unique<Fp8Projections>(Fp8Projections::Context{
        planner_.get(), &stream_, &ops_pdl_, &capturing_,
        [this](DeviceBuffer& buf, size_t need, const char* what) { return reserve_scratch(buf, need, what); },
        &gemm_f32_});
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
  int device_ = 0;
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
  std::unique_ptr<GemmPlanner> planner_;  // the GEMMs: plans, tuning, choices (made in init)
  DeviceBuffer split_scratch_;  // split-KV attention partials
  DeviceBuffer split_counters_;  // split-KV merge counters, zero between launches
  DeviceBuffer kv_scratch_;     // the unfused KV write's fp32 and cast intermediates
  DeviceBuffer gemm_f32_;       // fp32 GEMM results of biased linear layers and the FP8 GEMM's sums
  std::unique_ptr<Fp8Projections> fp8_;  // the FP8-weight projections (made in init)
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
