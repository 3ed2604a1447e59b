// CPU reference of the KV write. It defines the cache bytes that every GPU path
// (fused, unfused, CUDA, HIP) must reproduce exactly; the GPU write with RoPE in it
// (fused_rope) reproduces kv_write_fused's bytes of the K rows it rotated.
#pragma once

#include <cstddef>

#include "kernels/common/kv_types.h"
#include "kernels/common/kv_write_scratch.h"

namespace kvfuse::cpu {

// One pass: read each row once, multiply by the reciprocal of the layer's scale
// (computed once in fp32), convert with saturation, store into the row's slot.
// Negative slots and SWA-unmapped slots are skipped. Inputs are never modified.
// A bf16 cache stores the rows unscaled (scales apply to FP8 only).
void kv_write_fused(const KvWriteArgs& args);

// The unfused path as today's serving systems run it, one stage per launch on a GPU:
// scale K into fp32 scratch, scale V, cast K to the cache dtype, cast V, scatter both
// into their pages. The intermediate is fp32, so the bytes equal the fused write's. The
// scratch (kernels/common/kv_write_scratch.h) is laid out as the GPU's.
void kv_write_unfused(const KvWriteArgs& args, const KvWriteScratch& scratch);

// The fused write with RoPE on the way (KvWritePath::fused_rope, KvWriteRopeArgs): per
// token, q's heads rotated in place and K's rotated into a row of its own, then that row
// and V written as kv_write_fused writes them. The rotation is rope_neox's own code
// (kernels/cpu/ops/rope_rows.h) and the write kv_write_fused's, so q, the cache (and
// k_rotated) hold exactly the bits of rope_neox followed by kv_write_fused. Rows with a
// skipped slot still rotate q (and k_rotated); args.kv.k is read only. Sources must be
// bf16.
void kv_write_rope(const KvWriteRopeArgs& args);

}  // namespace kvfuse::cpu
