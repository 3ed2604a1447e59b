// Skinny GEMM on Hopper's tensor cores (kernels/gemm/gemm_skinny.cuh).
#include "kernels/common/gpu.h"

#include "kernels/gemm/gemm_skinny.cuh"

#include <climits>

#if !defined(KVFUSE_HIP)
#include <cuda.h>  // CUtensorMap and its enums (the encoder comes from the runtime, no -lcuda)
#include <cudaTypedefs.h>
#endif

namespace kvfuse::gpu {
namespace {

constexpr int kConsumers = 2;                   // warpgroups
constexpr int kMinBlockRows = 64 * kConsumers;  // a row block: kRT 64-row MMA tiles per warpgroup
constexpr int kSplitCounts = 6;
constexpr int kSplits[kSplitCounts] = {1, 2, 3, 4, 6, 8};  // a cluster each: at most 8 blocks
static_assert(kSkinnyVariants == 3 * kSplitCounts, "a variant: a split count and one of three tilings");

// Variant v: kSplits[v % 6] splits of k; v / 6: row blocks of 128 rows (two blocks an SM),
// of 256 (one block an SM, half the reads of x per row of w), or of 256 with the tokens as
// the MMA's M (64 of them, padded) and each warpgroup's 128 rows of w as its N.
int splits_of(int variant) { return kSplits[variant % kSplitCounts]; }
int row_tiles_of(int variant) { return variant < kSplitCounts ? 1 : 2; }

#if !defined(KVFUSE_HIP)
bool tokens_as_m(int variant) { return variant >= 2 * kSplitCounts; }
// Tokens per block: the MMA's N, m rounded up to 16, 32 or 64.
int tokens_for(int64_t m) { return m <= 16 ? 16 : m <= 32 ? 32 : 64; }
constexpr int kThreads = 128 * kConsumers + 32;  // and one producer warp
constexpr int kStepK = int(kSkinnyStepK);        // columns per stage: 128 bytes a row
KVFUSE_HD constexpr int w_tile_bytes(int row_tiles) { return kMinBlockRows * row_tiles * kStepK * 2; }
KVFUSE_HD constexpr int x_tile_bytes(int tokens) { return tokens * kStepK * 2; }
// Stages in flight: about 96 KiB of them with 128-row blocks, so that two blocks fit an
// SM, about 200 KiB with 256-row blocks.
KVFUSE_HD constexpr int stages_for(int tokens, int row_tiles) {
  return (row_tiles == 1 ? 98304 : 204800) / (w_tile_bytes(row_tiles) + x_tile_bytes(tokens));
}
// The block's fp32 sums after the last step, [token][row] with rows padded by 4 (no bank
// conflicts when the accumulators are stored), in the stages' space.
KVFUSE_HD constexpr int part_stride(int row_tiles) { return kMinBlockRows * row_tiles + 4; }
KVFUSE_HD constexpr int part_bytes(int tokens, int row_tiles) { return tokens * part_stride(row_tiles) * 4; }
constexpr bool sums_fit(int tokens, int row_tiles) {
  return part_bytes(tokens, row_tiles) <=
         stages_for(tokens, row_tiles) * (w_tile_bytes(row_tiles) + x_tile_bytes(tokens));
}
static_assert(sums_fit(16, 1) && sums_fit(32, 1) && sums_fit(64, 1) && sums_fit(16, 2) && sums_fit(32, 2) &&
                  sums_fit(64, 2),
              "the block's sums fit in its stages");
// Dynamic shared memory: the stages (1024-byte aligned: the 128-byte swizzle's period) and
// their full and empty barriers, plus the alignment slack.
KVFUSE_HD constexpr size_t smem_bytes(int tokens, int row_tiles) {
  return size_t(stages_for(tokens, row_tiles)) * (w_tile_bytes(row_tiles) + x_tile_bytes(tokens)) +
         2 * 8 * stages_for(tokens, row_tiles) + 1024;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVFUSE_SKINNY_HW 1
#else
#define KVFUSE_SKINNY_HW 0
#endif

#if KVFUSE_SKINNY_HW
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
// A 2D box of a tensor map into shared memory, counted on `bar`; w's boxes with an L2
// hint to evict them first (they are read once a step; x and the activations stay).
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row)
      : "memory");
}
__device__ __forceinline__ void tma_load_evict_first(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                     int col, int row, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
      "{%3, "
      "%4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row), "l"(policy)
      : "memory");
}
// The shared-memory descriptor of a K-major operand in 128-byte swizzled rows (as TMA's
// CU_TENSOR_MAP_SWIZZLE_128B lays them out): 8-row groups 1024 bytes apart. A k16 step
// inside the rows is the start address plus 32 bytes.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  return uint64_t((smem_addr(p) & 0x3ffff) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the wgmma
// fences and waits (a read between an MMA's issue and its wait serializes the MMAs).
template <int kN>
__device__ __forceinline__ void fence_acc(float (&acc)[kN]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) asm volatile("" : "+f"(acc[j])::"memory");
}
// The consumers' own barrier (the producer warp does not take part).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
}
// Every thread of the cluster's blocks: what each wrote to its shared memory before is
// seen by the others' reads after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// 16 bytes of block `rank`'s shared memory at this block's address p (distributed shared
// memory).
__device__ __forceinline__ float4 load_cluster(const void* p, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// d += a . b^T over 16 columns of k: a 64 rows of w, b kN tokens, both from shared memory
// (descriptors), fp32 accumulators in the wgmma D layout.
template <int kN>
struct Wgmma;
// One specialization per N: PTX names every accumulator register, so each lists its own.
// clang-format off
template <>
struct Wgmma<16> {
  static __device__ __forceinline__ void mma(float (&d)[8], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7"
        "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b));
  }
};
template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b));
  }
};
template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
  }
};
template <>
struct Wgmma<128> {
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b));
  }
};
// clang-format on
#endif  // KVFUSE_SKINNY_HW

