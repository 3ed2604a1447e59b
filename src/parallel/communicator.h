// The tensor-parallel communication seam: one Communicator per rank, over buffers in the
// memory of the backend that owns the rank (host memory for the CPU backend, device memory
// for CUDA/HIP). Column-parallel projections need no communication; row-parallel ones
// (attention output, MLP down) end in all_reduce_sum, the vocab-parallel lm_head in
// all_gather, and start-up state (an id, a seed) travels by broadcast.
//
// Ordering: a GPU communicator enqueues every collective on the stream it was built with
// and returns without waiting for it, as a kernel launch does; the buffers must stay valid
// until the stream reaches the collective. So a decode step that all-reduces can be
// captured into a CUDA/HIP graph like any other launch (NCCL supports stream capture),
// and the next kernel on the stream sees the reduced values. barrier() is the exception:
// it waits on the host and must not be called while the stream is being captured.
// The CPU communicator runs each collective to completion before it returns.
//
// Every rank of a group calls the same collectives in the same order with the same
// counts; a rank that fails must abort() its communicator (or the group) so that the
// others get an error instead of waiting forever.
#pragma once

#include <cstddef>
#include <cstdint>

#include <string>

#include "absl/status/status.h"
#include "kernels/parallel/tp_push.h"

namespace kvfuse {

// Element types of the reductions: activations are bf16, partial logits or norms f32.
enum class DType { bf16, f32 };

const char* to_string(DType t);
size_t dtype_size(DType t);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "cpu", "nccl" or "rccl": for messages and benchmark banners.
  virtual const char* name() const = 0;

  // buf[i] = sum over ranks of buf[i], in place, `count` elements. bf16 is summed in fp32
  // and rounded once (the CPU communicator in rank order, so bit for bit reproducible).
  virtual absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) = 0;
  // recv[r * count_per_rank + i] = send of rank r [i]. recv holds size() * count_per_rank
  // elements; send may be recv + rank() * count_per_rank (in place).
  virtual absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) = 0;
  // The `bytes` of rank `root`'s buf into every rank's buf.
  virtual absl::Status broadcast(void* buf, int64_t bytes, int root) = 0;
  // Returns once every rank has called it and everything enqueued before on this rank's
  // stream has completed. Host-side: never inside a graph capture.
  virtual absl::Status barrier() = 0;
  // Ends this rank's participation: collectives in flight or waiting on other ranks return
  // an error (or are cancelled on the device), and so do later calls. Idempotent.
  virtual void abort() = 0;
  // OK, or an error a collective recorded on the device after its call had returned (a
  // peer that failed or never arrived): a step whose collectives ran from a graph checks it
  // after the step. Cheap, any thread.
  virtual absl::Status async_error() const { return absl::OkStatus(); }

  // Optional, GPU communicators over peer memory only: the all-reduce of a row-parallel
  // projection's output fused into the residual add + RMSNorm after it, the projection
  // pushing its partial sums into the peers (src/parallel/peer_allreduce.h, "Pushed partial
  // sums"). push_fits: whether this communicator serves a pushed call of rows x cols bf16
  // (the same answer on every rank; false by default, and the caller then all-reduces and
  // norms as usual). push_targets(call): where the projection of the forward pass's pushed
  // call number `call` (0, 1, ... in the order every rank makes them) also stores its
  // [rows, cols] bf16 result (kernels/parallel/tp_push.h). push_add_rmsnorm(call, ...): after that
  // projection wrote `partial` on this rank, x = bf16(x + all-reduced partials) and out =
  // rmsnorm(x) * w, the bits of all_reduce_sum then the backend's add_rmsnorm; enqueued
  // like a collective.
  virtual bool push_fits(int64_t /*rows*/, int64_t /*cols*/) const { return false; }
  virtual PushTargets push_targets(int /*call*/) const { return {}; }
  virtual absl::Status push_add_rmsnorm(int /*call*/, const void* /*partial*/, void* /*x*/, const void* /*w*/,
                                        int64_t /*rows*/, int64_t /*cols*/, float /*eps*/, void* /*out*/) {
    return absl::UnimplementedError(std::string(name()) + ": no pushed all-reduce");
  }
};

// INVALID_ARGUMENT naming the collective when a call's own arguments are wrong: a null
// buffer with count > 0, a negative count, or a root outside [0, size).
absl::Status check_collective_args(const char* op, const void* buf, int64_t count, const Communicator& c);
absl::Status check_root(const char* op, int root, const Communicator& c);

}  // namespace kvfuse
