#include "src/parallel/peer_allreduce.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/gpu.h"

#include "absl/strings/str_cat.h"
#include "kernels/parallel/peer_allreduce.cuh"
#include "kernels/parallel/tp_push.cuh"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {

namespace {

constexpr int kThreads = PeerAllReduceGroup::kBlockThreads;
constexpr int64_t kVecBytes = kPeerVecBytes;

}  // namespace

// --- PeerAllReduceGroup -----------------------------------------------------------------

bool PeerAllReduceGroup::fits(int64_t count, DType dtype) const {
  return count >= 0 && count <= options_.staging_bytes / int64_t(dtype_size(dtype));
}

int PeerAllReduceGroup::blocks_for(int64_t bytes) {
  const int64_t blocks = (bytes + kPeerPassBytes - 1) / kPeerPassBytes;
  return int(std::clamp<int64_t>(blocks, 1, kMaxBlocks));
}

namespace {

// Blocks of the all-reduce kernel (the smaller of its two instances) that `device` holds at once:
// per multiprocessor, from the runtime's occupancy calculator (registers and threads of
// the build at hand), times the multiprocessors. The current device is left as it was.
absl::StatusOr<int64_t> resident_blocks(int device) {
  int current = 0;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDevice(&current), "cudaGetDevice"));
  int per_sm = 0;
  cudaDeviceProp prop{};
  const absl::Status st = [&] {
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaSetDevice(device), "cudaSetDevice"));
    // Loads the pushed norm's kernel too, so that it is loaded with the others (see allocate()).
    KVFUSE_RETURN_IF_ERROR(
        gpu_status(gpu::load_peer_all_reduce(&per_sm), "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    return gpu_status(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  }();
  (void)cudaSetDevice(current);
  if (!st.ok()) return st;
  return int64_t(per_sm) * prop.multiProcessorCount;
}

}  // namespace

absl::Status PeerAllReduceGroup::check(const std::vector<int>& devices, bool share_devices) {
  const int n = int(devices.size());
  if (n < 2 || n > kMaxRanks) {
    return absl::FailedPreconditionError(
        absl::StrCat("peer all-reduce: serves 2 to ", kMaxRanks, " ranks in one process, not ", n));
  }
  int visible = 0;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDeviceCount(&visible), "cudaGetDeviceCount"));
  for (int i = 0; i < n; ++i) {
    if (devices[size_t(i)] < 0 || devices[size_t(i)] >= visible) {
      return absl::FailedPreconditionError(absl::StrCat("peer all-reduce: GPU ", devices[size_t(i)], " of rank ", i,
                                                        " is outside the ", visible, " visible GPU(s)"));
    }
    for (int j = 0; j < i && !share_devices; ++j) {
      if (devices[size_t(i)] == devices[size_t(j)]) {
        return absl::FailedPreconditionError(
            absl::StrCat("peer all-reduce: ranks ", j, " and ", i, " are both on GPU ", devices[size_t(i)]));
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      // Ranks that share a GPU read each other's buffers as local memory: no peer access.
      if (devices[size_t(i)] == devices[size_t(j)]) continue;
      int can = 0;
      KVFUSE_RETURN_IF_ERROR(gpu_status(cudaDeviceCanAccessPeer(&can, devices[size_t(i)], devices[size_t(j)]),
                                        "cudaDeviceCanAccessPeer"));
      if (!can) {
        return absl::FailedPreconditionError(absl::StrCat("peer all-reduce: GPU ", devices[size_t(i)],
                                                          " cannot access the memory of GPU ", devices[size_t(j)],
                                                          " (no peer access between them)"));
      }
    }
  }
  // The blocks of a call spin until the same block of every peer has arrived, so on a GPU
  // of several ranks all of their blocks must be resident at once: a rank whose blocks
  // fill the GPU would otherwise wait for a peer that cannot start. The largest grid
  // (kMaxBlocks) of every rank on the GPU, whatever the calls' sizes. A GPU of one rank
  // needs no such bound: its blocks wait for other GPUs, which go on regardless.
  for (int i = 0; i < n && share_devices; ++i) {
    const int d = devices[size_t(i)];
    if (std::find(devices.begin(), devices.begin() + i, d) != devices.begin() + i) continue;  // counted already
    const int64_t ranks_here = std::count(devices.begin(), devices.end(), d);
    if (ranks_here < 2) continue;
    auto resident = resident_blocks(d);
    KVFUSE_RETURN_IF_ERROR(resident.status());
    if (*resident < ranks_here * kMaxBlocks) {
      return absl::FailedPreconditionError(absl::StrCat(
          "peer all-reduce: the ", ranks_here, " ranks sharing GPU ", d, " need ", ranks_here, " x ", kMaxBlocks,
          " = ", ranks_here * kMaxBlocks, " blocks of ", kThreads, " threads resident at once, and it holds ",
          *resident, " (its ranks' kernels could wait for each other until the timeout)"));
    }
  }
  return absl::OkStatus();
}

