#include "src/parallel/nccl_api.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "src/loading/env_switches.h"
#include "src/parallel/socket_io.h"

namespace kvfuse::nccl {

const char* default_nccl_library() {
#if defined(KVFUSE_HIP)
  return "librccl.so.1";
#else
  return "libnccl.so.2";
#endif
}

std::vector<std::string> library_candidates(const char* env_library, const char* rocm_path, bool rccl) {
  if (env_library != nullptr && *env_library != '\0') return {std::string(env_library)};
  const std::string soname = rccl ? "librccl.so.1" : "libnccl.so.2";
  std::vector<std::string> names = {soname};
  if (!rccl) return names;
  auto add = [&](std::string dir) {
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    std::string path = dir + "/lib/" + soname;
    if (std::find(names.begin(), names.end(), path) == names.end()) names.push_back(std::move(path));
  };
  if (rocm_path != nullptr && *rocm_path != '\0') add(rocm_path);
  add("/opt/rocm");
  return names;
}

std::vector<std::string> NcclLibrary::candidates() {
#if defined(KVFUSE_HIP)
  constexpr bool kRccl = true;
#else
  constexpr bool kRccl = false;
#endif
  const std::optional<std::string> library = env_value("KVFUSE_NCCL_LIBRARY");
  return library_candidates(library ? library->c_str() : nullptr, std::getenv("ROCM_PATH"), kRccl);
}

absl::StatusOr<const NcclLibrary*> NcclLibrary::load() { return load_first(candidates()); }

namespace {

std::string how_to_fix() {
  return absl::StrCat(
      "install NCCL (CUDA) or RCCL (HIP; found in ROCm's lib folder too: ROCM_PATH), or set "
      "KVFUSE_NCCL_LIBRARY to the library's path (default ",
      default_nccl_library(), ")");
}

template <class Fn>
absl::Status resolve(void* handle, const std::string& path, const char* symbol, bool required, Fn& out) {
  dlerror();
  void* p = dlsym(handle, symbol);
  if (p == nullptr) {
    if (!required) return absl::OkStatus();
    const char* err = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("NCCL library '", path, "' lacks ", symbol, ": ",
                                                      err != nullptr ? err : "symbol not found"));
  }
  out = reinterpret_cast<Fn>(p);
  return absl::OkStatus();
}

// `name` loaded, or FAILED_PRECONDITION saying why; load_first() adds how_to_fix().
absl::StatusOr<std::unique_ptr<NcclLibrary>> open_library(const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("NCCL library: empty library name");
  dlerror();
  // RTLD_LOCAL: our declarations must not interpose on anything else's.
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL library '", name, "' cannot be loaded: ", err != nullptr ? err : "unknown dlopen error"));
  }
  auto lib = std::make_unique<NcclLibrary>();
  lib->path = name;
  absl::Status st = absl::OkStatus();
  auto need = [&](const char* symbol, auto& fn) {
    if (st.ok()) st = resolve(handle, name, symbol, /*required=*/true, fn);
  };
  need("ncclGetVersion", lib->get_version);
  need("ncclGetUniqueId", lib->get_unique_id);
  need("ncclCommInitRank", lib->comm_init_rank);
  need("ncclCommDestroy", lib->comm_destroy);
  need("ncclCommAbort", lib->comm_abort);
  need("ncclCommGetAsyncError", lib->comm_get_async_error);
  need("ncclGetErrorString", lib->get_error_string);
  need("ncclAllReduce", lib->all_reduce);
  need("ncclAllGather", lib->all_gather);
  need("ncclBroadcast", lib->broadcast);
  need("ncclGroupStart", lib->group_start);
  need("ncclGroupEnd", lib->group_end);
  if (st.ok()) st = resolve(handle, name, "ncclCommInitAll", /*required=*/false, lib->comm_init_all);
  if (st.ok()) st = resolve(handle, name, "ncclGetLastError", /*required=*/false, lib->get_last_error);
  if (st.ok()) {
    st = resolve(handle, name, "ncclCommInitRankConfig", /*required=*/false, lib->comm_init_rank_config);
  }
  if (st.ok()) st = resolve(handle, name, "ncclCommSplit", /*required=*/false, lib->comm_split);
  if (st.ok()) st = lib->check(lib->get_version(&lib->version), "ncclGetVersion");
  if (!st.ok()) {
    dlclose(handle);
    return st;
  }
  // The handle stays open for the life of the process.
  return lib;
}

// A name loaded once, kept for the process; a failure is not kept.
absl::StatusOr<const NcclLibrary*> load_cached(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<NcclLibrary>>* loaded =
      new std::map<std::string, std::unique_ptr<NcclLibrary>>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded->find(name); it != loaded->end()) return it->second.get();
  auto lib = open_library(name);
  if (!lib.ok()) return lib.status();
  const NcclLibrary* p = lib->get();
  (*loaded)[name] = std::move(*lib);
  return p;
}

}  // namespace

absl::StatusOr<const NcclLibrary*> NcclLibrary::load_first(const std::vector<std::string>& names) {
  if (names.empty()) return absl::InvalidArgumentError("NCCL library: no library names to try");
  std::vector<std::string> why;
  for (const std::string& name : names) {
    auto lib = load_cached(name);
    if (lib.ok()) return lib;
    why.emplace_back(lib.status().message());
  }
  return absl::FailedPreconditionError(absl::StrCat(absl::StrJoin(why, "; "), "; ", how_to_fix()));
}

absl::StatusOr<const NcclLibrary*> NcclLibrary::load(const std::string& name) { return load_first({name}); }

