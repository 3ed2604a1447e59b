// A stand-in for libnccl.so.2 / librccl.so.1 that tests/parallel/test_parallel.cc loads to check
// NcclLibrary's search and symbol binding where no NCCL is installed (CI). It exports the
// entry points kvfuse resolves, with nccl.h's C signatures; ncclGetVersion reports 2.28.9,
// every other call fails with ncclInvalidUsage (5), so nothing can mistake it for a
// working library, and ncclGetLastError gives a warning as NCCL words one (with its
// newline).
#include <cstddef>

extern "C" {

struct ncclComm;
struct ncclUniqueId {
  char internal[128];
};

__attribute__((visibility("default"))) int ncclGetVersion(int* version) {
  if (version == nullptr) return 4;  // ncclInvalidArgument
  *version = 22809;
  return 0;
}
__attribute__((visibility("default"))) const char* ncclGetErrorString(int result) {
  return result == 5 ? "kvfuse fake NCCL: not a real library" : "kvfuse fake NCCL: unexpected result";
}
__attribute__((visibility("default"))) const char* ncclGetLastError(ncclComm*) {
  return "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000 (kvfuse fake NCCL)\n";
}
__attribute__((visibility("default"))) int ncclGetUniqueId(ncclUniqueId*) { return 5; }
__attribute__((visibility("default"))) int ncclCommInitRank(ncclComm**, int, ncclUniqueId, int) { return 5; }
struct ncclConfig;
__attribute__((visibility("default"))) int ncclCommInitRankConfig(ncclComm**, int, ncclUniqueId, int,
                                                                  ncclConfig*) {
  return 5;
}
__attribute__((visibility("default"))) int ncclCommSplit(ncclComm*, int, int, ncclComm**, ncclConfig*) {
  return 5;
}
__attribute__((visibility("default"))) int ncclCommDestroy(ncclComm*) { return 5; }
__attribute__((visibility("default"))) int ncclCommAbort(ncclComm*) { return 5; }
__attribute__((visibility("default"))) int ncclCommGetAsyncError(ncclComm*, int*) { return 5; }
__attribute__((visibility("default"))) int ncclAllReduce(const void*, void*, size_t, int, int, ncclComm*,
                                                         void*) {
  return 5;
}
__attribute__((visibility("default"))) int ncclAllGather(const void*, void*, size_t, int, ncclComm*, void*) {
  return 5;
}
__attribute__((visibility("default"))) int ncclBroadcast(const void*, void*, size_t, int, int, ncclComm*,
                                                         void*) {
  return 5;
}
__attribute__((visibility("default"))) int ncclGroupStart() { return 5; }
__attribute__((visibility("default"))) int ncclGroupEnd() { return 5; }

}  // extern "C"
