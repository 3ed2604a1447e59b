// A Backend that hands every call to another one, for tests that watch or break one op
// of a real backend: derive, override that op, call the inner backend for the rest.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"

namespace kvfuse::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {}

  Device device() const override { return in_->device(); }
  std::string description() const override { return in_->description(); }
  KvFormat resolve_kv_format(KvCacheDtype d) const override { return in_->resolve_kv_format(d); }
  absl::Status check_supported(const ModelSpec& s, KvFormat f) const override { return in_->check_supported(s, f); }
  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override { return in_->alloc(bytes); }
  int64_t allocated_bytes() const override { return in_->allocated_bytes(); }
  absl::StatusOr<DeviceMemory> device_memory() override { return in_->device_memory(); }
  absl::StatusOr<HostBuffer> alloc_host(size_t bytes) override { return in_->alloc_host(bytes); }
  absl::Status memset(void* dst, int value, size_t bytes) override { return in_->memset(dst, value, bytes); }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    return in_->copy_to_device(dst, src, bytes);
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    return in_->copy_to_host(dst, src, bytes);
  }
  absl::Status synchronize() override { return in_->synchronize(); }
  absl::Status copy_2d(void* dst, size_t dp, const void* src, size_t sp, size_t w, int64_t rows) override {
    return in_->copy_2d(dst, dp, src, sp, w, rows);
  }
  absl::StatusOr<LinearWeight> upload_linear(const bf16_t* w, int64_t n, int64_t k, const bf16_t* bias) override {
    return in_->upload_linear(w, n, k, bias);
  }
  absl::StatusOr<LinearWeight> upload_linear_fp8(const Fp8LinearHost& w, int64_t n, int64_t k,
                                                 const bf16_t* bias) override {
    return in_->upload_linear_fp8(w, n, k, bias);
  }
  absl::Status embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden,
                         bf16_t* out) override {
    return in_->embedding(ids, n, table, hidden, out);
  }
  absl::Status rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out) override {
    return in_->rmsnorm(x, w, rows, cols, eps, out);
  }
  absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, bf16_t* out) override {
    return in_->linear(x, m, w, out);
  }
  absl::Status linear_logits(const bf16_t* x, int64_t m, const LinearWeight& w, float* out) override {
    return in_->linear_logits(x, m, w, out);
  }
  absl::Status rope(bf16_t* q, int64_t qs, int32_t qh, bf16_t* k, int64_t ks, int32_t kh, int32_t hd,
                    const int32_t* pos, int64_t n, const float* inv_freq, float scaling) override {
    return in_->rope(q, qs, qh, k, ks, kh, hd, pos, n, inv_freq, scaling);
  }
  bool end_gemm_tuning() override { return in_->end_gemm_tuning(); }
  int64_t gemm_shapes_timed() const override { return in_->gemm_shapes_timed(); }
  absl::Status silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) override {
    return in_->silu_mul(gate_up, n, inter, out);
  }
  absl::Status residual_add(bf16_t* x, const bf16_t* y, int64_t count) override {
    return in_->residual_add(x, y, count);
  }
  absl::Status add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out) override {
    return in_->add_rmsnorm(x, y, w, rows, cols, eps, out);
  }
  absl::Status gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           bf16_t* out) override {
    return in_->gather_rows(x, cols, rows, n, out);
  }
  absl::Status kv_write(const KvWriteArgs& args, KvWritePath path) override { return in_->kv_write(args, path); }
  absl::Status kv_write_rope(const KvWriteRopeArgs& args) override { return in_->kv_write_rope(args); }
  absl::Status reserve_kv_write(int64_t max_tokens, int64_t row_elems) override {
    return in_->reserve_kv_write(max_tokens, row_elems);
  }
  absl::Status attention(const AttnArgs& args, AttentionPath path) override { return in_->attention(args, path); }
  absl::Status argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                           int32_t* finite) override {
    return in_->argmax_rows(logits, rows, vocab, tokens, finite);
  }
  absl::Status sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                           int32_t* tokens) override {
    return in_->sample_rows(logits, rows, vocab, params, tokens);
  }
  absl::Status adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                           bool restore) override {
    return in_->adjust_rows(logits, rows, vocab, start, entries, restore);
  }
  absl::Status logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                             const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                             LogprobOut* out) override {
    return in_->logprobs_rows(logits, rows, vocab, req, greedy, sampled, params, out);
  }

 protected:
  Backend& inner() { return *in_; }

 private:
  std::unique_ptr<Backend> in_;
};

// The CPU backend, except that attention fails while `fail` is set: a device error in one
// tensor-parallel rank in the middle of a step, after the ranks have met in collectives.
class FailingAttentionBackend final : public ForwardingBackend {
 public:
  std::atomic<bool> fail{false};
  FailingAttentionBackend() : ForwardingBackend(make_cpu_backend()) {}
  absl::Status attention(const AttnArgs& a, AttentionPath p) override {
    if (fail) return absl::InternalError("injected device failure");
    return inner().attention(a, p);
  }
};

}  // namespace kvfuse::testing
