// AMD side of the portability layer (kernels/common/gpu.h), in the style of llama.cpp's
// vendors/hip.h: kernels and host code are written in the CUDA dialect, and this header
// maps the runtime names onto HIP, so the same .cu files build as LANGUAGE HIP. Never
// include it directly: include kernels/common/gpu.h.
#pragma once

#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#include <cstdint>

#define KVFUSE_GPU_VENDOR "hip"
// kvfuse targets CDNA (gfx942 MI300X/MI325X, gfx950 MI350X/MI355X): 64-lane wavefronts.
// RDNA's wave32 is not a target; refuse to build for it rather than run with the wrong
// lane count. Current clang deprecates the compile-time __AMDGCN_WAVEFRONT_SIZE, so the
// test is on the target family: every gfx9 target (GCN, CDNA) runs 64-lane wavefronts,
// gfx10-12 (RDNA) default to 32. The backend also checks warpSize at run time.
#define KVFUSE_WARP_SIZE 64
// No programmatic dependent launch on AMD.
#define KVFUSE_HAS_PDL 0
#if defined(__HIP_DEVICE_COMPILE__) && !defined(__GFX9__)
#error "kvfuse's HIP kernels assume 64-lane wavefronts (CDNA, gfx9 family); this target is not one"
#endif

// Launch bounds (kernels/common/gpu.h, KVFUSE_LAUNCH_BOUNDS). HIP's own __launch_bounds__(t, n)
// reads n as minimum waves per EU (SIMD), not CUDA's minimum blocks per multiprocessor,
// so the attributes are spelled out: a CDNA CU has 4 SIMDs, and `blocks` resident
// blocks of `threads` threads put ceil(blocks * ceil(threads / 64) / 4) waves on each.
#define KVFUSE_VENDOR_LAUNCH_BOUNDS(threads, blocks)        \
  __attribute__((amdgpu_flat_work_group_size(1, (threads)), \
                 amdgpu_waves_per_eu(((blocks) * (((threads) + 63) / 64) + 3) / 4)))

// Runtime names, CUDA spelling -> HIP. Only what kvfuse uses; add as needed.
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaErrorMisalignedAddress hipErrorMisalignedAddress
#define cudaErrorNoDevice hipErrorNoDevice
#define cudaGetErrorString hipGetErrorString
#define cudaGetErrorName hipGetErrorName
#define cudaGetLastError hipGetLastError
#define cudaPeekAtLastError hipPeekAtLastError
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaDeviceProp hipDeviceProp_t
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaMalloc hipMalloc
#define cudaMemGetInfo hipMemGetInfo
#define cudaFree hipFree
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocPortable hipHostMallocPortable
#define cudaFreeHost hipHostFree
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpy2DAsync hipMemcpy2DAsync
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaStream_t hipStream_t
#define cudaStreamCreate hipStreamCreate
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaStreamIsCapturing hipStreamIsCapturing
#define cudaStreamCaptureStatus hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone hipStreamCaptureStatusNone
#define cudaGraphInstantiate hipGraphInstantiateWithFlags  // CUDA 12+ signature: (exec, graph, flags)
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphDestroy hipGraphDestroy
#define cudaDeviceCanAccessPeer hipDeviceCanAccessPeer
#define cudaDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define cudaErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled

namespace kvfuse::gpu {

// Lane masks cover a 64-lane wavefront.
using lane_mask_t = uint64_t;
constexpr lane_mask_t kFullLaneMask = ~uint64_t(0);

template <class T>
__device__ __forceinline__ T vendor_shfl_xor(T x, int lane_xor) {
  return __shfl_xor(x, lane_xor, KVFUSE_WARP_SIZE);
}

template <class T>
__device__ __forceinline__ T vendor_shfl(T x, int src_lane) {
  return __shfl(x, src_lane, KVFUSE_WARP_SIZE);
}

// ---- Cross-lane reductions and scans (kernels/common/gpu.h: warp_reduce, warp_inclusive_sum)
// __shfl_xor and __shfl compile to ds_bpermute_b32, a trip through the LDS crossbar
// (address arithmetic, issue, s_waitcnt) per 32-bit word and step: six steps for 64
// lanes. DPP (data-parallel primitives) has the VALU read an operand from another lane
// instead, so a step is one or two VALU instructions (the compiler folds the move into
// the op that uses it, v_add_f32_dpp, when it writes every lane). The lane patterns are
// fixed. Within a row of 16 lanes: quad_perm (any permutation within 4 lanes),
// row_half_mirror (7 - i within each 8), row_mirror (15 - i), row_shr:n (i - n). Across
// rows: row_bcast:15 (lane 15 of each row to the whole next row) and row_bcast:31 (lane
// 31 to rows 2 and 3), which only the GFX9 family has: CDNA does, RDNA does not (refused
// above). Every lane must be active, as for the shuffles: kernels call these from whole
// waves.
namespace dpp {
constexpr int kQuadPerm1032 = 0xb1;    // lane ^ 1
constexpr int kQuadPerm2301 = 0x4e;    // lane ^ 2
constexpr int kRowShr = 0x110;         // + n, 1 <= n <= 15: lane - n within the row
constexpr int kRowMirror = 0x140;      // 15 - lane within the row
constexpr int kRowHalfMirror = 0x141;  // 7 - lane within each half row
constexpr int kRowBcast15 = 0x142;
constexpr int kRowBcast31 = 0x143;
}  // namespace dpp

// x as read from the lane that DPP control kCtrl names, one v_mov_b32_dpp per 32-bit word
// of a trivially copyable T. Lanes of rows outside kRowMask, and lanes whose source lies
// outside their row (row_shr), get `old`. With every row written and old = 0 the
// compiler folds the move into the op that uses it.
template <int kCtrl, int kRowMask = 0xf, class T>
__device__ __forceinline__ T vendor_dpp(T old, T x) {
  static_assert(sizeof(T) % 4 == 0, "DPP moves whole 32-bit words");
  struct Words {
    int w[sizeof(T) / 4];
  };
  const Words o = __builtin_bit_cast(Words, old);
  Words v = __builtin_bit_cast(Words, x);
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i) {
    v.w[i] = __builtin_amdgcn_update_dpp(o.w[i], v.w[i], kCtrl, kRowMask, 0xf, false);
  }
  return __builtin_bit_cast(T, v);
}

// x of lane `lane` in every lane (v_readlane_b32 into a scalar register).
template <class T>
__device__ __forceinline__ T vendor_readlane(T x, int lane) {
  struct Words {
    int w[sizeof(T) / 4];
  };
  Words v = __builtin_bit_cast(Words, x);
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i) v.w[i] = __builtin_amdgcn_readlane(v.w[i], lane);
  return __builtin_bit_cast(T, v);
}

// op over the wave: a tree of depth six, as the butterfly of __shfl_xor is, paired
// differently. Within each row lane i meets i ^ 1, i ^ 2, then 7 - i, then 15 - i, after
// which every lane of a row holds the row's reduction (the in-row steps read no lane
// outside the row, so their `old` is never used; 0 lets the compiler fold them). Rows 1
// and 3 then take in rows 0 and 2, row 3 takes in rows 0-1, and lane 63, which now holds
// the whole wave's, is read into every lane: all lanes get the same bits whatever op
// is. Lanes of rows masked out of a row_bcast combine x with itself and are not read
// again.
template <class T, class Op>
__device__ __forceinline__ T vendor_warp_reduce(T x, Op op) {
  const T zero{};
  x = op(x, vendor_dpp<dpp::kQuadPerm1032>(zero, x));
  x = op(x, vendor_dpp<dpp::kQuadPerm2301>(zero, x));
  x = op(x, vendor_dpp<dpp::kRowHalfMirror>(zero, x));
  x = op(x, vendor_dpp<dpp::kRowMirror>(zero, x));
  x = op(x, vendor_dpp<dpp::kRowBcast15, 0xa>(x, x));
  x = op(x, vendor_dpp<dpp::kRowBcast31, 0xc>(x, x));
  return vendor_readlane(x, KVFUSE_WARP_SIZE - 1);
}

// Inclusive prefix sum over the lanes: lane i gets x(0) + ... + x(i). Hillis-Steele
// within each row (row_shr 1, 2, 4, 8; lanes shifted in from outside the row add 0),
// then rows 1 and 3 add the total of rows 0 and 2, rows 2 and 3 the total of rows 0-1.
// Exact for integers (the kernels' only use); a float sum would be added in this order.
template <class T>
__device__ __forceinline__ T vendor_warp_inclusive_sum(T x) {
  const T zero{};
  x += vendor_dpp<dpp::kRowShr + 1>(zero, x);
  x += vendor_dpp<dpp::kRowShr + 2>(zero, x);
  x += vendor_dpp<dpp::kRowShr + 4>(zero, x);
  x += vendor_dpp<dpp::kRowShr + 8>(zero, x);
  x += vendor_dpp<dpp::kRowBcast15, 0xa>(zero, x);
  x += vendor_dpp<dpp::kRowBcast31, 0xc>(zero, x);
  return x;
}