PeerAllReduceGroup::PeerAllReduceGroup(std::vector<int> devices, PeerAllReduceOptions options) : options_(options) {
  for (int d : devices) ranks_.push_back(Rank{d});
}

absl::StatusOr<std::shared_ptr<PeerAllReduceGroup>> PeerAllReduceGroup::create(const std::vector<int>& devices,
                                                                             PeerAllReduceOptions options) {
  KVFUSE_RETURN_IF_ERROR(check(devices, options.share_devices));
  if (options.staging_bytes < kVecBytes || options.staging_bytes > (int64_t(1) << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer all-reduce: staging_bytes ", options.staging_bytes, " is outside [16, 1 GiB]"));
  }
  if (!(options.timeout_s > 0.0 && options.timeout_s <= 3600.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer all-reduce: timeout_s ", options.timeout_s, " is outside (0, 3600]"));
  }
  options.staging_bytes = (options.staging_bytes + kVecBytes - 1) / kVecBytes * kVecBytes;
  std::shared_ptr<PeerAllReduceGroup> g(new PeerAllReduceGroup(devices, options));
  int current = 0;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDevice(&current), "cudaGetDevice"));
  const absl::Status st = g->allocate();
  (void)cudaSetDevice(current);
  if (!st.ok()) return st;
  return g;
}

absl::Status PeerAllReduceGroup::allocate() {
  void* host = nullptr;
  KVFUSE_RETURN_IF_ERROR(
      gpu_status(gpu::host_alloc_mapped(&host, sizeof(PeerHostSignals)), "host_alloc_mapped"));
  host_ = static_cast<PeerHostSignals*>(host);
  std::memset(host_, 0, sizeof(PeerHostSignals));
  pdl_ = options_.pdl && gpu::kWarpSize == 32;  // programmatic launch: CUDA sm_90+ only
  for (Rank& r : ranks_) {
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaSetDevice(r.device), "cudaSetDevice"));
    if (pdl_) {
      cudaDeviceProp prop{};
      KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDeviceProperties(&prop, r.device), "cudaGetDeviceProperties"));
      if (prop.major < 9) pdl_ = false;
    }
    // Both kernels referenced on this GPU now, so that the runtime loads them here rather
    // than at their first launch: with lazy loading (CUDA's default) loading a kernel may
    // wait for the kernels running on its GPU, and a rank's call can be running there,
    // waiting for a peer's launch.
    KVFUSE_RETURN_IF_ERROR(resident_blocks(r.device).status());  // queries the kernels' attributes
    KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::load_push_copy(), "load_push_copy"));
    for (const Rank& peer : ranks_) {
      if (peer.device == r.device) continue;  // itself, or a rank sharing its GPU (share_devices)
      const cudaError_t err = cudaDeviceEnablePeerAccess(peer.device, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // NCCL, or an earlier group, enabled it: fine
      } else {
        KVFUSE_RETURN_IF_ERROR(gpu_status(err, "cudaDeviceEnablePeerAccess"));
      }
    }
    KVFUSE_RETURN_IF_ERROR(
        gpu_status(cudaMalloc(&r.staging, size_t(2 * options_.staging_bytes)), "cudaMalloc"));
    void* flags = nullptr;
    const size_t flag_bytes = size_t(kMaxBlocks) * kMaxRanks * sizeof(uint64_t);
    KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::malloc_signals(&flags, flag_bytes), "malloc_signals"));
    r.flags = static_cast<uint64_t*>(flags);
    void* calls = nullptr;
    KVFUSE_RETURN_IF_ERROR(
        gpu_status(cudaMalloc(&calls, size_t(kMaxBlocks) * sizeof(uint64_t)), "cudaMalloc"));
    r.calls = static_cast<uint64_t*>(calls);
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaMemset(r.flags, 0, flag_bytes), "cudaMemset"));
    KVFUSE_RETURN_IF_ERROR(
        gpu_status(cudaMemset(r.calls, 0, size_t(kMaxBlocks) * sizeof(uint64_t)), "cudaMemset"));
    if (options_.push) {
      // Inboxes: polled while peers store into them, so signal memory; every element empty.
      void* inbox = nullptr;
      const size_t inbox_bytes = size_t(kPushSlots) * ranks_.size() * size_t(options_.staging_bytes);
      KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::malloc_signals(&inbox, inbox_bytes), "malloc_signals"));
      r.inbox = static_cast<uint16_t*>(inbox);
      static_assert(kPushEmpty == 0xffffu, "the inboxes are filled bytewise");
      KVFUSE_RETURN_IF_ERROR(gpu_status(cudaMemset(r.inbox, 0xff, inbox_bytes), "cudaMemset"));
    }
    // The rank's stream may be non-blocking (not ordered after the memsets): wait here.
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
    int64_t hz = 0;
    KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::wall_clock_hz(r.device, &hz), "wall_clock_hz"));
    if (hz <= 0) return absl::InternalError(absl::StrCat("peer all-reduce: GPU ", r.device, " reports no wall clock"));
    // The same timeout for every rank; the slowest clock rate sets the tick count.
    timeout_ticks_ = std::max<int64_t>(timeout_ticks_, int64_t(options_.timeout_s * double(hz)));
  }
  return absl::OkStatus();
}

