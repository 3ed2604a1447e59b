#include "src/backends/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention/attention.h"
#include "kernels/cpu/gemm/gemm.h"
#include "kernels/cpu/gemm/gemm_fp8.h"
#include "kernels/cpu/kv_write/kv_write.h"
#include "kernels/cpu/ops/ops.h"
#include "kernels/cpu/ops/sampling.h"
#include "src/runtime/sampler.h"
#include "src/common/arith.h"

namespace kvfuse {
namespace {

constexpr size_t kAlign = 64;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(cpu::GemmIsa isa) : isa_(isa) {}
  Device device() const override { return Device::cpu; }
  std::string description() const override {
    return absl::StrCat("cpu (", std::thread::hardware_concurrency(), " hardware threads, batch-invariant ",
                        cpu::gemm_isa_name(isa_), " GEMM)");
  }
  // The CPU stores OCP e4m3fn, as NVIDIA sm_89+ and gfx950 do.
  KvFormat resolve_kv_format(KvCacheDtype d) const override { return kv_format_for(d, false); }
  // The reference kernels (kernels/cpu/) take any head_dim, page size and format; they
  // need positive heads with the query heads a multiple of the KV heads (which
  // resolve_model_spec already validates; kernels/cpu/attention/attention.cc aborts otherwise).
  absl::Status check_supported(const ModelSpec& s, KvFormat) const override {
    if (s.head_dim > 0 && s.num_kv_heads > 0 && s.num_q_heads > 0 && s.num_q_heads % s.num_kv_heads == 0) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("cpu backend does not support head_dim ", s.head_dim,
                                                   " with ", s.num_q_heads, " query heads over ",
                                                   s.num_kv_heads, " KV heads for model ", s.name));
  }

  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override {
    const size_t rounded = size_t(round_up(int64_t(std::max<size_t>(bytes, 1)), kAlign));
    void* p = std::aligned_alloc(kAlign, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu backend: cannot allocate ", bytes, " bytes"));
    }
    return DeviceBuffer(p, bytes, counted_free(bytes, [](void* q) { std::free(q); }));
  }
  // The host's: MemAvailable and MemTotal of /proc/meminfo.
  absl::StatusOr<DeviceMemory> device_memory() override { return host_memory(); }
  absl::Status memset(void* dst, int value, size_t bytes) override {
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status synchronize() override { return absl::OkStatus(); }
  absl::Status copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width_bytes,
                       int64_t rows) override {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<char*>(dst) + size_t(r) * dst_pitch,
                  static_cast<const char*>(src) + size_t(r) * src_pitch, width_bytes);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<LinearWeight> upload_linear(const bf16_t* w, int64_t n, int64_t k,
                                             const bf16_t* bias) override {
    LinearWeight lw;
    KVFUSE_RETURN_IF_ERROR(shape_and_bias(n, k, bias, lw));
    auto wb = alloc(cpu::gemm_packed_elems(n, k) * sizeof(bf16_t));
    if (!wb.ok()) return wb.status();
    lw.w = std::move(*wb);
    cpu::gemm_pack_weight(w, n, k, lw.w.as<bf16_t>());
    return lw;
  }

  absl::StatusOr<LinearWeight> upload_linear_fp8(const Fp8LinearHost& h, int64_t n, int64_t k,
                                                 const bf16_t* bias) override {
    LinearWeight lw;
    KVFUSE_RETURN_IF_ERROR(shape_and_bias(n, k, bias, lw));
    auto wb = alloc(cpu::gemm_packed_fp8_bytes(n, k));
    if (!wb.ok()) return wb.status();
    lw.w = std::move(*wb);
    cpu::gemm_pack_weight_fp8(h.w, n, k, lw.w.as<uint8_t>());
    auto sb = alloc(size_t(n) * sizeof(float));
    if (!sb.ok()) return sb.status();
    lw.scale = std::move(*sb);
    std::copy_n(h.scale, n, lw.scale.as<float>());
    lw.fp8 = true;
    lw.fp8_format = Fp8Format::e4m3fn;
    lw.act = h.act;
    lw.input_scale = h.input_scale;
    return lw;
  }

