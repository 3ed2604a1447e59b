// Host/device portability for headers shared by the CPU reference and GPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
// Spelled with the attribute rather than __forceinline__: under clang -x hip that macro
// exists only once hip_runtime.h is in, and these headers must not depend on order.
#define KVFUSE_HD __host__ __device__ inline __attribute__((always_inline))
#else
#define KVFUSE_HD inline
#endif

namespace kvfuse {

KVFUSE_HD uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

KVFUSE_HD float f32_from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace kvfuse