PeerAllReduceGroup::~PeerAllReduceGroup() {
  int current = 0;
  const bool restore = cudaGetDevice(&current) == cudaSuccess;
  for (Rank& r : ranks_) {
    if (r.staging == nullptr && r.flags == nullptr && r.calls == nullptr && r.inbox == nullptr) continue;
    (void)cudaSetDevice(r.device);
    for (void* p :
         {r.staging, static_cast<void*>(r.flags), static_cast<void*>(r.calls), static_cast<void*>(r.inbox)}) {
      if (p != nullptr) (void)cudaFree(p);
    }
  }
  if (host_ != nullptr) (void)cudaFreeHost(host_);
  if (restore) (void)cudaSetDevice(current);
}

void PeerAllReduceGroup::abort() {
  if (host_ == nullptr) return;
  volatile uint64_t* word = &host_->abort;
  if (*word == 0) *word = 1;
}

absl::Status PeerAllReduceGroup::status() const {
  const volatile PeerHostSignals* h = host_;
  const uint64_t abort = h->abort;
  if (abort == 0) return absl::OkStatus();
  for (int r = 0; r < size(); ++r) {
    const volatile PeerHostSignals::Timeout& t = h->timeouts[r];
    if (t.timed_out != 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "peer all-reduce: rank ", r, " (GPU ", device(r), ") waited more than ", options_.timeout_s,
          " s for rank ", t.peer, " at its call ", t.call, "; the group is stopped, restart the engine"));
    }
  }
  return absl::AbortedError("peer all-reduce: the group was aborted");
}

absl::StatusOr<uint64_t> PeerAllReduceGroup::calls_completed(int rank) const {
  if (rank < 0 || rank >= size()) return absl::InvalidArgumentError(absl::StrCat("no rank ", rank));
  int current = 0;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDevice(&current), "cudaGetDevice"));
  uint64_t calls = 0;
  const absl::Status st = [&] {
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaSetDevice(device(rank)), "cudaSetDevice"));
    KVFUSE_RETURN_IF_ERROR(gpu_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
    return gpu_status(cudaMemcpy(&calls, ranks_[size_t(rank)].calls, sizeof calls, cudaMemcpyDeviceToHost),
                      "cudaMemcpy");
  }();
  (void)cudaSetDevice(current);
  if (!st.ok()) return st;
  return calls;
}

