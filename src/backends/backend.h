// The device seam: everything the engine does on a device goes through Backend.
// One implementation per device (cpu now; cuda and hip behind KVFUSE_GPU). Pointers
// handed to ops are in the backend's memory, allocated by alloc().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/kv_types.h"
#include "kernels/ops/sampling.h"
#include "kernels/parallel/tp_push.h"
#include "src/common/status_macros.h"
#include "src/loading/config.h"
#include "src/loading/model_spec.h"
#include "src/common/arith.h"

namespace kvfuse {

// Owned device memory. Move-only; frees through the backend that made it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* ptr, size_t bytes, std::function<void(void*)> free_fn)
      : ptr_(ptr), bytes_(bytes), free_(std::move(free_fn)) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      free_ = std::move(o.free_);
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void reset() {
    if (ptr_ && free_) free_(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> free_;
};

// Owned host memory from Backend::alloc_host: page-locked (pinned) on GPU backends, so a
// copy_to_device from it is an asynchronous DMA. Move-only; frees through the backend
// that made it. Deliberately not a DeviceBuffer: ops never take it.
class HostBuffer : private DeviceBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(void* ptr, size_t bytes, std::function<void(void*)> free_fn)
      : DeviceBuffer(ptr, bytes, std::move(free_fn)) {}
  using DeviceBuffer::as;
  using DeviceBuffer::bytes;
  using DeviceBuffer::get;
  using DeviceBuffer::reset;
};

// A recorded sequence of backend ops (a CUDA/HIP graph) that replays with the
// arguments and buffers it was captured with; only the contents of those buffers change.
class BackendGraph {
 public:
  virtual ~BackendGraph() = default;
  virtual absl::Status replay() = 0;
};

// A Linear layer's weight [n, k] (out_features x in_features) in the backend's own
// layout (bf16 packed in 16-column panels on the CPU), with an optional bias [n].
// A projection's weight in the backend's layout. bf16, or FP8 (upload_linear_fp8): `w`
// the codes in `fp8_format`, `scale` one fp32 per output channel, `act` how the input
// activations are quantized (kernels/cpu/gemm/gemm_fp8.h states the arithmetic).
struct LinearWeight {
  DeviceBuffer w;
  DeviceBuffer bias;
  int64_t n = 0;
  int64_t k = 0;
  bool fp8 = false;
  Fp8Format fp8_format = Fp8Format::e4m3fn;
  DeviceBuffer scale;         // FP8: [n] fp32
  Fp8Act act = Fp8Act::none;  // FP8
  float input_scale = 0.0f;   // FP8 with Fp8Act::static_tensor
  DeviceBuffer act_scale;     // GPU backends, FP8 static_tensor: input_scale in device memory [1]
};
// FP8 activations in backend memory (Backend::norm_to_fp8): codes [rows, cols] and row
// scales [rows]; both null when there are none.
struct Fp8Acts {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  bool given() const { return codes != nullptr; }
};

// A host FP8 weight for upload_linear_fp8: e4m3fn codes [n, k] row-major, scales [n].
struct Fp8LinearHost {
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  Fp8Act act = Fp8Act::none;
  float input_scale = 0.0f;
};

// A device's memory as it reports it now: the GPU driver's free and total bytes; the
// host's available and total memory for the CPU backend.
struct DeviceMemory {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual std::string description() const = 0;  // e.g. "cpu (2 threads, OpenBLAS)"
  // Concrete storage of `fp8_e4m3` on this device: e4m3fn, or e4m3fnuz on gfx942.
  virtual KvFormat resolve_kv_format(KvCacheDtype d) const = 0;
  // OK if this backend's kernels serve a model of `spec`'s shape with a KV cache stored
  // as `format`; else an InvalidArgument naming the shape and what is supported. The
  // engine asks before it allocates anything, so an unsupported model fails at startup.
  virtual absl::Status check_supported(const ModelSpec& spec, KvFormat format) const = 0;

