// The step's batch metadata travels to the device as one packed, staged copy
// (ModelRunner::upload_batch, BatchMetaLayout). These tests pin the layout (slices
// aligned, disjoint, inside the buffer), count the copies a step makes, and check that
// batches of every shape — prefill chunks next to decode rows, SWA block tables,
// logprobs, prompt-logprob extra rows, sampling, padded decode — give the same tokens,
// logprobs and logits whether they run in a mixed schedule or alone, so no slice reads
// another's bytes or a stale earlier step's.
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "src/backends/cpu/cpu_backend.h"
#include "tests/util/forwarding_backend.h"
#include "tests/util/engine_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

using json = nlohmann::json;

// The CPU backend, with a log of the copies to the device and of the synchronisations,
// and an injectable failure of one op (argmax_rows: after the step's upload).
class RecordingBackend final : public kvfuse::testing::ForwardingBackend {
 public:
  enum class Event { staged_copy, other_copy, sync };
  explicit RecordingBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}

  std::vector<Event> events;
  std::vector<size_t> staged_bytes;  // per staged copy
  bool fail_next_argmax = false;

  size_t count(Event e) const { return size_t(std::count(events.begin(), events.end(), e)); }
  void clear() {
    events.clear();
    staged_bytes.clear();
  }

  absl::StatusOr<HostBuffer> alloc_host(size_t bytes) override {
    auto b = inner().alloc_host(bytes);
    if (b.ok()) staging_.emplace_back(b->as<const char>(), bytes);
    return b;
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    const char* p = static_cast<const char*>(src);
    bool staged = false;
    for (const auto& [base, n] : staging_) staged = staged || (p >= base && p + bytes <= base + n);
    events.push_back(staged ? Event::staged_copy : Event::other_copy);
    if (staged) staged_bytes.push_back(bytes);
    return inner().copy_to_device(dst, src, bytes);
  }
  absl::Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    events.push_back(Event::sync);  // copy_to_host waits for the stream
    return inner().copy_to_host(dst, src, bytes);
  }
  absl::Status synchronize() override {
    events.push_back(Event::sync);
    return inner().synchronize();
  }
  absl::Status argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                           int32_t* finite) override {
    if (std::exchange(fail_next_argmax, false)) return absl::InternalError("injected failure");
    return inner().argmax_rows(logits, rows, vocab, tokens, finite);
  }

 private:
  std::vector<std::pair<const char*, size_t>> staging_;
};

json engine_config(int window) {
  json cfg = {{"model", "tiny"},     {"device", "cpu"},         {"num_pages", 512},
              {"max_seq_len", 1024}, {"max_batch_tokens", 128}, {"max_running_seqs", 8}};
  if (window) {
    cfg["sliding_window"] = window;
    cfg["swa_layers"] = "alternate";
  }
  return cfg;
}

// An engine over a RecordingBackend (returned through `rec`, owned by the engine).
std::unique_ptr<Engine> recording_engine(int window, RecordingBackend*& rec) {
  auto cfg = config_from_json(engine_config(window));
  REQUIRE(cfg.ok());
  auto backend = std::make_unique<RecordingBackend>(make_cpu_backend());
  rec = backend.get();
  auto e = Engine::create(*cfg, std::move(backend));
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  return std::move(*e);
}

// What the steps returned for one sequence, flattened: tokens, logprob tokens and top
// ids; logprobs and logits (compared bit for bit).
struct SeqOutputs {
  std::vector<int32_t> ints;
  std::vector<float> floats;
  bool operator==(const SeqOutputs& o) const {
    return ints == o.ints && floats.size() == o.floats.size() &&
           std::memcmp(floats.data(), o.floats.data(), floats.size() * sizeof(float)) == 0;
  }
};
struct Outputs {
  std::map<SeqId, SeqOutputs> per_seq;
  bool operator==(const Outputs& o) const { return per_seq == o.per_seq; }
};

void record(const TokenLogprob& t, SeqOutputs& out) {
  out.ints.push_back(t.token);
  out.floats.push_back(t.logprob);
  for (const auto& [id, lp] : t.top) {
    out.ints.push_back(id);
    out.floats.push_back(lp);
  }
}