// Block b takes row block b / splits (kBlockRows = 128 kRT rows of w) over split b %
// splits of k's 64-column steps; the splits of a row block are one cluster. Warp 8, one
// lane, streams each step's box of w (kBlockRows rows x 64 columns) and of x (kN tokens,
// past m zeros) into a stage by TMA, 128-byte swizzled, and waits for the consumers to
// free a stage before refilling it; warpgroup c multiplies its kRT tiles of 64 rows with
// wgmma m64nkNk16 (four a tile per step), keeping one step's MMAs in flight.
//
// The weights do not come from the kernel before: with early_w the first stages' w boxes
// are requested before the programmatic-launch wait (while the kernel before runs), x's
// after it.
//
// Then each block leaves its fp32 sums in its shared memory, and block q of the cluster
// adds the splits' sums of its share of the outputs, in split order (so the bits do not
// depend on timing), read from the blocks' shared memory, and writes them: 4 rows of a
// token a thread, coalesced.
template <int kN, int kRT, bool kSwap, bool kF32>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    skinny_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, int m,
                  int n, int k, void* out, int splits, bool early_w) {
#if KVFUSE_SKINNY_HW
  constexpr int kBlockRows = kMinBlockRows * kRT;
  constexpr int kStages = stages_for(kN, kRT);
  constexpr int kWTileBytes = w_tile_bytes(kRT);
  constexpr int kXTileBytes = x_tile_bytes(kN);
  static_assert(!kSwap || (kN == 64 && kRT == 2), "tokens as M: 64 tokens, 2 x 128 rows of w");
  constexpr int kTiles = kSwap ? 1 : kRT;      // MMA tiles per warpgroup
  constexpr int kAcc = kSwap ? 64 : kN / 2;    // accumulators per tile and thread
  constexpr int kTileBytes = 64 * kStepK * 2;  // a 64-row MMA tile of w in a stage
  constexpr int kStride = part_stride(kRT);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sw = smem;                          // [kStages][kWTileBytes]
  uint8_t* sx = smem + kStages * kWTileBytes;  // [kStages][kXTileBytes]
  uint64_t* full = reinterpret_cast<uint64_t*>(sx + kStages * kXTileBytes);
  uint64_t* empty = full + kStages;
  float* part = reinterpret_cast<float*>(smem);  // [kN][kStride], after the last step

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int rb = int(blockIdx.x) / splits,
            split = int(blockIdx.x) % splits;  // split: the rank in the cluster
  const int total = k / kStepK;
  const int per = (total + splits - 1) / splits;
  const int first = split * per;
  const int steps = max(0, min(total, first + per) - first);

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4 * kConsumers) {  // the producer
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      const int row0 = rb * kBlockRows;
      const int pre = min(steps, kStages);
      if (!early_w) grid_dependency_wait();
      for (int s = 0; s < pre; ++s) {
        mbar_expect_tx(&full[s], kWTileBytes + kXTileBytes);
        tma_load_evict_first(sw + s * kWTileBytes, &wmap, &full[s], (first + s) * kStepK, row0, policy);
      }
      if (early_w) grid_dependency_wait();
      for (int s = 0; s < pre; ++s) tma_load(sx + s * kXTileBytes, &xmap, &full[s], (first + s) * kStepK, 0);
      for (int s = kStages; s < steps; ++s) {
        const int slot = s % kStages;
        mbar_wait(&empty[slot], ((s / kStages) - 1) & 1);
        mbar_expect_tx(&full[slot], kWTileBytes + kXTileBytes);
        tma_load_evict_first(sw + slot * kWTileBytes, &wmap, &full[slot], (first + s) * kStepK, row0, policy);
        tma_load(sx + slot * kXTileBytes, &xmap, &full[slot], (first + s) * kStepK, 0);
      }
    }
    __syncwarp();
    launch_dependents();
  } else {
    // A consumer: warpgroup c, thread t of 128 in it, w rows 64 (kRT c + r) + 0..63 of
    // the block in acc[r] (kSwap: rows 128 c + 0..127 in acc[0]).
    grid_dependency_wait();  // out may still be in use by the kernel before
    const int c = tid >> 7, t = tid & 127;
    float acc[kTiles][kAcc];
#pragma unroll
    for (int r = 0; r < kTiles; ++r)
#pragma unroll
      for (int j = 0; j < kAcc; ++j) acc[r][j] = 0.0f;
    const auto fence_all = [&] {
#pragma unroll
      for (int r = 0; r < kTiles; ++r) fence_acc(acc[r]);
    };
    for (int s = 0; s < steps; ++s) {
      const int slot = s % kStages;
      mbar_wait(&full[slot], (s / kStages) & 1);
      const uint8_t* a = sw + slot * kWTileBytes + c * kRT * kTileBytes;
      const uint8_t* b = sx + slot * kXTileBytes;
      fence_all();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kStepK / 16; ++kk) {
        if constexpr (kSwap) {
          Wgmma<128>::mma(acc[0], smem_desc(b + kk * 32), smem_desc(a + kk * 32));
        } else {
#pragma unroll
          for (int r = 0; r < kRT; ++r) {
            Wgmma<kN>::mma(acc[r], smem_desc(a + r * kTileBytes + kk * 32), smem_desc(b + kk * 32));
          }
        }
      }
      wgmma_commit();
      fence_all();
      wgmma_wait<1>();  // the step before has been read: its stage is free
      fence_all();
      if (s > 0 && t == 0) mbar_arrive(&empty[(s - 1) % kStages]);
    }
    wgmma_wait<0>();
    fence_all();
    launch_dependents();
    consumers_sync();  // both warpgroups' MMAs have read the stages the sums overwrite
    // The wgmma D layout: acc[r][j] is M index 16 w + l / 4 + 8 ((j / 2) % 2) and N index
    // 8 (j / 4) + 2 (l % 4) + j % 2 (w the warp in the warpgroup, l its lane): a row of
    // w's 64-row tile and a token, or with kSwap a token and a row of the warpgroup's 128.
    const int wq = t >> 5;
