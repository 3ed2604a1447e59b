// Helpers of the GPU backend tests (tests/gpu/test_gpu_backend.cc, test_gpu_logprobs.cc):
// the GPU backend or a skip, host arrays mirrored in a backend's memory, and a linear
// layer's outputs.
#pragma once

#include <memory>
#include <vector>
#include "tests/util/catch.h"

#include "src/backends/backend.h"

namespace kvfuse::testing {

// The CUDA or HIP backend, or nullptr after a warning: in a build without a GPU backend,
// or on a machine without a GPU, a test that gets nullptr says so and passes without
// checking anything else.
inline std::unique_ptr<Backend> gpu_or_skip() {
  for (Device d : {Device::cuda, Device::hip}) {
    auto b = make_backend(d);
    if (b.ok()) return std::move(*b);
  }
  WARN("GPU backend tests skipped: this build has no GPU backend or no GPU is visible");
  return nullptr;
}

// A host array mirrored in a backend's memory.
template <class T>
struct Mirror {
  DeviceBuffer buf;
  size_t n = 0;
  Mirror(Backend& b, const std::vector<T>& host) : n(host.size()) {
    auto a = b.alloc(n * sizeof(T));
    REQUIRE(a.ok());
    buf = std::move(*a);
    REQUIRE(b.copy_to_device(buf.get(), host.data(), n * sizeof(T)).ok());
  }
  Mirror(Backend& b, size_t count) : n(count) {
    auto a = b.alloc(n * sizeof(T));
    REQUIRE(a.ok());
    buf = std::move(*a);
    REQUIRE(b.memset(buf.get(), 0, n * sizeof(T)).ok());
  }
  T* ptr() const { return buf.as<T>(); }
  std::vector<T> read(Backend& b) const {
    std::vector<T> host(n);
    REQUIRE(b.copy_to_host(host.data(), buf.get(), n * sizeof(T)).ok());
    return host;
  }
};

// A linear layer's two outputs on a backend: linear (bf16) and linear_logits (fp32) of
// x [m, lw.k], each [m, lw.n].
struct LinearOutputs {
  std::vector<bf16_t> out;
  std::vector<float> logits;
};
inline LinearOutputs linear_outputs(Backend& b, const LinearWeight& lw, const std::vector<bf16_t>& x, int64_t m) {
  Mirror<bf16_t> in(b, x), o(b, size_t(m * lw.n));
  Mirror<float> lo(b, size_t(m * lw.n));
  REQUIRE(b.linear(in.ptr(), m, lw, o.ptr()).ok());
  REQUIRE(b.linear_logits(in.ptr(), m, lw, lo.ptr()).ok());
  return {o.read(b), lo.read(b)};
}

}  // namespace kvfuse::testing
