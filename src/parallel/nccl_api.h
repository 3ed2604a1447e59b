// NCCL (NVIDIA) and RCCL (AMD, the same API) loaded at run time with dlopen: kvfuse builds
// without their headers or libraries (Debian packages neither), and a server that does not
// use tensor parallelism never needs them. These are our own declarations of the few types
// and entry points we call, with the values and signatures of nccl.h (NCCL 2.x; RCCL
// keeps them): ncclUniqueId is 128 opaque bytes, ncclComm_t an opaque pointer, and a
// stream is passed as void* (cudaStream_t and hipStream_t are both pointers).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvfuse::nccl {

constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};
static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes);

struct ncclComm;
using ncclComm_t = ncclComm*;

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

enum ncclDataType_t : int {
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclBfloat16 = 9,  // NCCL >= 2.10
};

enum ncclRedOp_t : int { ncclSum = 0 };

// ncclConfig_t as NCCL 2.14 declared it: the prefix every later version keeps. NCCL reads
// `size` bytes and gives every field past them its default, so this is valid for 2.14 on.
struct ncclConfig {
  size_t size = sizeof(ncclConfig);
  unsigned int magic = 0xcafebeef;  // NCCL_API_MAGIC
  unsigned int version = 21400;     // NCCL_VERSION(2, 14, 0)
  int blocking = 1;
};

// Entry points, as nccl.h declares them (stream as void*).
using GetVersionFn = ncclResult_t (*)(int* version);
using GetUniqueIdFn = ncclResult_t (*)(ncclUniqueId* id);
using CommInitRankFn = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
using CommInitRankConfigFn = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                               ncclConfig* config);  // NCCL >= 2.14
using CommSplitFn = ncclResult_t (*)(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                     ncclConfig* config);  // NCCL >= 2.18
using CommInitAllFn = ncclResult_t (*)(ncclComm_t* comms, int ndev, const int* devlist);
using CommDestroyFn = ncclResult_t (*)(ncclComm_t comm);
using CommAbortFn = ncclResult_t (*)(ncclComm_t comm);
using CommGetAsyncErrorFn = ncclResult_t (*)(ncclComm_t comm, ncclResult_t* async_error);
using GetErrorStringFn = const char* (*)(ncclResult_t result);
using GetLastErrorFn = const char* (*)(ncclComm_t comm);  // NCCL >= 2.13; comm unused (null)
using AllReduceFn = ncclResult_t (*)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                                     ncclRedOp_t op, ncclComm_t comm, void* stream);
using AllGatherFn = ncclResult_t (*)(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                                     ncclComm_t comm, void* stream);
using BroadcastFn = ncclResult_t (*)(const void* send, void* recv, size_t count, ncclDataType_t dtype, int root,
                                     ncclComm_t comm, void* stream);
using GroupStartFn = ncclResult_t (*)();
using GroupEndFn = ncclResult_t (*)();

// What bounds a rank's wait in NCCL's set-up (NcclLibrary::init_rank).
struct InitWatch {
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // Asked every few milliseconds while the set-up runs: not OK when a rank of the group is
  // known to have failed (its thread's error, its process's closed connection). The wait
  // stops with that status. Null: no such check.
  std::function<absl::Status()> peers;
};

// A rank's communicator from init_rank(): `comm` for the collectives (blocking, as
// ncclCommInitRank makes them), and `parent`, the non-blocking communicator it was split
// from (null when the library cannot bound the set-up), to be aborted after `comm` is gone.
struct RankComms {
  ncclComm_t comm = nullptr;
  ncclComm_t parent = nullptr;
};

// The library's entry points. Loaded once per library name and never unloaded (NCCL keeps
// threads and device state for the life of the process).
struct NcclLibrary {
  std::string path;  // as passed to dlopen
  int version = 0;   // ncclGetVersion: 21903 for 2.19.3
  GetVersionFn get_version = nullptr;
  GetUniqueIdFn get_unique_id = nullptr;
  CommInitRankFn comm_init_rank = nullptr;
  CommInitAllFn comm_init_all = nullptr;  // optional: null when the library lacks it
  CommInitRankConfigFn comm_init_rank_config = nullptr;  // optional (NCCL >= 2.14)
  CommSplitFn comm_split = nullptr;                      // optional (NCCL >= 2.18)
  CommDestroyFn comm_destroy = nullptr;
  CommAbortFn comm_abort = nullptr;
  CommGetAsyncErrorFn comm_get_async_error = nullptr;
  GetErrorStringFn get_error_string = nullptr;
  GetLastErrorFn get_last_error = nullptr;  // optional: older libraries lack it
  AllReduceFn all_reduce = nullptr;
  AllGatherFn all_gather = nullptr;
  BroadcastFn broadcast = nullptr;
  GroupStartFn group_start = nullptr;
  GroupEndFn group_end = nullptr;

