#include "src/runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/status_macros.h"
#include "src/loading/checkpoint.h"
#include "src/loading/kv_scales.h"
#include "src/runtime/engine_rank.h"
#include "src/runtime/rank_commands.h"
#include "src/runtime/rank_links.h"

namespace kvfuse {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
int32_t ceil_div(int64_t a, int64_t b) { return int32_t((a + b - 1) / b); }
double available_memory_gib() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return double(kb) / double(1 << 20);
  }
  return -1.0;
}
}  // namespace

absl::Status check_cpu_weight_memory(const ModelSpec& s, double available_gib) {
  // The CPU backend holds weights in bf16: refuse shapes that cannot fit in memory with a
  // message instead of failing an allocation half way.
  const double need_gib = double(s.num_params()) * 2.0 / double(1 << 30);
  if (available_gib > 0 && need_gib > 0.8 * available_gib) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("model '%s' needs %.1f GiB of bf16 weights on the CPU backend, %.1f GiB available; "
                        "use a GPU device or the tiny preset",
                        s.name, need_gib, available_gib));
  }
  return absl::OkStatus();
}

Engine::Engine(Config cfg, std::unique_ptr<Backend> backend) : cfg_(std::move(cfg)), backend_(std::move(backend)) {}

Engine::~Engine() {
  // Across processes: the followers exit cleanly (and no watcher uses the communicator
  // any more once the links are gone).
  if (follower_links_) follower_links_->shutdown();
  follower_links_.reset();
  leader_link_.reset();
  // Each rank's objects are released on its own thread (its device current), runners and
  // models before the communicators and backends they use; then the threads stop.
  for (auto& rp : ranks_) {
    Rank& r = *rp;
    if (!r.thread) continue;
    r.thread
        ->post([&r] {
          // A rank whose backend could not be made (a GPU that is not there) has none.
          if (r.backend) (void)r.backend->bind_thread();
          r.runner.reset();
          r.model.reset();
          r.comm.reset();
          r.backend.reset();
          return absl::OkStatus();
        })
        .wait();
    r.thread.reset();
  }
  runner_.reset();
  model_.reset();
  pool_.reset();
  comm_.reset();
}