  absl::Status embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden,
                         bf16_t* out) override {
    cpu::embedding(ids, n, table, hidden, out);
    return absl::OkStatus();
  }
  absl::Status rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out) override {
    cpu::rmsnorm(x, w, rows, cols, eps, out);
    return absl::OkStatus();
  }
  absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out) override {
    if (w.fp8) {
      cpu::linear_fp8_bf16(x, m, w.k, fp8_weight(w), w.n, fp8_act(w), w.bias.as<float>(), out,
                           scratch(cpu::gemm_fp8_scratch_floats(m, w.k, w.n)), isa_);
      return absl::OkStatus();
    }
    cpu::linear_bf16(x, m, w.k, w.w.as<bf16_t>(), w.n, w.bias.as<float>(), out,
                     scratch(cpu::gemm_scratch_floats(m, w.k, w.n)), isa_);
    return absl::OkStatus();
  }
  absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) override {
    if (w.fp8) {
      cpu::linear_fp8_f32_out(x, m, w.k, fp8_weight(w), w.n, fp8_act(w), out,
                              scratch(cpu::gemm_fp8_scratch_floats(m, w.k, w.n)), isa_);
      return absl::OkStatus();
    }
    cpu::linear_f32_out(x, m, w.k, w.w.as<bf16_t>(), w.n, out, scratch(cpu::gemm_scratch_floats(m, w.k, w.n)),
                        isa_);
    return absl::OkStatus();
  }
  absl::Status rope(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                    int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                    const float* inv_freq, float attention_scaling) override {
    cpu::rope_neox(q, q_stride, q_heads, k, k_stride, kv_heads, head_dim, positions, n, inv_freq,
                   attention_scaling);
    return absl::OkStatus();
  }
  absl::Status silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) override {
    cpu::silu_mul(gate_up, n, inter, out);
    return absl::OkStatus();
  }
  absl::Status add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out) override {
    cpu::residual_add(x, y, rows * cols);
    cpu::rmsnorm(x, w, rows, cols, eps, out);
    return absl::OkStatus();
  }
  absl::Status residual_add(bf16_t* x, const bf16_t* y, int64_t count) override {
    cpu::residual_add(x, y, count);
    return absl::OkStatus();
  }
  absl::Status gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           bf16_t* out) override {
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(out + i * cols, x + int64_t(rows[i]) * cols, size_t(cols) * sizeof(bf16_t));
    }
    return absl::OkStatus();
  }

  absl::Status kv_write(const KvWriteArgs& args, KvWritePath path) override {
    if (path == KvWritePath::fused) {
      cpu::kv_write_fused(args);
    } else if (path == KvWritePath::unfused) {
      const int64_t row_elems = args.cache.row_elems();
      const size_t bytes = kv_write_scratch_bytes(args.num_tokens, row_elems);
      cpu::kv_write_unfused(args, kv_write_scratch_from(scratch((bytes + 3) / 4), args.num_tokens, row_elems));
    } else {
      return absl::InvalidArgumentError("kv_write: the fused_rope path runs through kv_write_rope");
    }
    return absl::OkStatus();
  }
  absl::Status kv_write_rope(const KvWriteRopeArgs& args) override {
    if (args.kv.src_dtype != KvSrcDtype::bf16) {
      return absl::InvalidArgumentError("kv_write_rope: K and V must be bf16, as RoPE's rows are");
    }
    cpu::kv_write_rope(args);
    return absl::OkStatus();
  }
  absl::Status reserve_kv_write(int64_t max_tokens, int64_t row_elems) override {
    scratch((kv_write_scratch_bytes(max_tokens, row_elems) + 3) / 4);
    return absl::OkStatus();
  }
  absl::Status attention(const AttnArgs& args, AttentionPath path) override {
    // Either path exactly as configured: the reference has no small-batch heuristic.
    if (select::attention_kernel(path, /*decode_only=*/false, 0, 0) == select::AttentionKernel::unified) {
      cpu::attention_unified(args);
    } else {
      cpu::attention_split(args);
    }
    return absl::OkStatus();
  }
  absl::Status argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                           int32_t* finite) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits + r * vocab;
      tokens[r] = argmax(row, int32_t(vocab));
      finite[r] = std::all_of(row, row + vocab, [](float x) { return std::isfinite(x); }) ? 1 : 0;
    }
    return absl::OkStatus();
  }
  absl::Status sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                           int32_t* tokens) override {
    for (int64_t r = 0; r < rows; ++r) {
      if (params[r].temperature != 0.0f) tokens[r] = cpu::sample_row(logits + r * vocab, vocab, params[r]);
    }
    return absl::OkStatus();
  }
  absl::Status adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                           bool restore) override {
    cpu::adjust_rows(logits, rows, vocab, start, entries, restore);
    return absl::OkStatus();
  }
  absl::Status logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                             const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                             LogprobOut* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      if (req[r].top_n < 0) continue;
      int32_t t = req[r].target;
      if (t < 0) t = (params != nullptr && params[r].temperature > 0.0f) ? sampled[r] : greedy[r];
      if (t < 0 || t >= vocab) return absl::InvalidArgumentError(absl::StrCat("logprobs: token ", t, " outside the vocabulary"));
      cpu::logprobs_row(logits + r * vocab, vocab, t, req[r].top_n, out[r]);
    }
    return absl::OkStatus();
  }

 private:
  // A weight's shape and its bias, as fp32, added to the finished sums.
  absl::Status shape_and_bias(int64_t n, int64_t k, const bf16_t* bias, LinearWeight& lw) {
    lw.n = n;
    lw.k = k;
    if (bias == nullptr) return absl::OkStatus();
    auto bb = alloc(size_t(n) * sizeof(float));
    if (!bb.ok()) return bb.status();
    lw.bias = std::move(*bb);
    cpu::bf16_to_f32(bias, n, lw.bias.as<float>());
    return absl::OkStatus();
  }
  static cpu::Fp8Weight fp8_weight(const LinearWeight& w) {
    return cpu::Fp8Weight{w.w.as<uint8_t>(), w.scale.as<float>(), w.fp8_format};
  }
  static cpu::Fp8ActQuant fp8_act(const LinearWeight& w) {
    return cpu::Fp8ActQuant{w.act, w.act == Fp8Act::static_tensor ? w.input_scale : 1.0f, Fp8Format::e4m3fn};
  }
  float* scratch(size_t floats) {
    if (scratch_.size() < floats) scratch_.resize(floats);
    return scratch_.data();
  }
  cpu::GemmIsa isa_;
  std::vector<float> scratch_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(cpu::GemmIsa isa) { return std::make_unique<CpuBackend>(isa); }

