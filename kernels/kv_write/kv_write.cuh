// KV write on the GPU (CUDA and HIP from one source): new K/V rows into the paged cache.
// Bytes equal the CPU reference (kernels/cpu/kv_write/kv_write.h) for every input; see
// kernels/kv_write/kv_write.cu for the numerics and the thread mapping.
//
// All launchers are asynchronous on `stream` and safe to capture in a CUDA/HIP graph:
// scales are read by the kernels through device pointers, nothing waits on the host,
// and the grid is sized from args.num_tokens (the slot mapping's length), so graph
// batch padding with negative slots is skipped by the kernel, not by the host.
// They refuse arguments the kernels do not support with cudaErrorInvalidValue
// (hipErrorInvalidValue) and kv_write_unsupported's message, else return the launch
// status.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/common/dispatch.h"
#include "kernels/common/gpu.h"
#include "kernels/common/kernel_select.h"
#include "kernels/common/kv_types.h"
#include "kernels/common/kv_write_scratch.h"

namespace kvfuse::gpu {

// Empty if the GPU KV write supports `args`, else a message naming the whole tuple
// (head_dim, heads, page size, cache dtype, source dtype) and what is wrong; head dims
// and formats are kernels/common/dispatch.h's. The launchers' argument check.
std::string kv_write_unsupported(const KvWriteArgs& args);

// Launch options. The defaults are what the engine uses; the benchmark varies them.
// Two warps (NVIDIA) or one wavefront (CDNA) per block. H200 sweep, graph replay
// (bench/journal/results/kv_write_h200.txt): T = 256: 1.75 / 1.73 / 1.72 / 1.90 / 2.44 / 3.39 us
// for 32 / 64 / 128 / 256 / 512 / 1024 threads (small blocks spread the rows over more
// SMs); T = 65536: 4.16 TB/s for 32 and 64, 4.14 for 128..512.
constexpr int kKvWriteBlockThreads = 64;
// The largest block the write kernels are compiled for, and the largest T written with a
// block per row: kernels/common/kernel_select.h, where the launcher's choice of thread
// mapping is made (select::kv_write_team).
using ::kvfuse::kKvWriteBlockTeamMaxTokens;
using ::kvfuse::kKvWriteMaxBlockThreads;
struct KvWriteLaunch {
  // Threads per block of the fused write with a warp per row (a multiple of the warp
  // size, at most kKvWriteMaxBlockThreads); each warp writes one token row. Block-per-row
  // launches size their blocks from the row instead.
  int block_threads = kKvWriteBlockThreads;
  // Programmatic dependent launch (CUDA sm_90+, ignored on HIP): the kernels may be
  // scheduled while the previous kernel in the stream runs, and wait for it in-kernel
  // before their first memory access. Hides launch latency between graph nodes.
  bool pdl = false;
  // The largest T written with a block per row (kKvWriteBlockTeamMaxTokens); 0: a warp
  // per row at every T (the benchmark's A/B).
  int block_team_max_tokens = kKvWriteBlockTeamMaxTokens;
};

// One kernel writes K and V: FP8 caches get x * (1/scale) converted with saturation;
// bf16 caches get launch_kv_store_bf16's copy. The fused path of docs/design.md#fused-write.
LaunchStatus launch_kv_write_fused(const KvWriteArgs& args, cudaStream_t stream,
                                   const KvWriteLaunch& launch = {});

// The bf16-cache store (no scaling): a bf16 source is copied bit for bit, an f16 source
// rounded to bf16. One kernel for K and V.
LaunchStatus launch_kv_store_bf16(const KvWriteArgs& args, cudaStream_t stream,
                                  const KvWriteLaunch& launch = {});

// The unfused path, five launches as today's serving systems run it: scale K into fp32
// scratch, scale V, cast K to the cache dtype, cast V, scatter both. `scratch` is device
// memory of kv_write_scratch_bytes(args.num_tokens, args.cache.row_elems()) bytes, laid
// out as kernels/common/kv_write_scratch.h says (as the CPU reference's). launch.block_threads
// does not apply (the elementwise kernels use 256).
LaunchStatus launch_kv_write_unfused(const KvWriteArgs& args, void* scratch, cudaStream_t stream,
                                     const KvWriteLaunch& launch = {});
using kvfuse::kv_write_scratch_bytes;

// Which FP8 conversion the fused kernel runs on the current device for `dtype`
// (e.g. "cvt.rn.satfinite (packed)"), for logs. Synchronous; not for the hot path.
std::string kv_write_conversion_name(KvFormat dtype);

}  // namespace kvfuse::gpu
