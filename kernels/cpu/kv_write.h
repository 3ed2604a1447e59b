// CPU reference of the KV write. It defines the cache bytes that every GPU path
// (fused, unfused, CUDA, HIP) must reproduce exactly.
#pragma once

#include <cstddef>

#include "kernels/kv_types.h"

namespace kvfuse::cpu {

// One pass: read each row once, multiply by the reciprocal of the layer's scale
// (computed once in fp32), convert with saturation, store into the row's slot.
// Negative slots and SWA-unmapped slots are skipped. Inputs are never modified.
// A bf16 cache stores the rows unscaled (scales apply to FP8 only).
void kv_write_fused(const KvWriteArgs& args);

// Scratch for the unfused path, sized for num_tokens rows of K and of V.
struct KvWriteScratch {
  float* k_scaled = nullptr;  // [num_tokens, row_elems] fp32
  float* v_scaled = nullptr;
  uint8_t* k_cast = nullptr;  // [num_tokens, row_elems * kv_format_bytes]
  uint8_t* v_cast = nullptr;
};

size_t kv_write_scratch_bytes(int64_t num_tokens, int64_t row_elems);
// Carves a KvWriteScratch out of one buffer of kv_write_scratch_bytes() bytes.
KvWriteScratch kv_write_scratch_from(void* buffer, int64_t num_tokens, int64_t row_elems);

// The unfused path as today's serving systems run it, one stage per launch on a GPU:
// scale K into fp32 scratch, scale V, cast K to the cache dtype, cast V, scatter both
// into their pages. The intermediate is fp32, so the bytes equal the fused write's.
void kv_write_unfused(const KvWriteArgs& args, const KvWriteScratch& scratch);

}  // namespace kvfuse::cpu