absl::Status PeerAllReduceGroup::all_reduce_sum(int rank, void* buf, int64_t count, DType dtype, void* stream) {
  if (rank < 0 || rank >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("peer all-reduce: rank ", rank, " of ", size()));
  }
  if (count < 0 || (count > 0 && buf == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer all-reduce on rank ", rank, ": count ", count, " with buffer ", buf ? "set" : "null"));
  }
  if (!fits(count, dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("peer all-reduce on rank ", rank, ": ", count, " ",
                                                   to_string(dtype), " elements exceed the staging buffers' ",
                                                   options_.staging_bytes, " bytes"));
  }
  KVFUSE_RETURN_IF_ERROR(status());
  if (count == 0) return absl::OkStatus();
  const int64_t elem = int64_t(dtype_size(dtype));
  const int64_t per_vec = kVecBytes / elem;
  const int64_t blocks_max = blocks_for(count * elem);
  // Whole 16-byte vectors per block; the launcher's grid is count / chunk, rounded up.
  const int64_t chunk = ((count + blocks_max - 1) / blocks_max + per_vec - 1) / per_vec * per_vec;

  PeerAllReduceArgs a{};
  a.buf = buf;
  a.count = count;
  a.chunk = chunk;
  for (int q = 0; q < size(); ++q) {
    const Rank& r = ranks_[size_t(q)];
    a.staging[q][0] = r.staging;
    a.staging[q][1] = static_cast<const char*>(r.staging) + options_.staging_bytes;
    a.flags[q] = r.flags;
  }
  a.calls = ranks_[size_t(rank)].calls;
  a.host = host_;
  a.timeout_ticks = uint64_t(timeout_ticks_);
  a.rank = rank;
  a.ranks = size();
  a.vectors = gpu::is_aligned(buf, kVecBytes);
  return gpu_status(
      gpu::launch_peer_all_reduce(a, dtype != DType::bf16, static_cast<cudaStream_t>(stream), pdl_),
      "peer all-reduce launch");
}

bool PeerAllReduceGroup::push_fits(int64_t rows, int64_t cols) const {
  return options_.push && rows >= 1 && cols >= 8 && cols % 8 == 0 && cols <= gpu::kPushNormMaxCols &&
         rows <= options_.staging_bytes / 2 / cols;
}

uint16_t* PeerAllReduceGroup::inbox(int owner, int call, int source) const {
  const int slot = call == 0 ? 0 : 1 + (call - 1) % 2;
  const int64_t per_source = options_.staging_bytes / 2;  // elements
  return ranks_[size_t(owner)].inbox + (int64_t(slot) * size() + source) * per_source;
}

PushTargets PeerAllReduceGroup::push_targets(int rank, int call) const {
  PushTargets t;
  if (!options_.push || rank < 0 || rank >= size() || call < 0) return t;
  for (int p = 0; p < size(); ++p) {
    if (p != rank) t.dst[t.count++] = inbox(p, call, rank);
  }
  return t;
}

absl::Status PeerAllReduceGroup::push_add_rmsnorm(int rank, int call, const void* partial, void* x,
                                                  const void* w, int64_t rows, int64_t cols, float eps,
                                                  void* out, void* stream) {
  if (rank < 0 || rank >= size() || call < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pushed all-reduce: rank ", rank, " of ", size(), ", call ", call));
  }
  if (!push_fits(rows, cols)) {
    return absl::InvalidArgumentError(absl::StrCat("pushed all-reduce on rank ", rank, ": ", rows, " x ",
                                                   cols, " bf16 (needs cols a multiple of 8 up to ",
                                                   gpu::kPushNormMaxCols, " and the rows within ",
                                                   options_.staging_bytes, " bytes)"));
  }
  for (const void* p : {partial, const_cast<const void*>(x), w, const_cast<const void*>(out)}) {
    if (p == nullptr || !gpu::is_aligned(p, kVecBytes)) {
      return absl::InvalidArgumentError(absl::StrCat("pushed all-reduce on rank ", rank,
                                                     ": partial, x, w and out must be 16-byte aligned"));
    }
  }
  KVFUSE_RETURN_IF_ERROR(status());
  PeerPushNormArgs a{};
  a.partial = static_cast<const uint16_t*>(partial);
  a.x = static_cast<uint16_t*>(x);
  a.w = static_cast<const uint16_t*>(w);
  a.out = static_cast<uint16_t*>(out);
  for (int q = 0; q < size(); ++q) a.inbox[q] = inbox(rank, call, q);
  a.rows = rows;
  a.cols = cols;
  a.eps = eps;
  a.host = host_;
  a.timeout_ticks = uint64_t(timeout_ticks_);
  a.rank = rank;
  a.ranks = size();
  a.call = call;
  // Ranks sharing a GPU (tests): the next kernel's blocks, launched early, could hold the
  // SMs a peer's projection needs before it pushes. On GPUs of their own they cannot.
  a.early_dependents = !options_.share_devices;
  return gpu_status(gpu::launch_push_add_rmsnorm(a, static_cast<cudaStream_t>(stream), pdl_),
                    "pushed all-reduce norm launch");
}

