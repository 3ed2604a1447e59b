#include "src/runtime/rank_commands.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace kvfuse {

namespace {

constexpr char kMagic[8] = {'K', 'V', 'F', 'U', 'S', 'E', 'C', 'M'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
// A step's metadata is a few MB at most (block tables of the largest batches); beyond
// this a length is a broken stream, not a command.

// Trivially copyable values and vectors of them, in host order.
class Writer {
 public:
  template <class T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    pod(uint64_t(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& in) : in_(in) {}
  template <class T>
  bool pod(T& v) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  template <class T>
  bool vec(std::vector<T>& v) {
    uint64_t n = 0;
    if (!pod(n) || n > (in_.size() - pos_) / sizeof(T)) return false;
    v.resize(size_t(n));
    if (n > 0) std::memcpy(v.data(), in_.data() + pos_, size_t(n) * sizeof(T));
    pos_ += size_t(n) * sizeof(T);
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  const std::vector<uint8_t>& in_;
  size_t pos_ = 0;
};

}  // namespace

const char* to_string(RankCommand c) {
  switch (c) {
    case RankCommand::forward:
      return "forward";
    case RankCommand::collectives:
      return "collectives";
    case RankCommand::shutdown:
      return "shutdown";
    case RankCommand::error:
      return "error";
    case RankCommand::end_gemm_tuning:
      return "end_gemm_tuning";
  }
  return "unknown";
}

std::vector<uint8_t> rank_frame(RankCommand command, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out(kHeaderBytes + payload.size());
  std::memcpy(out.data(), kMagic, 8);
  net::put_u32(out.data() + 8, kVersion);
  net::put_u32(out.data() + 12, uint32_t(command));
  net::put_u64(out.data() + 16, payload.size());
  if (!payload.empty()) std::memcpy(out.data() + kHeaderBytes, payload.data(), payload.size());
  return out;
}

absl::Status send_rank_frame(int fd, const std::vector<uint8_t>& frame, net::Clock::time_point deadline,
                             const std::string& what) {
  if (net::send_all(fd, frame.data(), frame.size(), deadline)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": the connection is closed or stalled"));
}

absl::StatusOr<RankMessage> recv_rank_frame(int fd, net::Clock::time_point deadline, const std::string& what,
                                            uint64_t max_payload) {
  uint8_t head[kHeaderBytes];
  auto lost = [&](net::RecvResult r) {
    return r == net::RecvResult::timeout
               ? absl::DeadlineExceededError(absl::StrCat(what, ": no message before the deadline"))
               : absl::UnavailableError(absl::StrCat(what, ": the connection was closed"));
  };
  if (auto r = net::recv_all(fd, head, sizeof head, deadline); r != net::RecvResult::ok) return lost(r);
  const uint32_t version = net::get_u32(head + 8);
  const uint64_t length = net::get_u64(head + 16);
  if (std::memcmp(head, kMagic, 8) != 0 || version != kVersion) {
    return absl::DataLossError(absl::StrCat(what, ": not a kvfuse rank command (version ", version, ", ",
                                            length, " bytes); mixed kvfuse versions?"));
  }
  if (length > max_payload) {
    return absl::DataLossError(absl::StrCat(what, ": a ", to_string(RankCommand(net::get_u32(head + 12))),
                                            " command of ", length, " bytes, over the ", max_payload,
                                            " this connection takes"));
  }
  RankMessage m;
  m.command = RankCommand(net::get_u32(head + 12));
  m.payload.resize(size_t(length));
  if (length > 0) {
    if (auto r = net::recv_all(fd, m.payload.data(), m.payload.size(), deadline); r != net::RecvResult::ok) {
      return lost(r);
    }
  }
  return m;
}

std::vector<uint8_t> encode_forward(const ForwardBatch& b, const ForwardOptions& opts,
                                    const std::vector<SwaPageMapping>& swa_changes) {
  Writer w;
  w.pod(opts);
  w.vec(swa_changes);
  w.vec(b.token_ids);
  w.vec(b.positions);
  w.vec(b.slot_mapping);
  w.vec(b.query_start);
  w.vec(b.context_len);
  w.vec(b.block_table_full);
  w.vec(b.block_table_swa);
  w.pod(b.max_pages_per_seq);
  w.pod(b.max_query_len);
  w.pod(b.max_context_len);
  w.vec(b.logits_rows);
  w.vec(b.logits_host);
  w.vec(b.sampling);
  w.vec(b.logprobs);
  w.vec(b.extra_rows);
  w.vec(b.extra_logprobs);
  return w.take();
}

absl::Status decode_forward(const std::vector<uint8_t>& payload, ForwardBatch& b, ForwardOptions& opts,
                            std::vector<SwaPageMapping>& swa_changes) {
  Reader r(payload);
  const bool ok = r.pod(opts) && r.vec(swa_changes) && r.vec(b.token_ids) && r.vec(b.positions) &&
                  r.vec(b.slot_mapping) && r.vec(b.query_start) && r.vec(b.context_len) &&
                  r.vec(b.block_table_full) && r.vec(b.block_table_swa) && r.pod(b.max_pages_per_seq) &&
                  r.pod(b.max_query_len) && r.pod(b.max_context_len) && r.vec(b.logits_rows) &&
                  r.vec(b.logits_host) && r.vec(b.sampling) && r.vec(b.logprobs) && r.vec(b.extra_rows) &&
                  r.vec(b.extra_logprobs) && r.done();
  if (!ok)
    return absl::DataLossError(absl::StrCat("forward command of ", payload.size(), " bytes is malformed"));
  return absl::OkStatus();
}

std::vector<uint8_t> encode_collectives(int32_t tokens, int32_t reps) {
  Writer w;
  w.pod(tokens);
  w.pod(reps);
  return w.take();
}

absl::Status decode_collectives(const std::vector<uint8_t>& payload, int32_t& tokens, int32_t& reps) {
  Reader r(payload);
  if (!(r.pod(tokens) && r.pod(reps) && r.done()))
    return absl::DataLossError("collectives command is malformed");
  return absl::OkStatus();
}

}  // namespace kvfuse