LoadProgressFn load_progress_every(double every_s, LoadProgressFn sink) {
  if (!sink) return {};
  auto last = std::make_shared<std::optional<double>>();  // elapsed_s of the last passed on
  return [every_s, sink = std::move(sink), last](const LoadProgress& p) {
    if (!last->has_value() || p.layers_done >= p.layers || p.elapsed_s - **last >= every_s) {
      *last = p.elapsed_s;
      sink(p);
    }
  };
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::create(const Config& cfg, LoadProgressFn progress) {
  auto backend = make_backend(cfg.device, cfg.tp_device(0));
  if (!backend.ok()) return backend.status();
  return create(cfg, std::move(*backend), std::move(progress));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::create(const Config& cfg, std::unique_ptr<Backend> backend,
                                                       LoadProgressFn progress) {
  std::unique_ptr<Engine> e(new Engine(cfg, std::move(backend)));
  e->load_progress_ = std::move(progress);
  const absl::Status st = e->init();
  if (!st.ok()) {
    // Followers that already joined see their connection close, not a clean shutdown.
    e->follower_links_.reset();
    return st;
  }
  return e;
}

absl::Status Engine::init() {
  auto spec = resolve_model_spec(cfg_);
  if (!spec.ok()) return spec.status();
  const ModelSpec& s = *spec;
  const size_t L = size_t(s.num_layers);
  if (cfg_.tensor_parallel > 1) {
    KVFUSE_RETURN_IF_ERROR(check_tensor_parallel(s, cfg_.tensor_parallel));
  } else if (cfg_.tp_rank_alone) {
    return absl::InvalidArgumentError(
        "tp_rank_alone: needs tensor_parallel >= 2 (the group whose rank 0 runs)");
  }
  if (cfg_.tp_share_gpu) {
    if (cfg_.tensor_parallel < 2 || cfg_.tp_rank_alone || !cfg_.tp_rendezvous.empty() ||
        cfg_.devices.size() > 1 || backend_->device() == Device::cpu ||
        cfg_.tp_allreduce == TpAllReduce::nccl) {
      return absl::InvalidArgumentError(
          "tp_share_gpu: a group of tensor_parallel >= 2 in one process on one GPU (devices empty or one "
          "ordinal, no tp_rendezvous or tp_rank_alone, tp_allreduce auto or push), on a GPU backend");
    }
  }
  if (backend_->device() == Device::cpu) {
    KVFUSE_RETURN_IF_ERROR(check_cpu_weight_memory(s, available_memory_gib()));
  }

  KvPoolConfig pc;
  pc.num_layers = s.num_layers;
  pc.page_size = cfg_.page_size;
  pc.num_pages = cfg_.num_pages;
  pc.num_kv_heads = s.num_kv_heads;
  pc.head_dim = s.head_dim;
  pc.format = backend_->resolve_kv_format(cfg_.kv_cache_dtype);
  // Before anything is allocated: a shape the device's kernels do not serve fails here,
  // with the shape in the message, not at the first step.
  KVFUSE_RETURN_IF_ERROR(backend_->check_supported(s, pc.format));
  pc.layer_is_swa = s.layer_is_swa;
  pc.window = s.sliding_window;
  // A checkpoint (model_path) brings the weights and possibly KV scales; the scales in
  // use follow the precedence and FNUZ rule of src/loading/kv_scales.h.
  std::unique_ptr<Checkpoint> ckpt;
  if (!cfg_.model_path.empty()) {
    auto c = Checkpoint::open(cfg_.model_path);
    if (!c.ok()) return c.status();
    ckpt = std::move(*c);
  }
  auto scales = resolve_kv_scales(cfg_, ckpt ? ckpt->kv_scales() : std::nullopt, s.num_layers);
  if (!scales.ok()) return scales.status();
  for (size_t l = 0; l < L; ++l) {
    pc.k_scale.push_back(kv_scale_on_device(scales->k[l], pc.format));
    pc.v_scale.push_back(kv_scale_on_device(scales->v[l], pc.format));
  }
  pc.max_step_tokens = cfg_.max_batch_tokens;
  if (s.any_swa()) {
    // Enough SWA pages for every running sequence, unless the config sizes the pool itself.
    pc.swa_num_pages =
        cfg_.swa_num_pages > 0
            ? cfg_.swa_num_pages
            : std::min<int64_t>(cfg_.num_pages, KvPool::max_swa_pages_held(pc) * cfg_.max_running_seqs);
  }
  if (ckpt) {
    KVFUSE_RETURN_IF_ERROR(ckpt->check_shapes(s));
  }
  const std::unique_ptr<HostWeightSource> weights =
      ckpt ? ckpt->weights() : make_synthetic_weights(s, cfg_.seed);
  auto load_start = std::chrono::steady_clock::now();
  auto after_layer = [&](int32_t done) {  // 0 as loading begins: the clock starts there
    if (done == 0) load_start = std::chrono::steady_clock::now();
    if (load_progress_) {
      load_progress_(
          LoadProgress{done, s.num_layers,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count()});
    }
  };
  if (cfg_.tensor_parallel > 1) {
    KVFUSE_RETURN_IF_ERROR(cfg_.tp_rank_alone           ? init_rank_alone(s, pc)
                           : cfg_.tp_rendezvous.empty() ? init_ranks(s, pc)
                                                        : init_process_group(s, pc));
    after_layer(0);
    return load_weights(*weights, after_layer);
  }
  auto pool = KvPool::create(*backend_, pc);
  if (!pool.ok()) return pool.status();
  pool_ = std::move(*pool);

  after_layer(0);
  auto model = Model::create(*backend_, s, *weights, after_layer);
  if (!model.ok()) return model.status();
  model_ = std::move(*model);
  auto runner = ModelRunner::create(*backend_, *model_, model_limits(cfg_));
  if (!runner.ok()) return runner.status();
  runner_ = std::move(*runner);
  return absl::OkStatus();
}

absl::Status Engine::check_no_step_in_flight() const {
  if (in_flight_.active) return absl::FailedPreconditionError("a step is in flight (end_step first)");
  return absl::OkStatus();
}

absl::Status Engine::forward(const ForwardOptions& opts) {
  if (single_rank()) return runner_->run(batch_, *pool_, opts, fwd_);
  if (follower_links_) {
    // Sent before this rank starts: every process runs the step at once.
    KVFUSE_RETURN_IF_ERROR(
        post_to_followers(RankCommand::forward, encode_forward(batch_, opts, pool_->take_swa_changes())));
  }
  // Every rank runs the same batch; rank 0's result has the tokens. A collective that
  // failed on the device after its launch (a peer all-reduce that timed out) fails the step.
  return for_each_rank([&](int32_t r) { return run_rank_pass(r, opts); }, true);
}

absl::Status Engine::check_tokens(const std::vector<int32_t>& tokens) const {
  const int32_t vocab = model_->spec().vocab;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[i], " at index ", i,
                                                     " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::add_sequence(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling,
                                  const Rng* rng, bool reuse_prefix) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  if (seqs_.count(id)) return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (int64_t(prompt.size()) >= cfg_.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", prompt.size(), " tokens leaves no room under max_seq_len ", cfg_.max_seq_len));
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(prompt));
  KVFUSE_RETURN_IF_ERROR(validate_sampling(sampling, model_->spec().vocab));
  // Prefix reuse: the live sequence whose computed tokens match the longest prefix.
  SeqId donor = 0;
  int32_t shared = 0;
  if (cfg_.prefix_reuse && reuse_prefix && !pool_->has_swa()) {
    const int32_t ps = cfg_.page_size;
    const size_t limit = prompt.size() - 1;  // the last prompt token is computed: its logits
    for (const auto& [sid, st] : seqs_) {
      const size_t n = std::min(limit, size_t(st.num_computed));
      const size_t common = size_t(std::mismatch(prompt.begin(), prompt.begin() + ptrdiff_t(n), st.tokens.begin()).first -
                                   prompt.begin());
      const int32_t pages = int32_t(common) / ps * ps;
      if (pages > shared) {
        shared = pages;
        donor = sid;
      }
    }
  }
  KVFUSE_RETURN_IF_ERROR(pool_->add_sequence(id));
  if (shared > 0) {
    if (absl::Status st = pool_->share_prefix(id, donor, shared); !st.ok()) {
      (void)pool_->release(id);
      return st;
    }
  }
  SequenceState& s = seqs_[id];
  s.id = id;
  s.num_computed = shared;
  s.num_cached = shared;
  s.num_prompt = int32_t(prompt.size());
  s.tokens = std::move(prompt);
  s.sampling = sampling;
  s.rng = rng ? *rng : Rng(sampling.seed);
  return absl::OkStatus();
}

absl::Status Engine::append_tokens(SeqId id, const std::vector<int32_t>& tokens) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (tokens.empty()) return absl::InvalidArgumentError("no tokens to append");
  if (int64_t(it->second.tokens.size() + tokens.size()) > cfg_.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", id, " would exceed max_seq_len ", cfg_.max_seq_len));
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(tokens));
  auto& t = it->second.tokens;
  t.insert(t.end(), tokens.begin(), tokens.end());
  return absl::OkStatus();
}