// Both off at "0", "off" or "false" (src/loading/env_switches.h: FlagOff::zero_off_false).
bool peer_allreduce_pdl_by_env() {
  static const bool pdl = env_flag("KVFUSE_PEER_PDL", FlagOff::zero_off_false) &&
                          env_flag("KVFUSE_PDL_OPS", FlagOff::zero_off_false);
  return pdl;
}

bool peer_allreduce_disabled_by_env() {
  static const bool disabled = !env_flag("KVFUSE_PEER_ALLREDUCE", FlagOff::zero_off_false);
  return disabled;
}

// --- PeerAllReduceCommunicator ------------------------------------------------------------

PeerAllReduceCommunicator::PeerAllReduceCommunicator(std::shared_ptr<PeerAllReduceGroup> group, int rank,
                                                     void* stream, std::unique_ptr<Communicator> fallback)
    : group_(std::move(group)),
      rank_(rank),
      stream_(stream),
      fallback_(std::move(fallback)),
      name_(absl::StrCat("peer+", fallback_->name())) {}

absl::StatusOr<std::unique_ptr<PeerAllReduceCommunicator>> PeerAllReduceCommunicator::create(
    std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream, std::unique_ptr<Communicator> fallback) {
  if (group == nullptr || fallback == nullptr) {
    return absl::InvalidArgumentError("peer all-reduce communicator: needs a group and a fallback communicator");
  }
  if (fallback->size() != group->size() || fallback->rank() != rank || rank < 0 || rank >= group->size()) {
    return absl::InvalidArgumentError(absl::StrCat("peer all-reduce communicator: rank ", rank, " of a group of ",
                                                   group->size(), " over ", fallback->name(), " rank ",
                                                   fallback->rank(), " of ", fallback->size()));
  }
  return std::unique_ptr<PeerAllReduceCommunicator>(
      new PeerAllReduceCommunicator(std::move(group), rank, stream, std::move(fallback)));
}

absl::Status PeerAllReduceCommunicator::all_reduce_sum(void* buf, int64_t count, DType dtype) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_reduce_sum", buf, count, *this));
  if (aborted_.load()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), " all_reduce_sum on rank ", rank_, ": the communicator was aborted"));
  }
  // The same choice on every rank: it depends on the count and the group only.
  if (group_->fits(count, dtype)) return group_->all_reduce_sum(rank_, buf, count, dtype, stream_);
  return fallback_->all_reduce_sum(buf, count, dtype);
}

absl::Status PeerAllReduceCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank,
                                                   DType dtype) {
  return fallback_->all_gather(send, recv, count_per_rank, dtype);
}

absl::Status PeerAllReduceCommunicator::broadcast(void* buf, int64_t bytes, int root) {
  return fallback_->broadcast(buf, bytes, root);
}

absl::Status PeerAllReduceCommunicator::barrier() {
  // The fallback's barrier waits for the stream, peer all-reduces included.
  KVFUSE_RETURN_IF_ERROR(fallback_->barrier());
  return group_->status();
}

bool PeerAllReduceCommunicator::push_fits(int64_t rows, int64_t cols) const {
  return group_->push_fits(rows, cols);
}

PushTargets PeerAllReduceCommunicator::push_targets(int call) const {
  return group_->push_targets(rank_, call);
}

