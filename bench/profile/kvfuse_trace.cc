// A kernel tracer for profiling kvfuse's decode step where Nsight Systems is not installed:
// a CUDA injection library (CUDA_INJECTION64_PATH=libkvfuse_trace.so) that records every
// kernel's start and end on the device, every copy, and every CUDA runtime call on the
// host, through CUPTI's activity API (one clock for all three), and writes one CSV line
// per record (what: K kernel, C copy, R runtime call; start ns, end ns, correlation id,
// name) to $KVFUSE_TRACE_OUT (default kvfuse_trace.csv) as buffers fill and at exit.
// Kernels replayed from one graph launch share that launch's correlation id.
// scripts/gpu/profile.sh builds it on the GPU machine (the records' versions are the
// newest in that toolkit's header: KVFUSE_KERNEL_RECORD, KVFUSE_MEMCPY_RECORD) and
// reduces the CSV with scripts/gpu/profile-table.py.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

#ifndef KVFUSE_KERNEL_RECORD
#error "define KVFUSE_KERNEL_RECORD as the toolkit's newest CUpti_ActivityKernelN"
#endif
#ifndef KVFUSE_MEMCPY_RECORD
#error "define KVFUSE_MEMCPY_RECORD as the toolkit's newest CUpti_ActivityMemcpyN"
#endif

namespace {

FILE* g_out = nullptr;
unsigned long long g_dropped = 0;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (!g_out) continue;
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const KVFUSE_KERNEL_RECORD*>(record);
      std::fprintf(g_out, "K,%llu,%llu,%u,%dx%dx%d,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                   k->correlationId, int(k->gridX), int(k->gridY), int(k->gridZ), k->name ? k->name : "?");
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* c = reinterpret_cast<const KVFUSE_MEMCPY_RECORD*>(record);
      std::fprintf(g_out, "C,%llu,%llu,%u,copy kind %u %llu bytes\n", (unsigned long long)c->start,
                   (unsigned long long)c->end, c->correlationId, unsigned(c->copyKind), (unsigned long long)c->bytes);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = nullptr;
      if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name) != CUPTI_SUCCESS) name = nullptr;
      std::fprintf(g_out, "R,%llu,%llu,%u,%s\n", (unsigned long long)a->start, (unsigned long long)a->end,
                   a->correlationId, name ? name : "?");
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) g_dropped += dropped;
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  if (g_out) {
    std::fclose(g_out);
    g_out = nullptr;
  }
  if (g_dropped) std::fprintf(stderr, "kvfuse_trace: %llu records dropped\n", g_dropped);
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("KVFUSE_TRACE_OUT");
  g_out = std::fopen(path ? path : "kvfuse_trace.csv", "w");
  if (!g_out) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kvfuse_trace: CUPTI activity tracing could not be enabled\n");
    return 0;
  }
  std::atexit(finish);
  return 1;
}
