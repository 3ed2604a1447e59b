// The scratch of the unfused KV write (KvWritePath::unfused): its layout is shared by the
// CPU reference (kernels/cpu/kv_write/) and the GPU kernels (kernels/kv_write/), so that
// both run the same stages over the same buffers. Host code only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvfuse {

// Scratch for the unfused path, sized for num_tokens rows of K and of V.
struct KvWriteScratch {
  float* k_scaled = nullptr;  // [num_tokens, row_elems] fp32
  float* v_scaled = nullptr;
  uint8_t* k_cast = nullptr;  // [num_tokens, row_elems * kv_format_bytes]
  uint8_t* v_cast = nullptr;
};

namespace kv_write_scratch_detail {
constexpr size_t kAlign = 256;
constexpr size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace kv_write_scratch_detail

// Bytes of one buffer that holds a KvWriteScratch for num_tokens rows at any base address.
inline size_t kv_write_scratch_bytes(int64_t num_tokens, int64_t row_elems) {
  using namespace kv_write_scratch_detail;
  const size_t elems = size_t(num_tokens) * size_t(row_elems);
  // Cast buffers hold 2 bytes per element so one size serves bf16 and FP8 caches.
  // The extra kAlign - 1 bytes let kv_write_scratch_from align any base pointer.
  return kAlign - 1 + 2 * align_up(elems * sizeof(float)) + 2 * align_up(elems * 2);
}

// Carves a KvWriteScratch out of one buffer of kv_write_scratch_bytes() bytes.
inline KvWriteScratch kv_write_scratch_from(void* buffer, int64_t num_tokens, int64_t row_elems) {
  using namespace kv_write_scratch_detail;
  const size_t elems = size_t(num_tokens) * size_t(row_elems);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(buffer) + kAlign - 1) & ~uintptr_t(kAlign - 1);
  uint8_t* p = reinterpret_cast<uint8_t*>(base);
  KvWriteScratch s;
  s.k_scaled = reinterpret_cast<float*>(p);
  p += align_up(elems * sizeof(float));
  s.v_scaled = reinterpret_cast<float*>(p);
  p += align_up(elems * sizeof(float));
  s.k_cast = p;
  p += align_up(elems * 2);
  s.v_cast = p;
  return s;
}

}  // namespace kvfuse
