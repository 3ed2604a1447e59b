// NVIDIA side of the portability layer (kernels/common/gpu.h). Kernels are written in the CUDA
// dialect, so on NVIDIA this header only adds the few device helpers whose spelling
// differs between vendors. Never include it directly: include kernels/common/gpu.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#define KVFUSE_GPU_VENDOR "cuda"
// Every NVIDIA warp is 32 lanes. Kernels use kvfuse::gpu::kWarpSize, never the literal.
#define KVFUSE_WARP_SIZE 32
// Programmatic dependent launch (sm_90+; launches ask for it, kernels wait for it).
#define KVFUSE_HAS_PDL 1

// Launch bounds (kernels/common/gpu.h, KVFUSE_LAUNCH_BOUNDS): CUDA's second argument already
// is the minimum of resident blocks per multiprocessor.
#define KVFUSE_VENDOR_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__((threads), (blocks))

namespace kvfuse::gpu {

// Lane masks are as wide as a warp: 32 bits here, 64 on CDNA (vendor/hip.h).
using lane_mask_t = uint32_t;
constexpr lane_mask_t kFullLaneMask = 0xffffffffu;

template <class T>
__device__ __forceinline__ T vendor_shfl_xor(T x, int lane_xor) {
  return __shfl_xor_sync(kFullLaneMask, x, lane_xor);
}

template <class T>
__device__ __forceinline__ T vendor_shfl(T x, int src_lane) {
  return __shfl_sync(kFullLaneMask, x, src_lane);
}

// ---- Cross-lane reductions and scans (kernels/common/gpu.h: warp_reduce, warp_inclusive_sum)

// vendor_shfl_xor for any trivially copyable T of whole 32-bit words: a scalar in one
// shuffle, a struct one shuffle per word (what shuffling its members one by one gives).
template <class T>
__device__ __forceinline__ T vendor_shfl_xor_words(T x, int lane_xor) {
  if constexpr (std::is_arithmetic_v<T>) {
    return vendor_shfl_xor(x, lane_xor);
  } else {
    static_assert(sizeof(T) % 4 == 0, "shuffles move whole 32-bit words");
    struct Words {
      int w[sizeof(T) / 4];
    };
    Words v = __builtin_bit_cast(Words, x);
#pragma unroll
    for (int i = 0; i < int(sizeof(T) / 4); ++i) v.w[i] = vendor_shfl_xor(v.w[i], lane_xor);
    return __builtin_bit_cast(T, v);
  }
}

// op over the warp as a butterfly: lane i meets lane i ^ 16, ^ 8, ... ^ 1.
template <class T, class Op>
__device__ __forceinline__ T vendor_warp_reduce(T x, Op op) {
#pragma unroll
  for (int off = KVFUSE_WARP_SIZE / 2; off > 0; off /= 2) x = op(x, vendor_shfl_xor_words(x, off));
  return x;
}

// Inclusive prefix sum over the lanes (Hillis-Steele, shuffles up by 1, 2, ... 16).
template <class T>
__device__ __forceinline__ T vendor_warp_inclusive_sum(T x) {
  const int lane = int(threadIdx.x) % KVFUSE_WARP_SIZE;
#pragma unroll
  for (int off = 1; off < KVFUSE_WARP_SIZE; off *= 2) {
    const T y = vendor_shfl(x, lane >= off ? lane - off : lane);
    if (lane >= off) x += y;
  }
  return x;
}

// Byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x (prmt).
__device__ __forceinline__ uint32_t vendor_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  return __byte_perm(x, y, s);
}

// 1/x correctly rounded (IEEE round to nearest even), as the CPU reference computes it.
__device__ __forceinline__ float vendor_recip_rn(float x) { return __frcp_rn(x); }
// fp32 products and sums rounded on their own: never contracted into a multiply-add.
__device__ __forceinline__ float vendor_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float vendor_add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float vendor_sub_rn(float a, float b) { return __fsub_rn(a, b); }

// Exact widening of an IEEE half bit pattern (cvt.f32.f16). NaN payloads are not
// guaranteed to survive, which is fine for FP8 targets (every NaN becomes the canonical
// code) but not for a bf16 target: that path uses kvfuse::f16_to_f32 (bf16.h).
__device__ __forceinline__ float vendor_f16_to_f32(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// 16-byte read-only load through the non-coherent path: the sources of a KV write are
// never written by the kernel that reads them.
__device__ __forceinline__ uint4 vendor_load_ro_16B(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}

// 16-byte load of data read once (a GEMV's weights): the non-coherent path without
// allocating in L1 (which keeps the small, reused operand there) and marked to be evicted
// first from L2 (keeping the step's activations). `policy` is l2_evict_first_policy().
__device__ __forceinline__ uint64_t vendor_l2_evict_first_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}
__device__ __forceinline__ uint4 vendor_load_stream_16B(const void* p, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(policy));
  return v;
#else
  (void)policy;
  return __ldg(static_cast<const uint4*>(p));
#endif
}

// Two fp32 loads issued back to back in one asm statement, so that a long-latency use
// of the first cannot delay the second: rcp.rn's slow path is a branch that ptxas does
// not schedule loads across, and NVVM orders `ld a; rcp a; ld b; rcp b`.
__device__ __forceinline__ void vendor_load_f32_pair(const float* a, const float* b, float& x, float& y) {
  asm volatile("ld.global.f32 %0, [%2];\n\tld.global.f32 %1, [%3];"
               : "=f"(x), "=f"(y)
               : "l"(a), "l"(b)
               : "memory");
}

// Programmatic dependent launch (sm_90+): a kernel launched with the attribute may be
// scheduled while its predecessor in the stream is still running; it must wait here
// before touching memory the predecessor reads or writes. A no-op for launches without
// the attribute and on older architectures.
__device__ __forceinline__ void vendor_grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel (if launched with the attribute) be scheduled now.
__device__ __forceinline__ void vendor_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- Signalling between GPUs (kernels/common/gpu.h: store_release_system, ...) -------------
// System scope: the other GPUs of the process (peer memory over NVLink/PCIe) and the host
// see the operation in order. sm_70+ (the PTX memory model's scoped operations).
__device__ __forceinline__ void vendor_store_release_system(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t vendor_load_relaxed_system(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// ld.volatile: a relaxed load at system scope on sm_70+, here of four words in one request.
__device__ __forceinline__ uint4 vendor_load_volatile_16B(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
// With a relaxed load before it that read a release store's value: the PTX "acquire
// pattern", so what the storing thread published is visible after it.
__device__ __forceinline__ void vendor_fence_acquire_system() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
// A clock that ticks at the same rate on every GPU and while the SM clock changes:
// %globaltimer, nanoseconds.
__device__ __forceinline__ uint64_t vendor_wall_clock() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
inline cudaError_t vendor_wall_clock_hz(int /*device*/, int64_t* hz) {
  *hz = 1000000000;
  return cudaSuccess;
}
// Device memory that GPUs signal each other through: plain device memory on NVIDIA
// (scoped loads and stores keep it coherent).
inline cudaError_t vendor_malloc_signals(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
// Host memory every GPU reads and writes in place (UVA: the host pointer is the device's).
inline cudaError_t vendor_host_alloc_mapped(void** p, size_t bytes) {
  return cudaHostAlloc(p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
}

// Kernel launch, optionally with programmatic dependent launch (PDL).
template <class... Params, class... Args>
cudaError_t vendor_launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                          Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, 0, stream>>>(static_cast<Args&&>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
  // A refused launch also leaves its error as the thread's last one; taken here, as the
  // <<<>>> path takes it, so that the next launch does not report it as its own.
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // namespace kvfuse::gpu
