// Helpers of the GPU parity tests. These are plain programs rather than Catch2 tests:
// the device machine that runs them has no Debian packages, and a program that prints
// "N passed, M failed" and exits non-zero on failure needs nothing beyond the toolkit.
#pragma once

#include "kernels/common/gpu.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace kvfuse::gpu_test {

struct Tally {
  int passed = 0;
  int failed = 0;
  int report(const char* name) const {
    std::printf("%s: %d passed, %d failed\n", name, passed, failed);
    return failed == 0 ? 0 : 1;
  }
};

inline Tally& tally() {
  static Tally t;
  return t;
}

// Records one check; prints the failure with its context. Returns the condition.
inline bool check(bool ok, const std::string& what) {
  if (ok) {
    ++tally().passed;
  } else {
    ++tally().failed;
    std::printf("FAIL: %s\n", what.c_str());
  }
  return ok;
}

// GPU runtime calls in tests abort on failure: nothing after a failed allocation or
// copy would mean anything.
#define KVFUSE_TEST_GPU(call)                                                                             \
  do {                                                                                                    \
    const cudaError_t err_ = (call);                                                                      \
    if (err_ != cudaSuccess) {                                                                            \
      std::printf("FATAL: %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

// True if a GPU is usable; otherwise prints why the GPU part is skipped.
inline bool gpu_available(const char* program) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    std::printf("SKIP %s: no GPU (%s)\n", program,
                err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount returned 0 devices");
    return false;
  }
  cudaDeviceProp prop{};
  KVFUSE_TEST_GPU(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: device 0 = %s (%s, %d devices)\n", program, prop.name, KVFUSE_GPU_VENDOR, n);
  return true;
}

// Whether KVFUSE_GPU_TEST_QUICK=1 asks for the smaller grid (the runs under the sanitizer).
inline bool quick() {
  const char* v = std::getenv("KVFUSE_GPU_TEST_QUICK");
  return v != nullptr && v[0] == '1';
}

// Owned device memory for tests.
class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) { KVFUSE_TEST_GPU(cudaMalloc(&ptr_, bytes ? bytes : 1)); }
  ~DeviceMem() { (void)cudaFree(ptr_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  // Returns once the bytes are on the device. cudaMemcpy from pageable memory may return
  // while its last DMA is still in flight, and the tests launch on non-blocking streams,
  // which do not wait for the legacy stream: a kernel could then race the tail of the
  // copy (seen on the H200: a few hundred bytes of a freshly uploaded cache overwrote the
  // kernel's V rows in test_kv_write_rope_gpu). The device-wide wait closes that.
  void upload(const void* src, size_t n) {
    KVFUSE_TEST_GPU(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice));
    KVFUSE_TEST_GPU(cudaDeviceSynchronize());
  }
  template <class T>
  std::vector<T> download(size_t count) const {
    std::vector<T> out(count);
    KVFUSE_TEST_GPU(cudaMemcpy(out.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  void* ptr_ = nullptr;
};

// Test data directory: $KVFUSE_TEST_DATA_DIR, else the path compiled in.
inline std::string data_path(const std::string& file) {
  const char* env = std::getenv("KVFUSE_TEST_DATA_DIR");
  return std::string(env ? env : KVFUSE_TEST_DATA_DIR) + "/" + file;
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::printf("FATAL: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

}  // namespace kvfuse::gpu_test