absl::Status PeerAllReduceCommunicator::push_add_rmsnorm(int call, const void* partial, void* x,
                                                         const void* w, int64_t rows, int64_t cols, float eps,
                                                         void* out) {
  if (aborted_.load()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), " push_add_rmsnorm on rank ", rank_, ": the communicator was aborted"));
  }
  return group_->push_add_rmsnorm(rank_, call, partial, x, w, rows, cols, eps, out, stream_);
}

void PeerAllReduceCommunicator::abort() {
  if (aborted_.exchange(true)) return;
  group_->abort();
  fallback_->abort();
}

absl::Status PeerAllReduceCommunicator::async_error() const {
  KVFUSE_RETURN_IF_ERROR(group_->status());
  return fallback_->async_error();
}

// --- SharedGpuCommunicator ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SharedGpuCommunicator>> SharedGpuCommunicator::create(
    std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream, std::unique_ptr<Communicator> host) {
  if (group == nullptr || host == nullptr || rank < 0 || rank >= group->size() ||
      host->size() != group->size() || host->rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("shared-GPU communicator: rank ", rank,
                                                   " needs a group and a host communicator of that rank"));
  }
  return std::unique_ptr<SharedGpuCommunicator>(
      new SharedGpuCommunicator(std::move(group), rank, stream, std::move(host)));
}

absl::Status SharedGpuCommunicator::reduce_pieces(void* buf, int64_t count, DType dtype) {
  // Pieces of whole 16-byte vectors, so that every piece after the first keeps buf's alignment.
  const int64_t elem = int64_t(dtype_size(dtype));
  const int64_t piece = group_->staging_bytes() / kVecBytes * kVecBytes / elem;
  for (int64_t at = 0; at < count; at += piece) {
    KVFUSE_RETURN_IF_ERROR(group_->all_reduce_sum(rank_, static_cast<char*>(buf) + at * elem,
                                                  std::min(piece, count - at), dtype, stream_));
  }
  return absl::OkStatus();
}

absl::Status SharedGpuCommunicator::all_reduce_sum(void* buf, int64_t count, DType dtype) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_reduce_sum", buf, count, *this));
  KVFUSE_RETURN_IF_ERROR(host_->barrier());
  return reduce_pieces(buf, count, dtype);
}

absl::Status SharedGpuCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank,
                                               DType dtype) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", send, count_per_rank, *this));
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", recv, count_per_rank, *this));
  const size_t bytes = size_t(count_per_rank) * dtype_size(dtype);
  const auto s = static_cast<cudaStream_t>(stream_);
  char* out = static_cast<char*>(recv);
  for (int r = 0; r < size(); ++r) {
    char* slice = out + size_t(r) * bytes;
    if (r != rank_) {
      KVFUSE_RETURN_IF_ERROR(gpu_status(cudaMemsetAsync(slice, 0, bytes, s), "cudaMemsetAsync"));
    } else if (slice != send) {
      KVFUSE_RETURN_IF_ERROR(
          gpu_status(cudaMemcpyAsync(slice, send, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync"));
    }
  }
  // The copies above are issued before the host wait, like everything else before a collective.
  KVFUSE_RETURN_IF_ERROR(host_->barrier());
  return reduce_pieces(recv, count_per_rank * size(), dtype);
}

absl::Status SharedGpuCommunicator::broadcast(void*, int64_t, int) {
  return absl::UnimplementedError("shared-gpu: no broadcast between ranks sharing a GPU");
}

absl::Status SharedGpuCommunicator::barrier() {
  KVFUSE_RETURN_IF_ERROR(
      gpu_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize"));
  KVFUSE_RETURN_IF_ERROR(host_->barrier());
  return group_->status();
}

absl::Status SharedGpuCommunicator::push_add_rmsnorm(int call, const void* partial, void* x, const void* w,
                                                     int64_t rows, int64_t cols, float eps, void* out) {
  KVFUSE_RETURN_IF_ERROR(host_->barrier());
  return group_->push_add_rmsnorm(rank_, call, partial, x, w, rows, cols, eps, out, stream_);
}

void SharedGpuCommunicator::abort() {
  group_->abort();
  host_->abort();
}

}  // namespace kvfuse