  virtual absl::StatusOr<DeviceBuffer> alloc(size_t bytes) = 0;
  // Bytes that alloc() has handed out and that are not freed yet (the engine's memory
  // split: weights, KV pool, workspaces; src/runtime/memory_plan.h).
  virtual int64_t allocated_bytes() const { return live_bytes_->load(); }
  // The device's free and total memory now; UNIMPLEMENTED where the backend cannot tell.
  virtual absl::StatusOr<DeviceMemory> device_memory() {
    return absl::UnimplementedError(description() + ": no device memory figures");
  }
  // Host memory for staging copies to the device, aligned to kHostAlign: page-locked on
  // GPU backends; plain memory here (the CPU's "device" memory is host memory, so its
  // copy_to_device is a memcpy either way).
  static constexpr size_t kHostAlign = 256;
  virtual absl::StatusOr<HostBuffer> alloc_host(size_t bytes) {
    const size_t rounded = size_t(round_up(int64_t(std::max<size_t>(bytes, 1)), kHostAlign));
    void* p = std::aligned_alloc(kHostAlign, rounded);
    if (p == nullptr) return absl::ResourceExhaustedError("cannot allocate host staging memory");
    return HostBuffer(p, bytes, [](void* q) { std::free(q); });
  }
  virtual absl::Status memset(void* dst, int value, size_t bytes) = 0;
  // Ordered on the backend's stream. From ordinary (pageable) host memory the copy has
  // taken `src` by the time it returns. From alloc_host memory it may still be reading
  // `src` after it returns, until the next synchronize() or copy_to_host(): the caller
  // must not write those bytes before then.
  virtual absl::Status copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  // Waits for the stream: every op queued before it, and the copy, are done on return.
  virtual absl::Status copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status synchronize() = 0;
  // `rows` rows of `width_bytes` from src (rows `src_pitch` bytes apart) to dst (rows
  // `dst_pitch` apart), both in this backend's memory; ordered with the ops like a kernel
  // (a graph can record it).
  virtual absl::Status copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                               size_t width_bytes, int64_t rows) = 0;
  // Makes this backend's device current on the calling thread. A thread that runs ops of a
  // backend it did not create (tensor-parallel ranks, one thread each) calls it first.
  virtual absl::Status bind_thread() { return absl::OkStatus(); }
  // The stream the backend orders its work on (cudaStream_t or hipStream_t), for a
  // communicator that must queue its collectives there; null on the CPU.
  virtual void* native_stream() const { return nullptr; }

  // Weights arrive as host bf16 and are converted to the backend's layout once.
  virtual absl::StatusOr<LinearWeight> upload_linear(const bf16_t* w, int64_t n, int64_t k,
                                                     const bf16_t* bias) = 0;
  // FP8 weights kept in FP8 (src/loading/host_weights.h, HostLinear's FP8 form); linear,
  // linear_logits and the fused projections then compute as kernels/cpu/gemm/gemm_fp8.h
  // says. Backends without FP8 GEMMs refuse them here, at load.
  virtual absl::StatusOr<LinearWeight> upload_linear_fp8(const Fp8LinearHost& /*w*/, int64_t /*n*/,
                                                         int64_t /*k*/, const bf16_t* /*bias*/) {
    return absl::UnimplementedError(
        description() + ": FP8 weights are not served by this backend yet (the CPU, CUDA and HIP backends serve them; "
                        "bf16 checkpoints load everywhere)");
  }

