#include "src/parallel/nccl_communicator.h"

#include "absl/strings/str_cat.h"
#include "kernels/common/gpu.h"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"

namespace kvfuse {

namespace {

nccl::ncclDataType_t nccl_type(DType t) { return t == DType::bf16 ? nccl::ncclBfloat16 : nccl::ncclFloat32; }

}  // namespace

absl::StatusOr<nccl::ncclUniqueId> NcclCommunicator::unique_id(const nccl::NcclLibrary& lib) {
  nccl::ncclUniqueId id{};
  KVFUSE_RETURN_IF_ERROR(lib.check(lib.get_unique_id(&id), "ncclGetUniqueId"));
  return id;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const nccl::NcclLibrary& lib,
                                                                          const nccl::ncclUniqueId& id, int rank,
                                                                          int size, int device, void* stream,
                                                                          const nccl::InitWatch& watch) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(lib.flavour(), " communicator: rank ", rank, " of ", size, " is not a rank of the group"));
  }
  int devices = 0;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaGetDeviceCount(&devices), "cudaGetDeviceCount"));
  if (device < 0 || device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(lib.flavour(), " communicator rank ", rank, ": device ", device,
                                                   " is outside the ", devices, " visible GPU(s)"));
  }
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaSetDevice(device), "cudaSetDevice"));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(lib, rank, size, device, stream));
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaMalloc(&c->barrier_buf_, sizeof(float)), "cudaMalloc"));
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaMemset(c->barrier_buf_, 0, sizeof(float)), "cudaMemset"));
  auto comms = lib.init_rank(id, rank, size, watch);
  if (!comms.ok()) {
    return absl::Status(comms.status().code(), absl::StrCat(comms.status().message(), " (device ", device, ", ",
                                                            lib.path, " ", lib.version_string(), ")"));
  }
  c->comms_ = *comms;
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  // The device of this rank, whichever thread destroys it.
  (void)cudaSetDevice(device_);
  lib_.release(comms_, aborted_.load());
  if (barrier_buf_ != nullptr) (void)cudaFree(barrier_buf_);
}

absl::Status NcclCommunicator::usable(const char* op, DType dtype) const {
  if (aborted_.load()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), " ", op, " on rank ", rank_, ": the communicator was aborted"));
  }
  if (dtype == DType::bf16 && lib_.version < 21000) {
    return absl::UnimplementedError(absl::StrCat(name(), " ", op, ": bf16 needs NCCL >= 2.10; ", lib_.path, " is ",
                                                 lib_.version_string()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::all_reduce_sum(void* buf, int64_t count, DType dtype) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_reduce_sum", buf, count, *this));
  KVFUSE_RETURN_IF_ERROR(usable("all_reduce_sum", dtype));
  return lib_.check(lib_.all_reduce(buf, buf, size_t(count), nccl_type(dtype), nccl::ncclSum, comms_.comm, stream_),
                    "ncclAllReduce");
}

absl::Status NcclCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", send, count_per_rank, *this));
  KVFUSE_RETURN_IF_ERROR(check_collective_args("all_gather", recv, count_per_rank, *this));
  KVFUSE_RETURN_IF_ERROR(usable("all_gather", dtype));
  return lib_.check(lib_.all_gather(send, recv, size_t(count_per_rank), nccl_type(dtype), comms_.comm, stream_),
                    "ncclAllGather");
}

absl::Status NcclCommunicator::broadcast(void* buf, int64_t bytes, int root) {
  KVFUSE_RETURN_IF_ERROR(check_collective_args("broadcast", buf, bytes, *this));
  KVFUSE_RETURN_IF_ERROR(check_root("broadcast", root, *this));
  KVFUSE_RETURN_IF_ERROR(usable("broadcast", DType::f32));
  // As bytes: ncclInt8 is 0.
  return lib_.check(lib_.broadcast(buf, buf, size_t(bytes), nccl::ncclDataType_t(0), root, comms_.comm, stream_),
                    "ncclBroadcast");
}

absl::Status NcclCommunicator::barrier() {
  KVFUSE_RETURN_IF_ERROR(usable("barrier", DType::f32));
  const auto stream = static_cast<cudaStream_t>(stream_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), " barrier on rank ", rank_, ": the stream is being captured into a graph"));
  }
  KVFUSE_RETURN_IF_ERROR(
      lib_.check(lib_.all_reduce(barrier_buf_, barrier_buf_, 1, nccl::ncclFloat32, nccl::ncclSum, comms_.comm, stream_),
                 "ncclAllReduce (barrier)"));
  KVFUSE_RETURN_IF_ERROR(gpu_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize (barrier)"));
  return async_error();
}

void NcclCommunicator::abort() {
  if (aborted_.exchange(true)) return;
  if (comms_.comm != nullptr) (void)lib_.comm_abort(comms_.comm);
}

absl::Status NcclCommunicator::async_error() const {
  if (comms_.comm == nullptr || aborted_.load()) return absl::OkStatus();
  nccl::ncclResult_t r = nccl::ncclSuccess;
  KVFUSE_RETURN_IF_ERROR(lib_.check(lib_.comm_get_async_error(comms_.comm, &r), "ncclCommGetAsyncError"));
  return lib_.check(r, "an earlier collective (ncclCommGetAsyncError)");
}

}  // namespace kvfuse
