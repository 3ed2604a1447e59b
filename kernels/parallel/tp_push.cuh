// The push of a tensor-parallel partial result that no GEMV epilogue delivered (kernels/
// tp_push.h): a copy into every peer's inbox, for the projections the BLAS-Lt library or
// the skinny GEMM runs. CUDA and HIP from one source.
#pragma once

#include "kernels/common/gpu.h"

#include "kernels/common/bf16.h"
#include "kernels/parallel/tp_push.h"

namespace kvfuse::gpu {

// The bits a producer pushes for the bf16 result v: v, except kPushEmpty, which goes as the
// canonical quiet NaN (kPushNaN).
KVFUSE_DEVICE uint16_t push_bits(uint16_t v) { return v == kPushEmpty ? kPushNaN : v; }

// push.dst[p][i] = push_bits(src[i]) for i < count and every target p. 16-byte vectors where
// src and every target are 16-byte aligned, else element by element. pdl: launched as a
// programmatic dependent; src is read after the wait. Asynchronous on `stream`, graph-safe.
cudaError_t launch_push_copy(const bf16_t* src, int64_t count, const PushTargets& push, cudaStream_t stream,
                             bool pdl = false);

// Loads the copy kernel on the current device now (the runtime otherwise loads a kernel at
// its first launch, which may wait for the device's running kernels: a peer's norm
// waiting for this rank's push among them).
cudaError_t load_push_copy();

}  // namespace kvfuse::gpu