#pragma unroll
    for (int r = 0; r < kTiles; ++r) {
#pragma unroll
      for (int j = 0; j < kAcc; ++j) {
        const int mi = wq * 16 + (lane >> 2) + 8 * ((j >> 1) & 1);
        const int ni = 8 * (j >> 2) + 2 * (lane & 3) + (j & 1);
        if constexpr (kSwap) {
          part[mi * kStride + c * 128 + ni] = acc[r][j];
        } else {
          part[ni * kStride + (c * kRT + r) * 64 + mi] = acc[r][j];
        }
      }
    }
  }
  cluster_sync();  // every block's sums are in its shared memory (a block of its own: splits = 1)

  // Block `split` of the cluster: its share of the [kN][kBlockRows] outputs, 4 rows a
  // thread (every thread of the block, the producer's warp too).
  constexpr int kQuads = kN * kBlockRows / 4;
  const int lo = split * kQuads / splits, hi = (split + 1) * kQuads / splits;
  for (int q = lo + tid; q < hi; q += kThreads) {
    const int token = q / (kBlockRows / 4), row = (q % (kBlockRows / 4)) * 4;
    const float* src = part + token * kStride + row;
    float4 sum = splits == 1 ? *reinterpret_cast<const float4*>(src) : load_cluster(src, 0);
    for (int s = 1; s < splits; ++s) {  // split order, whichever block this is
      const float4 p = load_cluster(src, s);
      sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
    const int64_t grow = int64_t(rb) * kBlockRows + row;
    if (token >= m || grow >= n) continue;  // n is a multiple of 16: the 4 rows are all in or all out
    const int64_t at = int64_t(token) * n + grow;
    if constexpr (kF32) {
      *reinterpret_cast<float4*>(static_cast<float*>(out) + at) = sum;
    } else {
      const uint32_t lo2 = uint32_t(f32_to_bf16(sum.x)) | (uint32_t(f32_to_bf16(sum.y)) << 16);
      const uint32_t hi2 = uint32_t(f32_to_bf16(sum.z)) | (uint32_t(f32_to_bf16(sum.w)) << 16);
      *reinterpret_cast<uint2*>(static_cast<bf16_t*>(out) + at) = make_uint2(lo2, hi2);
    }
  }
  cluster_sync();  // no block leaves while another still reads its shared memory
#else
  (void)wmap, (void)xmap, (void)m, (void)n, (void)k, (void)out, (void)splits, (void)early_w;
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// rows x cols bf16, row-major, in boxes of box_rows x kStepK with the 128-byte swizzle;
// reads past the edges fill zeros.
bool make_tensor_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kStepK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The current device is an sm_90 (the kernel is built for sm_90a only); asked once a device.
bool device_is_sm90() {
  return once_per_device<1>(0, 2, [] {  // 1 yes, 2 no
           int dev = 0, major = 0, minor = 0;
           const bool ok =
               cudaGetDevice(&dev) == cudaSuccess &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
               cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
           if (!ok) (void)cudaGetLastError();
           return ok && major == 9 && minor == 0 ? 1 : 2;
         }) == 1;
}

// The kernel with its shared memory allowed on the current device (more than the 48 KiB a
// kernel gets without asking; once per device and instance), launched with the splits of
// a row block as one cluster, and as a programmatic dependent when pdl.
template <int kN, int kRT, bool kSwap, bool kF32>
cudaError_t launch_instance(unsigned blocks, cudaStream_t stream, bool pdl, const CUtensorMap& wmap,
                            const CUtensorMap& xmap, int m, int n, int k, void* out, int splits,
                            bool early_w) {
  // Once a device; a failure is asked again at the next launch (0: not known yet).
  cudaError_t err = cudaSuccess;
  const int32_t allowed = once_per_device<1>(0, 0, [&] {
    const void* fn = reinterpret_cast<const void*>(skinny_kernel<kN, kRT, kSwap, kF32>);
    err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes(kN, kRT)));
    // The whole of L1 as shared memory whatever the instance needs, as the library's large
    // GEMMs take it: an SM whose split of L1 must change between two kernels idles first
    // (3-4 us seen on an H200 before a library GEMM that followed this kernel and a norm).
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
    }
    return err == cudaSuccess ? 1 : 0;
  });
  if (allowed != 1) return err != cudaSuccess ? err : cudaErrorInvalidDevice;
  cudaLaunchAttribute attr[2] = {};
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes(kN, kRT);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, skinny_kernel<kN, kRT, kSwap, kF32>, wmap, xmap, m, n, k, out, splits,
                            early_w);
}

