// Tensor parallelism on the CPU backend: N ranks are N threads of one process, sharing a
// CpuCommGroup (the posted buffers, a barrier, a scratch buffer). Every collective is two
// barrier phases: all ranks post their buffers and the last to arrive checks that they
// agree (same collective, count, dtype, root); each rank then reads the others' buffers,
// and a second barrier keeps every buffer untouched until all ranks have read it.
//
// all_reduce_sum is deterministic and the same on every rank: element i is
// ((x_0 + x_1) + x_2) + ... in fp32, ranks in order, and bf16 inputs are widened exactly
// and rounded once at the end (kernels/common/bf16.h, round to nearest even). Rank r computes
// the elements of its slice into the group's scratch and every rank copies the whole
// result, so the bits do not depend on which rank computed them.
//
// A failing rank must not leave the others waiting: a rank whose own arguments are
// invalid, a disagreement between ranks, a rank's abort(), the group's abort() and (when
// set) the wait timeout all poison the group; ranks waiting return that error at once and
// every later collective returns it too.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "src/parallel/communicator.h"

namespace kvfuse {

class CpuCommGroup {
 public:
  // `size` ranks. A rank that waits longer than `timeout` for the others poisons the group
  // with DEADLINE_EXCEEDED naming the ranks that did not arrive; zero waits forever.
  static absl::StatusOr<std::shared_ptr<CpuCommGroup>> create(
      int size, std::chrono::milliseconds timeout = std::chrono::milliseconds::zero());

  int size() const { return size_; }
  // Poisons the group with `reason` (ABORTED when it is OK): every waiting and later
  // collective returns it. The first reason stays.
  void abort(absl::Status reason);
  // OK, or the reason the group was poisoned.
  absl::Status poisoned() const;

 private:
  friend class CpuCommunicator;
  enum class Op { all_reduce_sum, all_gather, broadcast, barrier };
  struct Post {
    Op op = Op::barrier;
    const void* send = nullptr;
    void* recv = nullptr;
    int64_t count = 0;  // elements (bytes for broadcast)
    DType dtype = DType::f32;
    int root = 0;
  };

  CpuCommGroup(int size, std::chrono::milliseconds timeout);
  // Posts rank's operation and waits for every rank (phase 1). The last to arrive checks
  // that the posts agree and sizes the scratch. Returns the posts of all ranks.
  absl::StatusOr<std::vector<Post>> post_and_wait(int rank, const Post& post);
  // Phase 2: waits until every rank is done reading the others' buffers.
  absl::Status wait_all(int rank, const char* what);
  // Under mu_: waits for all ranks to arrive at this barrier; the last runs on_last.
  template <class F>
  absl::Status arrive_locked(std::unique_lock<std::mutex>& lock, int rank, const char* what, F&& on_last);
  absl::Status check_posts_locked() const;
  void abort_locked(absl::Status reason);

  const int size_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_count_ = 0;
  std::vector<bool> arrived_;  // [size] in the current generation
  std::vector<Post> posts_;    // [size]
  absl::Status poison_;
  // The all-reduce result: f32 or bf16 elements, each rank fills its slice.
  std::vector<uint8_t> scratch_;
};

class CpuCommunicator final : public Communicator {
 public:
  // Rank `rank` of `group`; each rank's thread makes its own.
  static absl::StatusOr<std::unique_ptr<CpuCommunicator>> create(std::shared_ptr<CpuCommGroup> group, int rank);

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const char* name() const override { return "cpu"; }
  absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) override;
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override;
  absl::Status broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status barrier() override;
  // Poisons the whole group: the other ranks' waits return ABORTED naming this rank.
  void abort() override;

 private:
  CpuCommunicator(std::shared_ptr<CpuCommGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  // A rank whose own arguments are wrong will not take part: poison the group too.
  absl::Status fail(absl::Status st);

  std::shared_ptr<CpuCommGroup> group_;
  int rank_;
};

// The reference the CPU all-reduce is defined by, for tests: out[i] = rank-ordered fp32
// sum of inputs[r][i], rounded once to bf16.
void reference_sum_bf16(const std::vector<const uint16_t*>& inputs, int64_t count, uint16_t* out);
void reference_sum_f32(const std::vector<const float*>& inputs, int64_t count, float* out);

}  // namespace kvfuse