absl::Status Engine::release(SeqId id) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  if (!seqs_.erase(id)) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  return pool_->release(id);
}

const SequenceState* Engine::sequence(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::vector<StepResult>> Engine::step(const std::vector<StepItem>& items) {
  return step(items, forward_options());
}

absl::StatusOr<std::vector<StepResult>> Engine::step(const std::vector<StepItem>& items,
                                                     const ForwardOptions& opts) {
  KVFUSE_RETURN_IF_ERROR(begin_step(items, opts));
  return end_step();
}

absl::Status Engine::begin_step(const std::vector<StepItem>& items, const ForwardOptions& opts) {
  if (is_follower()) {
    return absl::FailedPreconditionError("step: this process follows rank 0, whose engine runs the steps");
  }
  if (!group_failed_.ok()) return group_failed_;  // a rank failed earlier: nothing runs any more
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  InFlight& f = in_flight_;
  f.t0 = Clock::now();
  timings_ = StepTimings{};
  KVFUSE_RETURN_IF_ERROR(check_items(items));
  f.items = items;
  f.results.assign(items.size(), StepResult{});
  f.run = reserve_pages(items, f.results);
  f.launched = false;
  if (!f.run.empty()) {
    build_batch(items, f.run);
    timings_.prepare_ms = ms_since(f.t0);
    f.t1 = Clock::now();
    // One rank: queue the pass and return; end_step waits. Several: every rank's thread
    // runs its pass to the end (they meet in the collectives), here.
    const absl::Status st = single_rank() ? runner_->launch(batch_, *pool_, opts, fwd_) : forward(opts);
    if (!st.ok()) return absl::InternalError(absl::StrCat("forward pass failed: ", st.message()));
    f.launched = true;
  }
  f.active = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepResult>> Engine::end_step() {
  if (!in_flight_.active) return absl::FailedPreconditionError("no step in flight (begin_step first)");
  InFlight& f = in_flight_;
  f.active = false;
  if (!f.launched) return std::move(f.results);
  if (single_rank()) {
    if (auto st = runner_->finish(batch_, fwd_); !st.ok()) {
      return absl::InternalError(absl::StrCat("forward pass failed: ", st.message()));
    }
  }
  timings_.forward_ms = ms_since(f.t1);

  const auto t2 = Clock::now();
  apply_results(f.items, f.run, f.results);
  timings_.sample_ms = ms_since(t2);
  timings_.total_ms = ms_since(f.t0);
  timings_.num_tokens = batch_.num_tokens();
  timings_.num_seqs = int32_t(f.run.size());
  timings_.graph = fwd_.graph;
  return std::move(f.results);
}

absl::Status Engine::check_items(const std::vector<StepItem>& items) const {
  if (items.empty()) return absl::InvalidArgumentError("step: no items");
  if (int64_t(items.size()) > cfg_.max_running_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", items.size(), " sequences exceed max_running_seqs ", cfg_.max_running_seqs));
  }
  std::unordered_set<SeqId> seen;
  int64_t total = 0;
  for (const StepItem& it : items) {
    auto s = seqs_.find(it.id);
    if (s == seqs_.end()) return absl::NotFoundError(absl::StrCat("step: sequence ", it.id, " not found"));
    if (!seen.insert(it.id).second)
      return absl::InvalidArgumentError(absl::StrCat("step: sequence ", it.id, " twice"));
    const int32_t pending = s->second.num_pending();
    if (it.num_tokens < 1 || it.num_tokens > pending) {
      return absl::InvalidArgumentError(absl::StrCat("step: sequence ", it.id, " asks for ", it.num_tokens,
                                                     " tokens with ", pending, " pending"));
    }
    if (it.top_logprobs < 0 || it.top_logprobs > kMaxTopLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("step: sequence ", it.id, " asks for ", it.top_logprobs,
                                                     " top logprobs; at most ", kMaxTopLogprobs));
    }
    if (it.logprobs && !it.sample) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: sequence ", it.id, " asks for the logprob of a token it does not sample"));
    }
    if (it.sample && it.num_tokens != pending) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: sequence ", it.id, " samples before its last token"));
    }
    if (it.sample && int64_t(s->second.tokens.size()) >= cfg_.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: sequence ", it.id, " is at max_seq_len ", cfg_.max_seq_len));
    }
    total += it.num_tokens;
  }
  if (total > cfg_.max_batch_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", total, " tokens exceed max_batch_tokens ", cfg_.max_batch_tokens));
  }
  return absl::OkStatus();
}