template <int kN, int kRT, bool kSwap>
cudaError_t launch_config(const bf16_t* x, int m, const bf16_t* w, int n, int k, void* out, bool out_f32,
                          int splits, cudaStream_t stream, bool pdl, bool early_w) {
  constexpr int kBlockRows = kMinBlockRows * kRT;
  CUtensorMap wmap, xmap;
  if (!make_tensor_map(&wmap, w, n, k, kBlockRows) || !make_tensor_map(&xmap, x, m, k, kN)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (int64_t(n) + kBlockRows - 1) / kBlockRows * splits;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return out_f32 ? launch_instance<kN, kRT, kSwap, true>(unsigned(blocks), stream, pdl, wmap, xmap, m, n, k,
                                                         out, splits, early_w)
                 : launch_instance<kN, kRT, kSwap, false>(unsigned(blocks), stream, pdl, wmap, xmap, m, n, k,
                                                          out, splits, early_w);
}

template <int kN>
cudaError_t launch_tokens(const bf16_t* x, int m, const bf16_t* w, int n, int k, void* out, bool out_f32,
                          int variant, cudaStream_t stream, bool pdl, bool early_w) {
  return row_tiles_of(variant) == 1 ? launch_config<kN, 1, false>(x, m, w, n, k, out, out_f32,
                                                                  splits_of(variant), stream, pdl, early_w)
                                    : launch_config<kN, 2, false>(x, m, w, n, k, out, out_f32,
                                                                  splits_of(variant), stream, pdl, early_w);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
#endif  // !KVFUSE_HIP

}  // namespace

int skinny_splits(int variant) { return variant >= 0 && variant < kSkinnyVariants ? splits_of(variant) : 0; }

int skinny_block_rows(int variant) {
  return variant >= 0 && variant < kSkinnyVariants ? kMinBlockRows * row_tiles_of(variant) : 0;
}

std::string skinny_unsupported(const void* x, int64_t m, const void* w, int64_t n, int64_t k, const void* out,
                               int variant) {
#if defined(KVFUSE_HIP)
  (void)x, (void)m, (void)w, (void)n, (void)k, (void)out, (void)variant;
  return "skinny gemm: NVIDIA sm_90 only (wgmma, TMA)";
#else
  if (!device_is_sm90()) return "skinny gemm: NVIDIA sm_90 only (wgmma, TMA), not this device";
  if (tensor_map_encoder() == nullptr) return "skinny gemm: the driver has no cuTensorMapEncodeTiled";
  if (m < 1 || m > kSkinnyMaxRows)
    return "skinny gemm: m " + std::to_string(m) + " outside 1.." + std::to_string(kSkinnyMaxRows);
  if (n < 16 || n % 16 != 0 || n > INT32_MAX || k < kStepK || k % kStepK != 0 || k > INT32_MAX)
    return "skinny gemm: n " + std::to_string(n) + ", k " + std::to_string(k) +
           " (n a positive multiple of 16, k of " + std::to_string(kStepK) + ")";
  if (!aligned16(x) || !aligned16(w) || !aligned16(out))
    return "skinny gemm: x, w and out must be 16-byte aligned";
  if (variant < 0 || variant >= kSkinnyVariants)
    return "skinny gemm: variant " + std::to_string(variant) + " of " + std::to_string(kSkinnyVariants);
  const int64_t splits = splits_of(variant);
  if (k / kStepK < splits)
    return "skinny gemm: k " + std::to_string(k) + " has fewer " + std::to_string(kStepK) +
           "-column steps than " + std::to_string(splits) + " splits";
  return {};
#endif
}

LaunchStatus launch_gemm_skinny_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                     void* out, bool out_f32, cudaStream_t stream, bool pdl, int variant,
                                     bool early_w) {
  if (std::string why = skinny_unsupported(x, m, w, n, k, out, variant); !why.empty()) {
    return LaunchStatus::refused(std::move(why));
  }
#if defined(KVFUSE_HIP)
  (void)out_f32, (void)stream, (void)pdl, (void)early_w;
  return LaunchStatus::refused("skinny gemm: NVIDIA only");
#else
  if (tokens_as_m(variant)) {
    return launch_config<64, 2, true>(x, int(m), w, int(n), int(k), out, out_f32, splits_of(variant), stream,
                                      pdl, early_w);
  }
  switch (tokens_for(m)) {
    case 16:
      return launch_tokens<16>(x, int(m), w, int(n), int(k), out, out_f32, variant, stream, pdl, early_w);
    case 32:
      return launch_tokens<32>(x, int(m), w, int(n), int(k), out, out_f32, variant, stream, pdl, early_w);
    default:
      return launch_tokens<64>(x, int(m), w, int(n), int(k), out, out_f32, variant, stream, pdl, early_w);
  }
#endif
}

}  // namespace kvfuse::gpu