void record(Engine& e, const std::vector<StepItem>& items, const std::vector<StepResult>& results,
            Outputs& out) {
  const size_t vocab = size_t(e.spec().vocab);
  for (size_t i = 0; i < results.size(); ++i) {
    const StepResult& r = results[i];
    REQUIRE(r.status.ok());
    SeqOutputs& o = out.per_seq[r.id];
    o.ints.push_back(r.token ? *r.token : -1);
    if (r.logprob) record(*r.logprob, o);
    for (const TokenLogprob& t : r.prompt_logprobs) record(t, o);
    if (items[i].logits) {
      REQUIRE(r.logits_row >= 0);
      const float* lg = e.last_logits().data() + size_t(r.logits_row) * vocab;
      o.floats.insert(o.floats.end(), lg, lg + vocab);
    }
  }
}

// Three sequences through steps of every shape: a two-sequence prefill (one with prompt
// logprobs: extra rows; one sampling with temperature), a mixed step (two decode rows
// beside a prefill chunk of a third sequence that does not sample), a step that
// finishes that prompt ahead of the decode rows, then decode steps with and without
// logprobs and logits, one of them with a single sequence. Only the sequences in `keep`
// run (the others' items are left out of every step); `per_step` sees each step's result.
Outputs run_schedule(Engine& e, const ForwardOptions& opts, const std::set<SeqId>& keep = {11, 12, 13},
                     const std::function<void()>& per_step = {}) {
  const int32_t vocab = e.spec().vocab;
  SamplingParams hot;
  hot.temperature = 0.8f;
  hot.top_k = 40;
  hot.seed = 7;
  if (keep.count(11)) REQUIRE(e.add_sequence(11, prompt_of(37, 1, vocab), SamplingParams{}).ok());
  if (keep.count(12)) REQUIRE(e.add_sequence(12, prompt_of(20, 2, vocab), hot).ok());
  if (keep.count(13)) REQUIRE(e.add_sequence(13, prompt_of(50, 3, vocab), SamplingParams{}).ok());
  Outputs out;
  auto step = [&](const std::vector<StepItem>& all) {
    std::vector<StepItem> items;
    for (const StepItem& it : all)
      if (keep.count(it.id)) items.push_back(it);
    if (items.empty()) return;
    auto r = e.step(items, opts);
    REQUIRE(r.ok());
    record(e, items, *r, out);
    if (per_step) per_step();
  };
  StepItem a{11, 37, true, true, true, false, 2};
  StepItem b{12, 20, true, false, false, true, 3};
  step({a, b});
  a = StepItem{11, 1, true, false, false, false, 0};
  b = StepItem{12, 1, true, true, true, false, 1};
  StepItem c{13, 30, false, false, false, true, 0};
  step({a, b, c});
  c = StepItem{13, 20, true, true, false, false, 0};
  step({c, a, b});
  for (int i = 0; i < 6; ++i) {
    a = StepItem{11, 1, true, i % 2 == 0, i % 3 == 0, false, i % 3 == 0 ? 4 : 0};
    b = StepItem{12, 1, true, i % 2 == 1, i == 2, false, 2};
    c = StepItem{13, 1, true, i == 4, false, false, 0};
    step(i == 3 ? std::vector<StepItem>{b} : std::vector<StepItem>{a, b, c});
  }
  for (SeqId id : keep) REQUIRE(e.release(id).ok());
  return out;
}

ForwardOptions options(bool padded) {
  ForwardOptions o;
  o.graphs = padded;       // decode-only steps padded to their graph bucket...
  o.graph_replay = false;  // ...and run eagerly (the CPU has no graphs)
  return o;
}

}  // namespace