  // Ops. Activations are bf16 rows; see kernels/cpu/ops/ops.h for the contracts.
  virtual absl::Status embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden,
                                 bf16_t* out) = 0;
  virtual absl::Status rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                               bf16_t* out) = 0;
  virtual absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out) = 0;
  // The lm_head's logits: linear's products in fp32, without the bias (an lm_head has none).
  virtual absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) = 0;
  // linear into out (the same bits), the [m, w.n] result also stored into every push target
  // (kernels/parallel/tp_push.h: a tensor-parallel peer's inbox, device memory this backend's GPU
  // reaches). GPU backends only: the GEMV stores from its epilogue, other GEMMs are
  // followed by a copy kernel. Others: UNIMPLEMENTED (the model asks its communicator
  // first, and only GPU communicators offer push targets).
  virtual absl::Status linear_push(const bf16_t* /*x*/, int64_t /*m*/, const LinearWeight& /*w*/,
                                   bf16_t* /*out*/, const PushTargets& /*push*/) {
    return absl::UnimplementedError(description() + ": no pushed projection");
  }
  // inv_freq: the model's frequency table [head_dim / 2] in backend memory (uploaded
  // once; src/loading/rope.h); cos and sin are multiplied by attention_scaling.
  virtual absl::Status rope(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                            int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                            const float* inv_freq, float attention_scaling) = 0;
  virtual absl::Status silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) = 0;
  // The MLP's first half: gate_up = linear(x, w) (w's rows: inter gate rows, then inter up
  // rows), then act = silu_mul(gate_up). A backend may fuse the two (the GPU's GEMV
  // writes act from its epilogue): gate_up's contents are then unspecified; act's bits
  // are the same either way.
  virtual absl::Status linear_silu_mul(const bf16_t* x, int64_t m, const LinearWeight& w, int64_t inter,
                                       bf16_t* gate_up, bf16_t* act) {
    if (auto st = linear(x, m, w, gate_up); !st.ok()) return st;
    return silu_mul(gate_up, m, inter, act);
  }
  virtual absl::Status residual_add(bf16_t* x, const bf16_t* y, int64_t count) = 0;
  // The residual add and the RMSNorm after it: x += y (bf16, as residual_add), then
  // out = rmsnorm(x, w) (as rmsnorm). out may be y.
  virtual absl::Status add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols,
                                   float eps, bf16_t* out) = 0;
  virtual absl::Status gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                                   bf16_t* out) = 0;

  // Activations handed from the kernel that made them to the FP8 W8A8 projection that takes
  // them (Model::forward: the norms before qkv and gate_up). norm_to_fp8 is rmsnorm (y null)
  // or add_rmsnorm, out the same bits, whose output goes next to the projection `next`; a
  // backend that can also quantizes out as next's activations in the same kernel, and
  // returns where: quantize_rows_fp8's codes [rows, cols] and row scales [rows]
  // (kernels/cpu/gemm/gemm_fp8.h) of out, with next's act, format and static scale, in
  // backend memory, valid until the next norm_to_fp8. The default returns none.
  // linear_from_fp8 and linear_silu_mul_from_fp8 are linear and linear_silu_mul given x's
  // codes from norm_to_fp8 for w (or none): the same bits as without them.
  virtual absl::StatusOr<Fp8Acts> norm_to_fp8(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows,
                                              int64_t cols, float eps, bf16_t* out, const LinearWeight& /*next*/) {
    absl::Status st = y != nullptr ? add_rmsnorm(x, y, w, rows, cols, eps, out) : rmsnorm(x, w, rows, cols, eps, out);
    if (!st.ok()) return st;
    return Fp8Acts{};
  }
  virtual absl::Status linear_from_fp8(const bf16_t* x, const Fp8Acts& /*xq*/, int64_t m, const LinearWeight& w,
                                       bf16_t* out) {
    return linear(x, m, w, out);
  }
  virtual absl::Status linear_silu_mul_from_fp8(const bf16_t* x, const Fp8Acts& /*xq*/, int64_t m,
                                                const LinearWeight& w, int64_t inter, bf16_t* gate_up, bf16_t* act) {
    return linear_silu_mul(x, m, w, inter, gate_up, act);
  }

  // KV write of one layer, fused or unfused (fused_rope is kv_write_rope's: it needs the
  // query and the positions). The unfused path's intermediate buffers are the backend's
  // own scratch (grown as the attention scratch is; see graph_epoch).
  virtual absl::Status kv_write(const KvWriteArgs& args, KvWritePath path) = 0;
  // KvWritePath::fused_rope: rope() of args.q and args.kv.k and the fused kv_write in one
  // op (kernels/common/kv_types.h, KvWriteRopeArgs): q ends as rope leaves it, the cache as rope
  // then the fused write leave it; args.kv.k is not modified.
  virtual absl::Status kv_write_rope(const KvWriteRopeArgs& args) = 0;
  // Sizes that scratch for the largest step (max_tokens rows of row_elems) up front, so
  // graphs captured at any batch size never see it move. Later steps may still grow it.
  virtual absl::Status reserve_kv_write(int64_t max_tokens, int64_t row_elems) = 0;
  virtual absl::Status attention(const AttnArgs& args, AttentionPath path) = 0;
  // kv_write_rope(rope) then attention(args, path), where args.q is rope.q: the cache
  // and the attention output as those two leave them (rope.q may be left unrotated). A
  // backend may do both in one kernel (the GPU's, for decode-only batches); this is the
  // reference.
  virtual absl::Status attention_rope(const AttnArgs& args, const KvWriteRopeArgs& rope, AttentionPath path) {
    KVFUSE_RETURN_IF_ERROR(kv_write_rope(rope));
    return attention(args, path);
  }
  // Per row of logits [rows, vocab]: the greedy token (the first index of the maximum,
  // as kvfuse::argmax) into tokens[row], and 1 into finite[row] if every logit of the
  // row is finite, else 0.
  virtual absl::Status argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                                   int32_t* finite) = 0;

  // The logit processors of rows [0, rows) of logits (kernels/ops/sampling.h has the
  // rule; row r's entries are entries[start[r] .. start[r + 1]), both in device memory):
  // `restore` false applies them before the tokens are picked, keeping each raw logit in
  // its entry; true writes the raw logits back.
  virtual absl::Status adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start,
                                   LogitAdjust* entries, bool restore) = 0;

  // Per row with params[row].temperature > 0: the sampled token into tokens[row]
  // (kernels/ops/sampling.h has the rule; greedy rows are not written).
  virtual absl::Status sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                                   int32_t* tokens) = 0;

  // Per row with req[row].top_n >= 0: the logprob of its target and its top-n tokens
  // into out[row] (kernels/ops/sampling.h has the rule; a target < 0 is the row's chosen
  // token: sampled[row] if params[row].temperature > 0, else greedy[row]). Other rows
  // are not written.
  virtual absl::Status logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                                     const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                                     LogprobOut* out) = 0;

  // Graphs. Between begin_capture and end_capture the ops are recorded, not run; the
  // graph replays them. supports_graphs() is false on backends without graphs (the CPU).
  virtual bool supports_graphs() const { return false; }
  virtual absl::Status begin_capture() { return absl::UnimplementedError("this backend has no graphs"); }
  virtual absl::StatusOr<std::unique_ptr<BackendGraph>> end_capture() {
    return absl::UnimplementedError("this backend has no graphs");
  }
  // Changes whenever the backend replaces internal memory a captured graph may use
  // (scratch buffers that grew): graphs captured under an older value must be dropped.
  virtual uint64_t graph_epoch() const { return 0; }

  // GEMM tuning. A backend may time each new GEMM shape's candidates on its first use
  // (the GPU backend does, for decode-sized shapes: tens to hundreds of milliseconds a
  // shape). end_gemm_tuning() ends that: a shape first seen afterwards runs a choice
  // already made (in this process or the GEMM cache file) or the library's first
  // heuristic pick, untimed. A server calls it once its warm-up has tuned the decode
  // graphs' shapes, so that no request waits while a step's new shape (the token count of
  // a mixed prefill step) is timed. Any thread. True when tuning has ended; false where
  // there is none, or where the backend keeps tuning (the GPU backend under
  // KVFUSE_GEMM_TUNE_WHILE_SERVING=1).
  virtual bool end_gemm_tuning() { return false; }
  // GEMM shapes this backend has timed so far (for logs and tests).
  virtual int64_t gemm_shapes_timed() const { return 0; }

 protected:
  // An alloc() wraps its buffer's free function in this, so that allocated_bytes()
  // counts the buffer until it is freed (the count outlives the backend if a buffer does).
  std::function<void(void*)> counted_free(size_t bytes, std::function<void(void*)> free_fn) {
    live_bytes_->fetch_add(int64_t(bytes));
    return [live = live_bytes_, bytes, f = std::move(free_fn)](void* p) {
      f(p);
      live->fetch_sub(int64_t(bytes));
    };
  }

 private:
  std::shared_ptr<std::atomic<int64_t>> live_bytes_ = std::make_shared<std::atomic<int64_t>>(0);
};

// The concrete storage of a configured KV dtype: fp8_e4m3 is e4m3fnuz on devices whose
// FP8 unit is FNUZ (gfx942), e4m3fn (OCP) everywhere else.
inline KvFormat kv_format_for(KvCacheDtype d, bool e4m3_is_fnuz) {
  switch (d) {
    case KvCacheDtype::bf16:
      return KvFormat::bf16;
    case KvCacheDtype::fp8_e5m2:
      return KvFormat::fp8_e5m2;
    case KvCacheDtype::fp8_e4m3:
    default:
      return e4m3_is_fnuz ? KvFormat::fp8_e4m3fnuz : KvFormat::fp8_e4m3fn;
  }
}

// Creates the backend named by config.device (auto: a GPU if one is built in and
// present, else the CPU).
absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device);
// The same, on GPU `gpu_ordinal` when the device is a GPU (a tensor-parallel rank's).
absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device, int gpu_ordinal);

}  // namespace kvfuse