std::vector<size_t> Engine::reserve_pages(const std::vector<StepItem>& items,
                                          std::vector<StepResult>& results) {
  // Pages a scheduler reserved already cost nothing here; a sequence that cannot get
  // them fails alone.
  std::vector<size_t> run;
  for (size_t i = 0; i < items.size(); ++i) {
    results[i].id = items[i].id;
    const SequenceState& s = seqs_.at(items[i].id);
    results[i].status = pool_->reserve(s.id, s.num_computed + items[i].num_tokens);
    if (results[i].status.ok()) run.push_back(i);
  }
  return run;
}

void Engine::build_batch(const std::vector<StepItem>& items, const std::vector<size_t>& run) {
  ForwardBatch& b = batch_;
  const int32_t ps = cfg_.page_size;
  b.token_ids.clear();
  b.positions.clear();
  b.slot_mapping.clear();
  b.query_start.assign(1, 0);
  b.context_len.clear();
  b.logits_rows.clear();
  b.logits_host.clear();
  b.sampling.clear();
  b.logprobs.clear();
  b.extra_rows.clear();
  b.extra_logprobs.clear();
  extra_count_.clear();
  bool any_logprobs = false;
  b.max_query_len = 0;
  b.max_context_len = 0;
  for (size_t i : run) {
    const SequenceState& s = seqs_.at(items[i].id);
    const int32_t ctx = s.num_computed + items[i].num_tokens;
    b.max_context_len = std::max(b.max_context_len, ctx);
    b.max_query_len = std::max(b.max_query_len, items[i].num_tokens);
  }
  b.max_pages_per_seq = ceil_div(b.max_context_len, ps);
  b.block_table_full.assign(run.size() * size_t(b.max_pages_per_seq), -1);
  b.block_table_swa.assign(pool_->has_swa() ? b.block_table_full.size() : 0, -1);
  for (size_t r = 0; r < run.size(); ++r) {
    const StepItem& it = items[run[r]];
    SequenceState& s = seqs_.at(it.id);
    const size_t extra_before = b.extra_rows.size();
    for (int32_t p = s.num_computed; p < s.num_computed + it.num_tokens; ++p) {
      if (it.prompt_logprobs && size_t(p) + 1 < s.tokens.size()) {
        b.extra_rows.push_back(int32_t(b.token_ids.size()));
        b.extra_logprobs.push_back(LogprobRow{s.tokens[size_t(p) + 1], it.top_logprobs});
      }
      b.token_ids.push_back(s.tokens[size_t(p)]);
      b.positions.push_back(p);
      b.slot_mapping.push_back(pool_->slot(it.id, p));
    }
    extra_count_.push_back(b.extra_rows.size() - extra_before);
    b.query_start.push_back(int32_t(b.token_ids.size()));
    b.context_len.push_back(s.num_computed + it.num_tokens);
    if (it.sample || it.logits) {
      b.logits_rows.push_back(int32_t(b.token_ids.size()) - 1);
      // Tokens are chosen on the device; logits cross to the host only when asked for.
      b.logits_host.push_back(it.logits ? 1 : 0);
      RowSampling rs;
      if (it.sample && s.sampling.temperature != 0.0f) {
        rs.temperature = s.sampling.temperature;
        rs.top_k = s.sampling.top_k;
        rs.top_p = s.sampling.top_p;
        rs.u = s.rng.uniform();  // one draw per sampled token, as sample_token
      }
      b.sampling.push_back(rs);
      b.logprobs.push_back(it.logprobs ? LogprobRow{-1, it.top_logprobs} : LogprobRow{});
      any_logprobs = any_logprobs || it.logprobs;
    }
    const auto& full = pool_->page_table(it.id, PoolKind::full);
    std::copy(full.begin(), full.end(), b.block_table_full.begin() + int64_t(r) * b.max_pages_per_seq);
    if (pool_->has_swa()) {
      const auto& swa = pool_->page_table(it.id, PoolKind::swa);
      std::copy(swa.begin(), swa.end(), b.block_table_swa.begin() + int64_t(r) * b.max_pages_per_seq);
    }
  }
  if (!any_logprobs) b.logprobs.clear();
}

