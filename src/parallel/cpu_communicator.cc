#include "src/parallel/cpu_communicator.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/common/bf16.h"

namespace kvfuse {

namespace {

const char* op_name(int op) {
  static const char* const names[] = {"all_reduce_sum", "all_gather", "broadcast", "barrier"};
  return names[op];
}

// Elements [begin, end) of the rank-ordered sums. The reference below is this same loop.
void sum_f32(const std::vector<const float*>& in, int64_t begin, int64_t end, float* out) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = in[0][i];  // not 0 + x: keeps -0 when every input is -0
    for (size_t r = 1; r < in.size(); ++r) acc += in[r][i];
    out[i] = acc;
  }
}

void sum_bf16(const std::vector<const uint16_t*>& in, int64_t begin, int64_t end, uint16_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = bf16_to_f32(in[0][i]);
    for (size_t r = 1; r < in.size(); ++r) acc += bf16_to_f32(in[r][i]);
    out[i] = f32_to_bf16(acc);
  }
}

}  // namespace

void reference_sum_bf16(const std::vector<const uint16_t*>& inputs, int64_t count, uint16_t* out) {
  sum_bf16(inputs, 0, count, out);
}

void reference_sum_f32(const std::vector<const float*>& inputs, int64_t count, float* out) {
  sum_f32(inputs, 0, count, out);
}

// --- CpuCommGroup ---------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<CpuCommGroup>> CpuCommGroup::create(int size, std::chrono::milliseconds timeout) {
  if (size < 1) return absl::InvalidArgumentError(absl::StrCat("cpu comm group: size ", size, " must be >= 1"));
  if (timeout.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu comm group: timeout ", timeout.count(), " ms is negative"));
  }
  return std::shared_ptr<CpuCommGroup>(new CpuCommGroup(size, timeout));
}

CpuCommGroup::CpuCommGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), arrived_(size_t(size), false), posts_(size_t(size)) {}

void CpuCommGroup::abort(absl::Status reason) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_locked(std::move(reason));
}

void CpuCommGroup::abort_locked(absl::Status reason) {
  if (!poison_.ok()) return;
  poison_ = reason.ok() ? absl::AbortedError("cpu comm group aborted") : std::move(reason);
  cv_.notify_all();
}

absl::Status CpuCommGroup::poisoned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return poison_;
}

template <class F>
absl::Status CpuCommGroup::arrive_locked(std::unique_lock<std::mutex>& lock, int rank, const char* what,
                                         F&& on_last) {
  if (!poison_.ok()) return poison_;
  arrived_[size_t(rank)] = true;
  if (++arrived_count_ == size_) {
    on_last();
    arrived_count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    ++generation_;
    cv_.notify_all();
    return absl::OkStatus();
  }
  const uint64_t gen = generation_;
  auto done = [&] { return generation_ != gen || !poison_.ok(); };
  if (timeout_.count() == 0) {
    cv_.wait(lock, done);
  } else if (!cv_.wait_for(lock, timeout_, done)) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!arrived_[size_t(r)]) missing.push_back(r);
    }
    abort_locked(absl::DeadlineExceededError(absl::StrCat("cpu comm group: rank ", rank, " waited ", timeout_.count(),
                                                          " ms in ", what, " for rank(s) ",
                                                          absl::StrJoin(missing, ", "), " of ", size_)));
  }
  // A poison that came after this barrier completed is for the next collective.
  if (generation_ != gen) return absl::OkStatus();
  return poison_;
}

absl::Status CpuCommGroup::check_posts_locked() const {
  const Post& p0 = posts_[0];
  bool agree = true;
  for (const Post& p : posts_) {
    agree = agree && p.op == p0.op;
    if (!agree) break;
    switch (p.op) {
      case Op::all_reduce_sum:
      case Op::all_gather:
        agree = p.count == p0.count && p.dtype == p0.dtype;
        break;
      case Op::broadcast:
        agree = p.count == p0.count && p.root == p0.root;
        break;
      case Op::barrier:
        break;
    }
  }
  if (agree) return absl::OkStatus();
  std::vector<std::string> calls;
  for (size_t r = 0; r < posts_.size(); ++r) {
    const Post& p = posts_[r];
    std::string args;
    if (p.op == Op::all_reduce_sum || p.op == Op::all_gather) {
      args = absl::StrCat("count ", p.count, ", ", to_string(p.dtype));
    } else if (p.op == Op::broadcast) {
      args = absl::StrCat(p.count, " bytes, root ", p.root);
    }
    calls.push_back(absl::StrCat("rank ", r, " ", op_name(int(p.op)), "(", args, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cpu comm group: ranks disagree on the collective: ", absl::StrJoin(calls, "; ")));
}

absl::StatusOr<std::vector<CpuCommGroup::Post>> CpuCommGroup::post_and_wait(int rank, const Post& post) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!poison_.ok()) return poison_;
  posts_[size_t(rank)] = post;
  const absl::Status st = arrive_locked(lock, rank, op_name(int(post.op)), [&] {
    const absl::Status check = check_posts_locked();
    if (!check.ok()) {
      abort_locked(check);
      return;
    }
    if (post.op == Op::all_reduce_sum) scratch_.resize(size_t(post.count) * dtype_size(post.dtype));
  });
  if (!st.ok()) return st;
  // The last rank may have poisoned the group in this very barrier (a disagreement):
  // every rank then returns that error.
  if (!poison_.ok()) return poison_;
  return posts_;
}

absl::Status CpuCommGroup::wait_all(int rank, const char* what) {
  std::unique_lock<std::mutex> lock(mu_);
  return arrive_locked(lock, rank, what, [] {});
}

// --- CpuCommunicator ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<CpuCommunicator>> CpuCommunicator::create(std::shared_ptr<CpuCommGroup> group,
                                                                          int rank) {
  if (group == nullptr) return absl::InvalidArgumentError("cpu communicator: null group");
  if (rank < 0 || rank >= group->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu communicator: rank ", rank, " is outside [0, ", group->size(), ")"));
  }
  return std::unique_ptr<CpuCommunicator>(new CpuCommunicator(std::move(group), rank));
}

