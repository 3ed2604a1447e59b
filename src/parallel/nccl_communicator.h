// Communicator over NCCL (CUDA) or RCCL (HIP), loaded at run time (src/parallel/nccl_api.h).
// One rank per GPU; in one process each rank's thread makes its own communicator with
// ncclCommInitRank and a unique id shared in memory (across processes: src/parallel/
// rendezvous.h). Collectives are enqueued on the stream given at construction and return
// at once, so they can be captured into a CUDA/HIP graph with the kernels around them.
// Built only with a GPU backend (KVFUSE_GPU=CUDA or HIP); no CUDA types in this header.
#pragma once

#include <atomic>
#include <memory>

#include "absl/status/statusor.h"
#include "src/parallel/communicator.h"
#include "src/parallel/nccl_api.h"

namespace kvfuse {

class NcclCommunicator final : public Communicator {
 public:
  // A new unique id (ncclGetUniqueId), made by rank 0 and handed to every rank.
  static absl::StatusOr<nccl::ncclUniqueId> unique_id(const nccl::NcclLibrary& lib);
  // Rank `rank` of `size` on GPU `device` (made current on the calling thread), ordered on
  // `stream` (a cudaStream_t or hipStream_t of that device; null: the legacy default
  // stream). Waits until all `size` ranks have called it with the same id, within what
  // `watch` allows (NcclLibrary::init_rank: a deadline, a check on the other ranks).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> create(const nccl::NcclLibrary& lib,
                                                                  const nccl::ncclUniqueId& id, int rank, int size,
                                                                  int device, void* stream,
                                                                  const nccl::InitWatch& watch = {});
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return lib_.flavour(); }
  int device() const { return device_; }
  void* stream() const { return stream_; }

  absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) override;
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override;
  absl::Status broadcast(void* buf, int64_t bytes, int root) override;
  // A one-element all-reduce, then a wait for the stream. Refused during a capture.
  absl::Status barrier() override;
  // ncclCommAbort: cancels what is in flight; later calls return FAILED_PRECONDITION.
  void abort() override;
  // OK, or the asynchronous error NCCL recorded (a peer that failed, a network error).
  absl::Status async_error() const override;

 private:
  NcclCommunicator(const nccl::NcclLibrary& lib, int rank, int size, int device, void* stream)
      : lib_(lib), rank_(rank), size_(size), device_(device), stream_(stream) {}
  absl::Status usable(const char* op, DType dtype) const;

  const nccl::NcclLibrary& lib_;
  const int rank_, size_, device_;
  void* const stream_;
  nccl::RankComms comms_;  // comms_.comm runs the collectives
  std::atomic<bool> aborted_{false};
  float* barrier_buf_ = nullptr;  // one float on the device
};

}  // namespace kvfuse