TEST_CASE("batch upload: the metadata layout has aligned, disjoint slices that hold the limits",
          "[runner][upload]") {
  const ModelLimits cases[] = {{1, 1, 1}, {3, 2, 5}, {128, 8, 64}, {2048, 256, 512}, {65536, 4096, 1024}};
  for (const ModelLimits& lim : cases) {
    CAPTURE(lim.max_tokens, lim.max_seqs, lim.max_pages_per_seq);
    const BatchMetaLayout m = BatchMetaLayout::for_limits(lim);
    const size_t T = size_t(lim.max_tokens), S = size_t(lim.max_seqs), P = size_t(lim.max_pages_per_seq);
    const std::map<std::string, size_t> need = {{"query_start", (S + 1) * 4},
                                                {"context_len", S * 4},
                                                {"logits_rows", S * 4},
                                                {"sampling", S * sizeof(RowSampling)},
                                                {"logprobs", S * sizeof(LogprobRow)},
                                                {"adjust_start", (S + 1) * 4},
                                                {"token_ids", T * 4},
                                                {"positions", T * 4},
                                                {"slot_mapping", T * 8},
                                                {"block_table_full", S * P * 4},
                                                {"block_table_swa", S * P * 4},
                                                {"extra_rows", T * 4},
                                                {"extra_logprobs", T * sizeof(LogprobRow)}};
    const auto slices = m.slices();
    REQUIRE(slices.size() == need.size());
    CHECK(m.total % BatchMetaLayout::kAlign == 0);
    CHECK(slices.front().second.offset == 0);  // the one copy starts at the buffer's start
    size_t end = 0;
    for (const auto& [name, sl] : slices) {
      CAPTURE(name, sl.offset, sl.capacity);
      CHECK(sl.offset % BatchMetaLayout::kAlign == 0);
      CHECK(sl.capacity == need.at(name));
      CHECK(sl.offset >= end);  // in buffer order, no overlap with the slice before
      end = sl.offset + sl.capacity;
    }
    CHECK(end <= m.total);
    CHECK(m.total < end + BatchMetaLayout::kAlign);
  }
  // The staging buffer holds the same layout at the backend's host alignment.
  auto cpu = make_cpu_backend();
  auto host = cpu->alloc_host(1000);
  REQUIRE(host.ok());
  CHECK(reinterpret_cast<uintptr_t>(host->get()) % Backend::kHostAlign == 0);
  CHECK(host->bytes() == 1000);
}

TEST_CASE("batch upload: every step of every shape uploads its metadata in one staged copy",
          "[runner][upload]") {
  for (int window : {0, 24}) {
    for (bool padded : {false, true}) {
      CAPTURE(window, padded);
      RecordingBackend* rec = nullptr;
      auto e = recording_engine(window, rec);
      const BatchMetaLayout layout = BatchMetaLayout::for_limits({128, 8, 1024 / 16});
      rec->clear();
      int steps = 0;
      run_schedule(*e, options(padded), {11, 12, 13}, [&] {
        ++steps;
        CHECK(rec->count(RecordingBackend::Event::staged_copy) == 1);
        // Without SWA layers nothing else crosses to the device; with them the pool's
        // SWA slot table follows its changed pages (KvPool::sync_swa_table).
        if (window == 0) CHECK(rec->count(RecordingBackend::Event::other_copy) == 0);
        REQUIRE(rec->staged_bytes.size() == 1);
        CHECK(rec->staged_bytes[0] <= layout.total);
        // Steps 1 and 2 have prompt-logprob rows; the others' copy ends before the extra
        // rows' slices, and without SWA layers before the SWA block table's.
        if (steps > 2) CHECK(rec->staged_bytes[0] <= layout.extra_rows.offset);
        if (steps > 2 && window == 0) CHECK(rec->staged_bytes[0] <= layout.block_table_swa.offset);
        rec->clear();
      });
      CHECK(steps == 9);
    }
  }
}