// CUDA's __byte_perm (byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x) as
// one v_perm_b32. HIP's own __byte_perm indexes a byte array, which a selector known
// only at run time puts in scratch memory (the attention kernel's P fragment shuffle).
// v_perm_b32 takes a whole byte per selector and its sources the other way round:
// selectors 0-3 pick bytes of its second operand, 4-7 of its first.
__device__ __forceinline__ uint32_t vendor_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint32_t sel = (s & 0x7u) | ((s & 0x70u) << 4) | ((s & 0x700u) << 8) | ((s & 0x7000u) << 12);
  return __builtin_amdgcn_perm(y, x, sel);
}

// 1/x correctly rounded. Not __frcp_rn: HIP implements it with v_rcp_f32, which is an
// approximation (1 ulp), and the CPU reference divides exactly. clang compiles fp32
// division correctly rounded for HIP by default (-fhip-fp32-correctly-rounded-divide-sqrt).
__device__ __forceinline__ float vendor_recip_rn(float x) { return 1.0f / x; }
// fp32 products and sums rounded on their own: never contracted into a multiply-add
// (HIP's __fmul_rn and friends are plain operators, which contraction may fuse).
__device__ __forceinline__ float vendor_mul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ __forceinline__ float vendor_add_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
__device__ __forceinline__ float vendor_sub_rn(float a, float b) {
#pragma clang fp contract(off)
  return a - b;
}

// Exact widening of an IEEE half bit pattern (v_cvt_f32_f16).
__device__ __forceinline__ float vendor_f16_to_f32(uint16_t bits) {
  return static_cast<float>(__builtin_bit_cast(_Float16, bits));
}

// AMD has no separate read-only cache path to ask for: a plain 16-byte load
// (global_load_dwordx4).
__device__ __forceinline__ uint4 vendor_load_ro_16B(const void* p) { return *static_cast<const uint4*>(p); }

// Data read once: a plain load on AMD (no L1/L2 hint wired up here).
__device__ __forceinline__ uint64_t vendor_l2_evict_first_policy() { return 0; }
__device__ __forceinline__ uint4 vendor_load_stream_16B(const void* p, uint64_t) {
  return *static_cast<const uint4*>(p);
}

// Two fp32 loads. AMD's correctly rounded division has no branch to schedule around.
__device__ __forceinline__ void vendor_load_f32_pair(const float* a, const float* b, float& x, float& y) {
  x = *a;
  y = *b;
}

// No programmatic dependent launch on AMD: kernels in a stream run in order, and the
// dependency hooks are no-ops.
__device__ __forceinline__ void vendor_grid_dependency_wait() {}
__device__ __forceinline__ void vendor_launch_dependents() {}

// ---- Signalling between GPUs (kernels/common/gpu.h: store_release_system, ...) -------------
// System scope: the release writes back this GPU's L2 before the store (buffer_wbl2 on
// gfx942/gfx950), the acquire invalidates the lines another agent may have changed.
__device__ __forceinline__ void vendor_store_release_system(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ uint64_t vendor_load_relaxed_system(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ uint4 vendor_load_volatile_16B(const void* p) {
  const uint32_t* w = static_cast<const uint32_t*>(p);
  return make_uint4(__hip_atomic_load(w, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM),
                    __hip_atomic_load(w + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM),
                    __hip_atomic_load(w + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM),
                    __hip_atomic_load(w + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM));
}
__device__ __forceinline__ void vendor_fence_acquire_system() {
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "");
}
// The constant-rate wall clock (s_memrealtime); its rate comes from the device attribute.
__device__ __forceinline__ uint64_t vendor_wall_clock() { return uint64_t(wall_clock64()); }
inline hipError_t vendor_wall_clock_hz(int device, int64_t* hz) {
  int khz = 0;
  const hipError_t err = hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, device);
  *hz = int64_t(khz) * 1000;
  return err;
}
// Flags that other GPUs store into while a kernel polls them: uncached (fine-grained)
// device memory, as coarse-grained memory is only coherent at kernel boundaries.
inline hipError_t vendor_malloc_signals(void** p, size_t bytes) {
  return hipExtMallocWithFlags(p, bytes, hipDeviceMallocUncached);
}
// Host memory every GPU reads and writes in place, coherent while kernels run.
inline hipError_t vendor_host_alloc_mapped(void** p, size_t bytes) {
  return hipHostMalloc(p, bytes, hipHostMallocMapped | hipHostMallocPortable | hipHostMallocCoherent);
}

template <class... Params, class... Args>
hipError_t vendor_launch(void (*kernel)(Params...), dim3 grid, dim3 block, hipStream_t stream, bool /*pdl*/,
                         Args&&... args) {
  kernel<<<grid, block, 0, stream>>>(static_cast<Args&&>(args)...);
  return hipGetLastError();
}

}  // namespace kvfuse::gpu