namespace {
TokenLogprob to_token_logprob(const LogprobOut& o) {
  TokenLogprob t;
  t.token = o.token;
  t.logprob = o.logprob;
  t.top.reserve(size_t(o.top_n));
  for (int32_t j = 0; j < o.top_n; ++j) t.top.emplace_back(o.top_ids[j], o.top_logprobs[j]);
  return t;
}
}  // namespace

void Engine::apply_results(const std::vector<StepItem>& items, const std::vector<size_t>& run,
                           std::vector<StepResult>& results) {
  size_t row = 0, host_row = 0, extra = 0;
  for (size_t r = 0; r < run.size(); ++r) {
    const size_t i = run[r];
    const StepItem& it = items[i];
    SequenceState& s = seqs_.at(it.id);
    for (size_t e = 0; e < extra_count_[r]; ++e) {
      results[i].prompt_logprobs.push_back(to_token_logprob(fwd_.extra_logprobs[extra++]));
    }
    s.num_computed += it.num_tokens;
    pool_->trim_window(it.id);
    if (!it.sample && !it.logits) continue;
    const size_t k = row++;
    if (batch_.logits_host[k]) results[i].logits_row = int32_t(host_row++);
    if (!it.sample) continue;
    if (!fwd_.finite[k]) {
      results[i].status = absl::InternalError(absl::StrCat("sequence ", it.id, ": non-finite logits"));
      continue;
    }
    const int32_t tok = s.sampling.temperature == 0.0f ? fwd_.tokens[k] : fwd_.sampled[k];
    s.tokens.push_back(tok);
    results[i].token = tok;
    if (it.logprobs) results[i].logprob = to_token_logprob(fwd_.logprobs[k]);
  }
}