TEST_CASE("batch upload: a decode step's copy stops at its block tables", "[runner][upload]") {
  for (int window : {0, 24}) {
    CAPTURE(window);
    RecordingBackend* rec = nullptr;
    auto e = recording_engine(window, rec);
    const int32_t vocab = e->spec().vocab;
    REQUIRE(e->add_sequence(1, prompt_of(40, 5, vocab), SamplingParams{}).ok());
    REQUIRE(e->add_sequence(2, prompt_of(9, 6, vocab), SamplingParams{}).ok());
    REQUIRE(e->step({StepItem{1, 40}, StepItem{2, 9}}).ok());
    rec->clear();
    REQUIRE(e->step({StepItem{1, 1}, StepItem{2, 1}}).ok());
    REQUIRE(rec->staged_bytes.size() == 1);
    const BatchMetaLayout m = BatchMetaLayout::for_limits({128, 8, 1024 / 16});
    // Two sequences of at most 41 tokens: 3 pages of 16 per sequence in each table; the
    // SWA table follows the full table's used part (aligned), not its own slice's start,
    // so the copy leaves out the full table's unused tail.
    const size_t full_end = m.block_table_full.offset + 2 * 3 * sizeof(int32_t);
    const size_t swa_start = m.block_table_full.offset + BatchMetaLayout::kAlign;
    CHECK(rec->staged_bytes[0] == (window ? swa_start + 2 * 3 * sizeof(int32_t) : full_end));
    if (window) CHECK(rec->staged_bytes[0] < m.block_table_swa.offset);
  }
}

TEST_CASE("batch upload: each sequence's results in a mixed schedule equal its results alone",
          "[engine][upload]") {
  // Rows of one sequence in a batch read only their own slices' entries: a packing that
  // shifted a slice, overlapped two, or left a step reading an earlier step's bytes would
  // change some sequence's tokens, logprobs or logits (the CPU backend is batch-invariant).
  for (int window : {0, 24}) {
    for (bool padded : {false, true}) {
      CAPTURE(window, padded);
      auto e = make_engine(engine_config(window));
      const Outputs all = run_schedule(*e, options(padded));
      REQUIRE(all.per_seq.size() == 3);
      for (SeqId id : {11, 12, 13}) {
        CAPTURE(id);
        const Outputs alone = run_schedule(*e, options(padded), {id});
        REQUIRE(alone.per_seq.count(id));
        CHECK(alone.per_seq.at(id) == all.per_seq.at(id));
        CHECK(!alone.per_seq.at(id).floats.empty());
      }
      // Padding to graph buckets changes nothing either.
      CHECK(run_schedule(*e, options(!padded)) == all);
    }
  }
}

TEST_CASE("batch upload: a step that fails after its upload leaves the staging buffer safe to reuse",
          "[engine][upload]") {
  // On a GPU the staged copy is asynchronous: a step that fails before read_back's
  // synchronisation must make the next upload wait before it repacks the buffer.
  RecordingBackend* rec = nullptr;
  auto e = recording_engine(0, rec);
  auto clean = make_engine(engine_config(0));
  const int32_t vocab = e->spec().vocab;
  for (Engine* x : {e.get(), clean.get()})
    REQUIRE(x->add_sequence(1, prompt_of(30, 9, vocab), SamplingParams{}).ok());
  REQUIRE(e->step({StepItem{1, 30}}).ok());
  auto first = clean->step({StepItem{1, 30}});
  REQUIRE(first.ok());
  rec->fail_next_argmax = true;
  rec->clear();
  auto failed = e->step({StepItem{1, 1}});
  REQUIRE_FALSE(failed.ok());
  CHECK(rec->count(RecordingBackend::Event::staged_copy) == 1);
  rec->clear();
  std::vector<int32_t> got, want;
  for (int i = 0; i < 5; ++i) {
    auto r = e->step({StepItem{1, 1}});
    REQUIRE(r.ok());
    got.push_back(*(*r)[0].token);
    auto c = clean->step({StepItem{1, 1}});
    REQUIRE(c.ok());
    want.push_back(*(*c)[0].token);
    if (i == 0) {
      // The retry synchronised before it packed and copied.
      REQUIRE(rec->events.size() >= 2);
      CHECK(rec->events[0] == RecordingBackend::Event::sync);
      CHECK(rec->events[1] == RecordingBackend::Event::staged_copy);
    }
    rec->clear();
  }
  CHECK(got == want);
}