absl::Status CpuCommunicator::fail(absl::Status st) {
  group_->abort(absl::Status(st.code(), absl::StrCat(st.message(), " (the group is aborted)")));
  return st;
}

void CpuCommunicator::abort() {
  group_->abort(absl::AbortedError(absl::StrCat("cpu comm group aborted by rank ", rank_)));
}

absl::Status CpuCommunicator::all_reduce_sum(void* buf, int64_t count, DType dtype) {
  if (auto st = check_collective_args("all_reduce_sum", buf, count, *this); !st.ok()) return fail(st);
  auto posts = group_->post_and_wait(
      rank_, {.op = CpuCommGroup::Op::all_reduce_sum, .send = buf, .recv = buf, .count = count, .dtype = dtype});
  if (!posts.ok()) return posts.status();

  // This rank's slice of the elements, reduced into the scratch.
  const int n = size();
  const int64_t begin = count * rank_ / n, end = count * (rank_ + 1) / n;
  uint8_t* scratch = group_->scratch_.data();
  if (dtype == DType::f32) {
    std::vector<const float*> in;
    for (const auto& p : *posts) in.push_back(static_cast<const float*>(p.send));
    sum_f32(in, begin, end, reinterpret_cast<float*>(scratch));
  } else {
    std::vector<const uint16_t*> in;
    for (const auto& p : *posts) in.push_back(static_cast<const uint16_t*>(p.send));
    sum_bf16(in, begin, end, reinterpret_cast<uint16_t*>(scratch));
  }
  // Every slice is in the scratch, and no rank reads a caller's buffer any more.
  if (auto st = group_->wait_all(rank_, "all_reduce_sum"); !st.ok()) return st;
  // The scratch stays as it is until every rank has arrived at the next collective.
  if (count > 0) std::memcpy(buf, scratch, size_t(count) * dtype_size(dtype));
  return absl::OkStatus();
}

absl::Status CpuCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) {
  if (auto st = check_collective_args("all_gather", send, count_per_rank, *this); !st.ok()) return fail(st);
  if (auto st = check_collective_args("all_gather", recv, count_per_rank, *this); !st.ok()) return fail(st);
  auto posts = group_->post_and_wait(
      rank_, {.op = CpuCommGroup::Op::all_gather, .send = send, .recv = recv, .count = count_per_rank, .dtype = dtype});
  if (!posts.ok()) return posts.status();
  const size_t bytes = size_t(count_per_rank) * dtype_size(dtype);
  for (int r = 0; r < size(); ++r) {
    uint8_t* dst = static_cast<uint8_t*>(recv) + size_t(r) * bytes;
    const void* src = (*posts)[size_t(r)].send;
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);  // memmove: own send may overlap
  }
  // The senders may reuse their buffers once every rank has copied them.
  return group_->wait_all(rank_, "all_gather");
}

absl::Status CpuCommunicator::broadcast(void* buf, int64_t bytes, int root) {
  if (auto st = check_collective_args("broadcast", buf, bytes, *this); !st.ok()) return fail(st);
  if (auto st = check_root("broadcast", root, *this); !st.ok()) return fail(st);
  auto posts = group_->post_and_wait(
      rank_, {.op = CpuCommGroup::Op::broadcast, .send = buf, .recv = buf, .count = bytes, .root = root});
  if (!posts.ok()) return posts.status();
  const void* src = (*posts)[size_t(root)].send;
  if (rank_ != root && bytes > 0) std::memcpy(buf, src, size_t(bytes));
  return group_->wait_all(rank_, "broadcast");
}

absl::Status CpuCommunicator::barrier() {
  auto posts = group_->post_and_wait(rank_, {.op = CpuCommGroup::Op::barrier});
  return posts.ok() ? absl::OkStatus() : posts.status();
}

}  // namespace kvfuse