absl::StatusOr<int> Engine::warm_up_decode_graphs() {
  if (is_follower()) return absl::FailedPreconditionError("warm_up_decode_graphs: rank 0's process runs it");
  if (cfg_.graphs != GraphsMode::on || !backend_->supports_graphs()) return 0;
  const int32_t limit = std::min<int32_t>(cfg_.max_running_seqs, cfg_.max_batch_tokens);
  std::vector<int32_t> buckets;
  for (int32_t n = 1; n <= limit; ++n) {
    const int32_t b = runner_->graph_batch_bucket(n);
    if (b <= limit && (buckets.empty() || buckets.back() != b)) buckets.push_back(b);
  }
  // Ids from the top of the range, clear of callers' ids.
  const SeqId base = std::numeric_limits<SeqId>::max() - SeqId(limit) - 1;
  // One decode step of bucket b's sequences; false when the pool cannot hold them.
  const auto run_bucket = [&](int32_t b, const ForwardOptions& opts) -> absl::StatusOr<bool> {
    std::vector<StepItem> items;
    absl::Status st;
    for (int32_t i = 0; i < b && st.ok(); ++i) {
      st = add_sequence(base + SeqId(i), {int32_t(i % model_->spec().vocab)}, SamplingParams{});
      if (st.ok()) items.push_back(StepItem{base + SeqId(i), 1, true});
    }
    absl::StatusOr<std::vector<StepResult>> r =
        st.ok() ? step(items, opts) : absl::StatusOr<std::vector<StepResult>>(st);
    bool all_ok = r.ok();
    for (size_t i = 0; all_ok && i < r->size(); ++i) all_ok = (*r)[i].status.ok();
    for (const StepItem& it : items) (void)release(it.id);
    if (!r.ok()) return r.status();
    return all_ok;
  };
  // First every bucket's padded step eagerly, so that the lazily sized scratch buffers
  // (the split attention's partials grow with the bucket, not monotonically) reach their
  // largest size before any capture: a later bucket's growth would drop the graphs
  // captured before it, which point at the old buffers.
  ForwardOptions sizing = forward_options();
  sizing.graph_replay = false;
  for (int32_t b : buckets) {
    absl::StatusOr<bool> fits = run_bucket(b, sizing);
    if (!fits.ok()) return fits.status();
    if (!*fits) break;  // the pool cannot hold this bucket: larger ones neither
  }
  int warmed = 0;
  for (int32_t b : buckets) {
    absl::StatusOr<bool> fits = run_bucket(b, forward_options());
    if (!fits.ok()) return fits.status();
    if (!*fits) break;
    ++warmed;
  }
  return warmed;
}

absl::Status Engine::assume_computed(SeqId id, int32_t n) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  SequenceState& s = it->second;
  if (n < 0 || n >= s.num_pending()) {
    return absl::InvalidArgumentError(absl::StrCat("assume_computed: ", n, " of ", s.num_pending(),
                                                   " pending tokens (the last one must still run)"));
  }
  // In chunks of a step's budget, trimming the window between them, as a real chunked
  // prefill would: the SWA pool then holds a window plus one chunk, not the whole context.
  for (int32_t left = n; left > 0;) {
    const int32_t chunk = std::min(left, cfg_.max_batch_tokens);
    KVFUSE_RETURN_IF_ERROR(pool_->reserve(id, s.num_computed + chunk));
    s.num_computed += chunk;
    left -= chunk;
    pool_->trim_window(id);
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
