// The push of a partial result into the peers' inboxes (kernels/parallel/tp_push.cuh).
#include "kernels/common/gpu.h"

#include "kernels/parallel/tp_push.cuh"

namespace kvfuse::gpu {
namespace {

constexpr int kThreads = 256;

KVFUSE_DEVICE uint32_t push_pair(uint32_t v) {
  return uint32_t(push_bits(uint16_t(v))) | (uint32_t(push_bits(uint16_t(v >> 16))) << 16);
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    push_copy_kernel(const bf16_t* src, int64_t count, PushTargets push, bool vectors) {
  grid_dependency_wait();  // PDL: src comes from the kernel before
  launch_dependents();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int64_t scalar_from = 0;
  if (vectors) {
    const int64_t vecs = count / 8;
    scalar_from = vecs * 8;
    for (int64_t v = first; v < vecs; v += stride) {
      const uint4 a = *reinterpret_cast<const uint4*>(src + 8 * v);
      const uint4 b = make_uint4(push_pair(a.x), push_pair(a.y), push_pair(a.z), push_pair(a.w));
#pragma unroll
      for (int p = 0; p < PushTargets::kMax; ++p) {
        if (p < push.count) store_16B(push.dst[p] + 8 * v, b);
      }
    }
  }
  for (int64_t i = scalar_from + first; i < count; i += stride) {
    const uint16_t b = push_bits(src[i]);
#pragma unroll
    for (int p = 0; p < PushTargets::kMax; ++p) {
      if (p < push.count) push.dst[p][i] = b;
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t launch_push_copy(const bf16_t* src, int64_t count, const PushTargets& push, cudaStream_t stream,
                             bool pdl) {
  if (count <= 0 || push.count == 0) return cudaSuccess;
  if (push.count < 0 || push.count > PushTargets::kMax || src == nullptr) return cudaErrorInvalidValue;
  bool vectors = aligned16(src);
  for (int p = 0; p < push.count; ++p) {
    if (push.dst[p] == nullptr) return cudaErrorInvalidValue;
    vectors = vectors && aligned16(push.dst[p]);
  }
  // One 16-byte vector per thread, up to a wave of blocks; the kernel loops for the rest.
  const int64_t blocks = (count / 8 + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
  return launch_kernel(push_copy_kernel, grid, kThreads, stream, pdl, src, count, push, vectors);
}

cudaError_t load_push_copy() {
  int per_sm = 0;  // an occupancy query references the kernel, as a launch would
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, push_copy_kernel, kThreads, 0);
}

}  // namespace kvfuse::gpu