std::unique_ptr<Backend> make_cpu_backend() { return make_cpu_backend(cpu::gemm_widest_isa()); }

absl::StatusOr<std::unique_ptr<Backend>> make_cpu_backend_from_env() {
  cpu::GemmIsa isa = cpu::GemmIsa::generic;
  std::string error;
  if (!cpu::gemm_isa_from_env(isa, error)) return absl::InvalidArgumentError(error);
  return make_cpu_backend(isa);
}

#if !defined(KVFUSE_HAVE_GPU)
absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device, int /*gpu_ordinal*/) {
  return make_backend(device);
}

absl::StatusOr<std::unique_ptr<Backend>> make_backend(Device device) {
  switch (device) {
    case Device::auto_:
    case Device::cpu:
      return make_cpu_backend_from_env();
    case Device::cuda:
    case Device::hip:
      return absl::FailedPreconditionError(absl::StrCat(
          "config key 'device': '", to_string(device),
          "' is not built into this binary (built with KVFUSE_GPU=OFF); use cpu or auto, or rebuild with "
          "-DKVFUSE_GPU=CUDA or -DKVFUSE_GPU=HIP"));
  }
  return absl::InvalidArgumentError("unknown device");
}
#endif

absl::StatusOr<DeviceMemory> host_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  DeviceMemory m{-1, -1};
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") m.free_bytes = kb * 1024;
    if (key == "MemTotal:") m.total_bytes = kb * 1024;
  }
  if (m.free_bytes < 0 || m.total_bytes < 0) {
    return absl::UnavailableError("cannot read MemAvailable and MemTotal from /proc/meminfo");
  }
  return m;
}

}  // namespace kvfuse