  // The first of candidates() that loads. FAILED_PRECONDITION when none does, naming each
  // name tried with dlerror() (or the symbol it lacks) and how to fix it. A success is
  // kept for the process; a failure is tried again next time.
  static absl::StatusOr<const NcclLibrary*> load();
  // The same for an explicit name or path.
  static absl::StatusOr<const NcclLibrary*> load(const std::string& name);
  // The first of `names` that loads, tried in order (load(name) each); the error as load()'s.
  static absl::StatusOr<const NcclLibrary*> load_first(const std::vector<std::string>& names);
  // What load() tries: library_candidates() with this process's KVFUSE_NCCL_LIBRARY and
  // ROCM_PATH, RCCL's names in HIP builds.
  static std::vector<std::string> candidates();

  // Whether init_rank() can bound its wait: ncclCommInitRankConfig and ncclCommSplit
  // present (NCCL and RCCL 2.18 on).
  bool bounded_init() const { return comm_init_rank_config != nullptr && comm_split != nullptr; }
  // Rank `rank` of `size` joins the group of `id` on the calling thread's current device.
  // ncclCommInitRank blocks until every rank has joined, for ever when one never does (a
  // rank that failed before it, a process that died). With bounded_init() the set-up runs
  // non-blocking instead (ncclCommInitRankConfig, blocking = 0), polled with
  // ncclCommGetAsyncError until it is done, `watch.deadline` passes (DEADLINE_EXCEEDED)
  // or `watch.peers` reports a failed rank (its status); both of those abort it
  // (ncclCommAbort). The finished communicator is then split into a blocking one
  // (ncclCommSplit, blocking = 1, watched alike): a non-blocking communicator would start
  // each collective on a thread of NCCL's, outside the stream capture of a CUDA graph.
  // Without bounded_init(), ncclCommInitRank and no bound. Errors name the call, the rank
  // and the group's size.
  absl::StatusOr<RankComms> init_rank(const ncclUniqueId& id, int rank, int size, const InitWatch& watch) const;
  // Frees what init_rank() made: ncclCommDestroy of comm unless `comm_aborted` (an
  // ncclCommAbort of it already freed it), then ncclCommAbort of the parent (it never ran a
  // collective; ncclCommDestroy of a non-blocking communicator may return before it is done).
  void release(RankComms& comms, bool comm_aborted) const;

  // "nccl" or "rccl", from the library name, for messages.
  const char* flavour() const;
  // "2.19.3" from version.
  std::string version_string() const;
  // What was loaded, for logs: "nccl 2.19.3 (libnccl.so.2)".
  std::string description() const;
  // OK, or an error naming the call, the result code and NCCL's text for it, then the
  // library's last warning (ncclGetLastError) where it has one: the generic text of a code
  // ("invalid usage") says less than the warning that came with it ("Duplicate GPU
  // detected : rank 1 and rank 0 both on CUDA device 1b000"). The warning is the library's
  // last one in this process, so with several ranks in one process it may be another
  // rank's; it is cut to 1 KiB and made printable.
  absl::Status check(ncclResult_t r, const char* call) const;
};

// The build's default library: "libnccl.so.2" or "librccl.so.1".
const char* default_nccl_library();

// The names to dlopen, in order: `env_library` alone when it is set and not empty (the
// KVFUSE_NCCL_LIBRARY variable); else the soname, libnccl.so.2 or, for `rccl`, librccl.so.1,
// found as the loader finds any library; then, for RCCL only, the same file in ROCm's own
// folders, which the loader's path often lacks (ROCm installs under /opt/rocm and leaves
// ldconfig to the user): $ROCM_PATH/lib when `rocm_path` is set, then /opt/rocm/lib.
std::vector<std::string> library_candidates(const char* env_library, const char* rocm_path, bool rccl);

}  // namespace kvfuse::nccl
