#include "server/kv_events.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

namespace {

void to_proto(const KvEvent& e, v1::KvEvent* out) {
  switch (e.kind) {
    case KvEvent::Kind::block_stored: {
      v1::BlockStored* s = out->mutable_block_stored();
      for (uint64_t h : e.block_hashes) s->add_block_hashes(h);
      if (e.parent_block_hash) s->set_parent_block_hash(*e.parent_block_hash);
      for (int32_t t : e.token_ids) s->add_token_ids(t);
      s->set_block_size(uint32_t(e.block_size));
      return;
    }
    case KvEvent::Kind::block_removed: {
      v1::BlockRemoved* r = out->mutable_block_removed();
      for (uint64_t h : e.block_hashes) r->add_block_hashes(h);
      return;
    }
    case KvEvent::Kind::all_blocks_cleared:
      out->mutable_all_blocks_cleared();
      return;
  }
}

}  // namespace

// ---- KvEventLog ----------------------------------------------------------------------------

void KvEventLog::publish(const std::vector<KvEvent>& events) {
  if (events.empty()) return;
  {
    std::lock_guard lock(mu_);
    v1::KvEventBatch b;
    b.set_sequence_number(next_++);
    b.set_timestamp(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    for (const KvEvent& e : events) to_proto(e, b.add_events());
    batches_.push_back(std::move(b));
    while (batches_.size() > history_) batches_.pop_front();
  }
  for (const auto& call : live_calls()) call->wake();
}

absl::StatusOr<std::optional<v1::KvEventBatch>> KvEventLog::get(uint64_t seq) const {
  std::lock_guard lock(mu_);
  if (seq >= next_) return std::optional<v1::KvEventBatch>();
  const uint64_t oldest = next_ - batches_.size();
  if (seq < oldest) {
    return absl::OutOfRangeError(absl::StrCat("kv events: batch ", seq, " has aged out; the oldest kept is ",
                                              oldest, " (kv_events_history ", history_, ")"));
  }
  return std::optional<v1::KvEventBatch>(batches_[size_t(seq - oldest)]);
}

absl::StatusOr<uint64_t> KvEventLog::start_of(const std::optional<uint64_t>& start) const {
  std::lock_guard lock(mu_);
  if (!start) return next_;
  const uint64_t oldest = next_ - batches_.size();
  if (*start < oldest) {
    return absl::OutOfRangeError(absl::StrCat("start_sequence_number ", *start,
                                              " has aged out: the oldest batch kept is ", oldest,
                                              " (kv_events_history ", history_, ")"));
  }
  if (*start > next_) {
    return absl::InvalidArgumentError(
        absl::StrCat("start_sequence_number ", *start, " is past the next batch, ", next_));
  }
  return *start;
}

uint64_t KvEventLog::next_sequence_number() const {
  std::lock_guard lock(mu_);
  return next_;
}

void KvEventLog::subscribe(const std::shared_ptr<KvEventsSubscriber>& call) {
  std::optional<absl::Status> closed;
  {
    std::lock_guard lock(mu_);
    closed = closed_;
    if (!closed) subscribers_.push_back(call);
  }
  if (closed) {
    call->finish(*closed);
  } else {
    call->wake();  // batches from the start may be there already
  }
}

void KvEventLog::close(const absl::Status& why) {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = why;
  }
  for (const auto& call : live_calls()) call->finish(why);
}

std::vector<std::shared_ptr<KvEventsSubscriber>> KvEventLog::live_calls() {
  std::vector<std::shared_ptr<KvEventsSubscriber>> out;
  std::lock_guard lock(mu_);
  std::erase_if(subscribers_, [&](const std::weak_ptr<KvEventsSubscriber>& w) {
    auto s = w.lock();
    const bool gone = s == nullptr;  // tested before the move below empties `s`
    if (!gone) out.push_back(std::move(s));
    return gone;
  });
  return out;
}

}  // namespace kvfuse::server