const char* NcclLibrary::flavour() const { return absl::StrContains(path, "rccl") ? "rccl" : "nccl"; }

std::string NcclLibrary::description() const {
  return absl::StrCat(flavour(), " ", version_string(), " (", path, ")");
}

std::string NcclLibrary::version_string() const {
  // NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z since 2.9; X*1000 + Y*100 + Z before.
  if (version >= 10000) return absl::StrCat(version / 10000, ".", (version / 100) % 100, ".", version % 100);
  return absl::StrCat(version / 1000, ".", (version / 100) % 10, ".", version % 100);
}

absl::Status NcclLibrary::check(ncclResult_t r, const char* call) const {
  if (r == ncclSuccess) return absl::OkStatus();
  const char* text = get_error_string != nullptr ? get_error_string(r) : "no error text";
  std::string msg = absl::StrCat(flavour(), " error in ", call, ": ", int(r), " (", text, ")");
  if (get_last_error != nullptr) {
    const char* last = get_last_error(nullptr);
    std::string warning =
        last != nullptr ? net::printable(std::string(absl::StripAsciiWhitespace(last)), 1024) : "";
    if (!warning.empty()) absl::StrAppend(&msg, "; ", flavour(), "'s last warning: ", warning);
  }
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(msg);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

namespace {

// `st` with the rank and the group's size after its message.
absl::Status in_group(const absl::Status& st, int rank, int size) {
  return absl::Status(st.code(), absl::StrCat(st.message(), " (rank ", rank, " of ", size, ")"));
}

// Polls `comm`'s set-up (the call `call` started) until it is done, the watch's deadline
// passes or its peers check fails.
absl::Status wait_ready(const NcclLibrary& lib, ncclComm_t comm, const char* call, int rank, int size,
                        const InitWatch& watch) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  auto pause = std::chrono::microseconds(200);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    absl::Status st = lib.check(lib.comm_get_async_error(comm, &state), "ncclCommGetAsyncError");
    if (st.ok() && state == ncclSuccess) return absl::OkStatus();
    if (st.ok() && state != ncclInProgress) st = lib.check(state, call);
    if (!st.ok()) return in_group(st, rank, size);
    if (watch.peers) {
      if (absl::Status p = watch.peers(); !p.ok()) {
        return absl::Status(p.code(), absl::StrCat(lib.flavour(), " set-up (", call, ") of rank ", rank,
                                                   " of ", size, " stopped: ", p.message()));
      }
    }
    const Clock::time_point now = Clock::now();
    if (now >= watch.deadline) {
      const double waited = std::chrono::duration<double>(now - start).count();
      return absl::DeadlineExceededError(absl::StrFormat(
          "%s set-up (%s) of rank %d of %d did not finish in %.0f s: a rank of the group never joined "
          "(it failed before, or its process is not running; its own log says why), or the network "
          "between them is blocked",
          lib.flavour(), call, rank, size, waited));
    }
    std::this_thread::sleep_for(
        std::min(pause, std::chrono::duration_cast<std::chrono::microseconds>(watch.deadline - now)));
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

}  // namespace

absl::StatusOr<RankComms> NcclLibrary::init_rank(const ncclUniqueId& id, int rank, int size,
                                                 const InitWatch& watch) const {
  RankComms out;
  if (!bounded_init()) {
    const absl::Status st = check(comm_init_rank(&out.comm, size, id, rank), "ncclCommInitRank");
    if (!st.ok()) return in_group(st, rank, size);
    return out;
  }
  ncclConfig config;
  config.blocking = 0;
  ncclResult_t r = comm_init_rank_config(&out.parent, size, id, rank, &config);
  auto failed = [&](const absl::Status& st) {
    if (out.parent != nullptr) (void)comm_abort(out.parent);  // stops the set-up under way too
    out.parent = nullptr;
    return st;
  };
  if (r != ncclSuccess && r != ncclInProgress) {
    return failed(in_group(check(r, "ncclCommInitRankConfig"), rank, size));
  }
  if (out.parent == nullptr) {
    return in_group(
        absl::InternalError(absl::StrCat(flavour(), " ncclCommInitRankConfig returned no communicator")),
        rank, size);
  }
  if (absl::Status st = wait_ready(*this, out.parent, "ncclCommInitRankConfig", rank, size, watch);
      !st.ok()) {
    return failed(st);
  }
  ncclConfig blocking;
  blocking.blocking = 1;
  r = comm_split(out.parent, /*color=*/0, /*key=*/rank, &out.comm, &blocking);
  if (r != ncclSuccess && r != ncclInProgress) return failed(in_group(check(r, "ncclCommSplit"), rank, size));
  if (absl::Status st = wait_ready(*this, out.parent, "ncclCommSplit", rank, size, watch); !st.ok()) {
    // Aborting the parent stops the split under way and waits for NCCL's thread, which
    // writes the child; a child it finished goes too.
    const absl::Status why = failed(st);
    if (out.comm != nullptr) (void)comm_abort(out.comm);
    out.comm = nullptr;
    return why;
  }
  if (out.comm == nullptr) {
    return failed(in_group(
        absl::InternalError(absl::StrCat(flavour(), " ncclCommSplit finished without a communicator")), rank,
        size));
  }
  return out;
}

void NcclLibrary::release(RankComms& comms, bool comm_aborted) const {
  if (comms.comm != nullptr && !comm_aborted) (void)comm_destroy(comms.comm);
  comms.comm = nullptr;
  if (comms.parent != nullptr) (void)comm_abort(comms.parent);
  comms.parent = nullptr;
}

}  // namespace kvfuse::nccl
