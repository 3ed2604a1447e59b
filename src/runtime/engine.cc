#include "src/runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/common/arith.h"
#include "src/common/status_macros.h"
#include "src/common/timing.h"
#include "src/loading/checkpoint.h"
#include "src/loading/kv_scales.h"
#include "src/runtime/memory_plan.h"
#include "src/runtime/rank_group.h"

namespace kvfuse {


Engine::Engine(Config cfg, std::unique_ptr<Backend> backend)
    : cfg_(std::move(cfg)),
      backend_(std::move(backend)),
      group_(std::make_unique<RankGroup>(cfg_, *backend_)) {}

Engine::~Engine() {
  // The followers and the other local ranks go first, then rank 0's runner and model
  // before the pool and rank 0's communicator (the group's) they use.
  group_->stop();
  runner_.reset();
  model_.reset();
  pool_.reset();
  group_.reset();
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
    e->group_->drop_links();
    return st;
  }
  e->seqs_ = std::make_unique<SequenceTable>(e->cfg_, *e->pool_, e->model_->spec().vocab);
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
    const absl::StatusOr<DeviceMemory> host = host_memory();
    const double available_gib = host.ok() ? double(host->free_bytes) / double(1 << 30) : -1.0;
    KVFUSE_RETURN_IF_ERROR(check_cpu_weight_memory(s, available_gib));
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
  // The prefix cache's chains start from the model's identity (the pool adds the KV format
  // and scales): hashes a router reads from two workers agree only for the same model.
  pc.prefix_cache = cfg_.prefix_cache;
  pc.prefix_cache_salt = prefix_cache_salt(absl::StrCat(
      s.name, "|", cfg_.model_path.empty() ? absl::StrCat("synthetic seed ", cfg_.seed) : cfg_.model_path, "|",
      s.vocab, " ", s.hidden, " ", s.intermediate, " ", s.num_layers, " ", s.num_q_heads, " ", s.num_kv_heads,
      " ", s.head_dim, "|rope ", s.rope_theta, " ", rope_type_name(s.rope_scaling.type), " ",
      s.rope_scaling.factor, "|", s.weight_format()));
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
  // Enough SWA pages for every running sequence, unless the config sizes the pool itself.
  const auto swa_pages = [&](int64_t pages) {
    return cfg_.swa_num_pages > 0
               ? cfg_.swa_num_pages
               : std::min<int64_t>(pages, KvPool::max_swa_pages_held(pc) * cfg_.max_running_seqs);
  };
  if (s.any_swa()) pc.swa_num_pages = swa_pages(std::max<int64_t>(pc.num_pages, 1));
  if (ckpt) {
    KVFUSE_RETURN_IF_ERROR(ckpt->check_shapes(s));
  }
  const std::unique_ptr<HostWeightSource> weights =
      ckpt ? ckpt->weights() : make_synthetic_weights(s, cfg_.seed);
  Clock::time_point load_start = Clock::now();
  auto after_layer = [&](int32_t done) {  // 0 as loading begins: the clock starts there
    if (done == 0) load_start = Clock::now();
    if (load_progress_) load_progress_(LoadProgress{done, s.num_layers, ms_since(load_start) / 1000.0});
  };
  if (cfg_.tensor_parallel > 1) {
    if (cfg_.num_pages == 0) {
      return absl::InvalidArgumentError(
          "num_pages 0 (as many pages as fit) needs tensor_parallel 1; at tensor_parallel > 1 give the pool's pages");
    }
    return init_ranks(s, pc, *weights, after_layer);
  }

  // One rank: the weights and the runner's workspaces go in first, then the pool takes
  // what the plan gives it (src/runtime/memory_plan.h). On a GPU the plan is checked
  // once before loading too, with the model's size, so that a pool that cannot fit fails
  // in seconds rather than after the weights.
  memory_.headroom_bytes = cfg_.memory_headroom_mib << 20;
  memory_.pool_auto = cfg_.num_pages == 0;
  const bool plan = memory_.pool_auto || backend_->device() != Device::cpu;
  absl::StatusOr<DeviceMemory> mem = backend_->device_memory();
  if (plan && !mem.ok()) return mem.status();
  if (plan) {
    const PoolBudget before{mem->free_bytes - s.weight_bytes(), memory_.headroom_bytes, s.weight_bytes(), 0,
                            mem->total_bytes, true};
    KVFUSE_RETURN_IF_ERROR(plan_pool_pages(pc, swa_pages, before, cfg_.num_pages).status());
  }
  if (!memory_.pool_auto) KVFUSE_RETURN_IF_ERROR(validate_kv_pool_config(pc));
  int64_t allocated = backend_->allocated_bytes();
  const auto allocated_since = [&] {
    const int64_t was = std::exchange(allocated, backend_->allocated_bytes());
    return allocated - was;
  };
  after_layer(0);
  auto model = Model::create(*backend_, s, *weights, after_layer);
  if (!model.ok()) return model.status();
  model_ = std::move(*model);
  memory_.weight_bytes = allocated_since();
  auto runner = ModelRunner::create(*backend_, *model_, model_limits(cfg_));
  if (!runner.ok()) return runner.status();
  runner_ = std::move(*runner);
  memory_.workspace_bytes = allocated_since();
  if (plan) {
    mem = backend_->device_memory();
    if (!mem.ok()) return mem.status();
    const PoolBudget now{mem->free_bytes, memory_.headroom_bytes, memory_.weight_bytes, memory_.workspace_bytes,
                         mem->total_bytes, false};
    auto pages = plan_pool_pages(pc, swa_pages, now, cfg_.num_pages);
    if (!pages.ok()) return pages.status();
    pc.num_pages = *pages;
    if (s.any_swa()) pc.swa_num_pages = swa_pages(pc.num_pages);
  }
  auto pool = KvPool::create(*backend_, pc);
  if (!pool.ok()) return pool.status();
  pool_ = std::move(*pool);
  memory_.kv_pool_bytes = allocated_since();
  note_device_memory();
  loaded_ = {allocated, memory_.device_free_bytes, memory_.workspace_bytes};
  return absl::OkStatus();
}

void Engine::note_device_memory() {
  const absl::StatusOr<DeviceMemory> mem = backend_->device_memory();
  if (!mem.ok()) return;
  memory_.device_total_bytes = mem->total_bytes;
  memory_.device_free_bytes = mem->free_bytes;
}

absl::Status Engine::init_ranks(const ModelSpec& s, KvPoolConfig& pc, HostWeightSource& weights,
                                const std::function<void(int32_t)>& after_layer) {
  KVFUSE_RETURN_IF_ERROR(group_->form(s, pc));
  // One pool of pages; each local rank's storage holds its KV heads.
  pc.num_kv_heads = group_->shard().num_kv_heads;
  auto pool = KvPool::create_shared(pc, group_->num_local_ranks());
  if (!pool.ok()) return pool.status();
  pool_ = std::move(*pool);
  auto model = group_->add_models(s, *pool_);
  if (!model.ok()) return model.status();
  model_ = std::move(*model);
  after_layer(0);
  auto runner = group_->load_weights(weights, after_layer);
  if (!runner.ok()) return runner.status();
  runner_ = std::move(*runner);
  return absl::OkStatus();
}

// Tensor parallelism: the group's.
int32_t Engine::num_local_ranks() const { return group_->num_local_ranks(); }
Backend& Engine::rank_backend(int32_t local_rank) { return group_->backend(local_rank); }
bool Engine::is_follower() const { return group_->is_follower(); }
absl::Status Engine::follow() { return group_->follow(*pool_, batch_, fwd_); }
const absl::Status& Engine::group_failure() const { return group_->failure(); }
const std::string& Engine::collectives_path() const { return group_->collectives_path(); }
const std::string& Engine::collectives_library() const { return group_->collectives_library(); }
absl::StatusOr<bool> Engine::end_gemm_tuning() { return group_->end_gemm_tuning(); }
int64_t Engine::gemm_shapes_timed() const { return backend_->gemm_shapes_timed(); }
absl::StatusOr<double> Engine::collectives_ms(int32_t tokens, int reps) {
  return group_->collectives_ms(tokens, reps);
}
bool Engine::single_rank() const { return group_->single_rank(); }

absl::Status Engine::check_no_step_in_flight() const {
  if (in_flight_.active) return absl::FailedPreconditionError("a step is in flight (end_step first)");
  return absl::OkStatus();
}

absl::Status Engine::add_sequence(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling,
                                  const Rng* rng, bool reuse_prefix) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  KVFUSE_RETURN_IF_ERROR(seqs_->add(id, std::move(prompt), sampling, SequenceOwner::router));
  if (rng) seqs_->get(id)->rng = *rng;
  if (absl::Status st = seqs_->admit(id, reuse_prefix); !st.ok()) {
    (void)seqs_->release(id);
    return st;
  }
  return absl::OkStatus();
}

absl::Status Engine::append_tokens(SeqId id, const std::vector<int32_t>& tokens) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  return seqs_->append(id, tokens);
}

absl::Status Engine::release(SeqId id) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  return seqs_->release(id);
}

absl::StatusOr<std::vector<StepResult>> Engine::step(const std::vector<StepItem>& items) {
  return step(items, forward_options());
}

absl::StatusOr<std::vector<StepResult>> Engine::step(const std::vector<StepItem>& items,
                                                     const ForwardOptions& opts) {
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  // The caller planned these items itself: bad items reject the step before anything
  // changes; then their pages are reserved here, and a sequence that cannot get them
  // fails alone.
  StepPlan plan;
  plan.items = items;
  plan.options = opts;
  KVFUSE_RETURN_IF_ERROR(check_plan(plan, /*require_reserved=*/false));
  std::vector<StepResult> results(items.size());
  std::vector<size_t> run;
  plan.items.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    results[i].id = items[i].id;
    results[i].status = seqs_->reserve(items[i].id, items[i].num_tokens);
    if (!results[i].status.ok()) continue;
    run.push_back(i);
    plan.items.push_back(items[i]);
  }
  if (plan.items.empty()) return results;  // none could get its pages
  KVFUSE_RETURN_IF_ERROR(begin(plan));
  auto out = end();
  if (!out.ok()) return out.status();
  for (size_t r = 0; r < run.size(); ++r) results[run[r]] = std::move(out->results[r]);
  return results;
}

absl::Status Engine::begin(const StepPlan& plan) {
  if (is_follower()) {
    return absl::FailedPreconditionError("step: this process follows rank 0, whose engine runs the steps");
  }
  if (!group_->failure().ok()) return group_->failure();  // a rank failed earlier: nothing runs any more
  KVFUSE_RETURN_IF_ERROR(check_no_step_in_flight());
  InFlight& f = in_flight_;
  f.t0 = Clock::now();
  timings_ = StepTimings{};
  KVFUSE_RETURN_IF_ERROR(check_plan(plan, /*require_reserved=*/true));
  f.items = plan.items;
  build_batch(plan.items);
  timings_.prepare_ms = ms_since(f.t0);
  f.t1 = Clock::now();
  // One rank: queue the pass and return; end() waits. Several: every rank's thread runs
  // its pass to the end (they meet in the collectives), here.
  const absl::Status st = single_rank() ? runner_->launch(batch_, *pool_, plan.options, fwd_)
                                        : group_->forward(batch_, *pool_, plan.options, fwd_);
  if (!st.ok()) return absl::InternalError(absl::StrCat("forward pass failed: ", st.message()));
  f.active = true;
  return absl::OkStatus();
}

absl::StatusOr<StepOutput> Engine::end() {
  if (!in_flight_.active) return absl::FailedPreconditionError("no step in flight (begin first)");
  InFlight& f = in_flight_;
  f.active = false;
  if (single_rank()) {
    if (auto st = runner_->finish(batch_, fwd_); !st.ok()) {
      return absl::InternalError(absl::StrCat("forward pass failed: ", st.message()));
    }
  }
  timings_.forward_ms = ms_since(f.t1);

  StepOutput out;
  const auto t2 = Clock::now();
  apply_results(f.items, out.results);
  timings_.sample_ms = ms_since(t2);
  timings_.total_ms = ms_since(f.t0);
  timings_.num_tokens = batch_.num_tokens();
  timings_.num_seqs = int32_t(f.items.size());
  timings_.graph = fwd_.graph;
  out.timings = timings_;
  return out;
}

absl::Status Engine::check_plan(const StepPlan& plan, bool require_reserved) const {
  const std::vector<StepItem>& items = plan.items;
  if (items.empty()) return absl::InvalidArgumentError("step: no items");
  if (int64_t(items.size()) > cfg_.max_running_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", items.size(), " sequences exceed max_running_seqs ", cfg_.max_running_seqs));
  }
  std::unordered_set<SeqId> seen;
  int64_t total = 0;
  for (const StepItem& it : items) {
    const Sequence* s = seqs_->get(it.id);
    if (!s) return absl::NotFoundError(absl::StrCat("step: sequence ", it.id, " not found"));
    if (!s->admitted) {
      return absl::FailedPreconditionError(absl::StrCat("step: sequence ", it.id, " holds no pages (not admitted)"));
    }
    if (!seen.insert(it.id).second)
      return absl::InvalidArgumentError(absl::StrCat("step: sequence ", it.id, " twice"));
    const int32_t pending = s->num_pending();
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
    if (it.sample && int64_t(s->tokens.size()) >= cfg_.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: sequence ", it.id, " is at max_seq_len ", cfg_.max_seq_len));
    }
    // Pages are reserved by whoever planned the step (the scheduler, or step()).
    if (require_reserved && !seqs_->reserved(it.id, it.num_tokens)) {
      return absl::FailedPreconditionError(
          absl::StrCat("step: sequence ", it.id, "'s KV pages for ", it.num_tokens, " tokens are not reserved"));
    }
    total += it.num_tokens;
  }
  if (total > cfg_.max_batch_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", total, " tokens exceed max_batch_tokens ", cfg_.max_batch_tokens));
  }
  return absl::OkStatus();
}

void Engine::build_batch(const std::vector<StepItem>& items) {
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
  b.adjust_start.assign(1, 0);
  b.adjust.clear();
  b.logprobs.clear();
  b.extra_rows.clear();
  b.extra_logprobs.clear();
  extra_count_.clear();
  bool any_logprobs = false;
  b.max_query_len = 0;
  b.max_context_len = 0;
  for (const StepItem& it : items) {
    const int32_t ctx = seqs_->get(it.id)->num_computed + it.num_tokens;
    b.max_context_len = std::max(b.max_context_len, ctx);
    b.max_query_len = std::max(b.max_query_len, it.num_tokens);
  }
  b.max_pages_per_seq = int32_t(ceil_div(b.max_context_len, ps));
  b.block_table_full.assign(items.size() * size_t(b.max_pages_per_seq), -1);
  b.block_table_swa.assign(pool_->has_swa() ? b.block_table_full.size() : 0, -1);
  for (size_t r = 0; r < items.size(); ++r) {
    const StepItem& it = items[r];
    Sequence& s = *seqs_->get(it.id);
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
        rs.min_p = s.sampling.min_p;
        rs.u = s.rng.uniform();  // one draw per sampled token, as sample_token
      }
      b.sampling.push_back(rs);
      if (it.sample && s.processors.active()) {
        const auto& e = s.processors.entries();
        b.adjust.insert(b.adjust.end(), e.begin(), e.end());
      }
      b.adjust_start.push_back(int32_t(b.adjust.size()));
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
  if (b.adjust.empty()) b.adjust_start.clear();  // no row has processors: nothing to run
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

void Engine::apply_results(const std::vector<StepItem>& items, std::vector<StepResult>& results) {
  results.assign(items.size(), StepResult{});
  size_t row = 0, host_row = 0, extra = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    Sequence& s = *seqs_->get(it.id);
    results[i].id = it.id;
    for (size_t e = 0; e < extra_count_[i]; ++e) {
      results[i].prompt_logprobs.push_back(to_token_logprob(fwd_.extra_logprobs[extra++]));
    }
    seqs_->computed(s, it.num_tokens);
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
    s.processors.add_output_token(tok);
    results[i].token = tok;
    if (it.logprobs) results[i].logprob = to_token_logprob(fwd_.logprobs[k]);
  }
}

absl::StatusOr<int> Engine::warm_up_decode_graphs() {
  if (is_follower()) return absl::FailedPreconditionError("warm_up_decode_graphs: rank 0's process runs it");
  if (cfg_.graphs != GraphsMode::on || !backend_->supports_graphs()) return 0;
  absl::StatusOr<int> warmed = warm_up_buckets();
  // What the steps since loading cost in memory (rank 0's device): the scratch they grew
  // counts as workspace; what the device lost beyond that went to the graphs and the
  // libraries (cuBLASLt's workspaces, say).
  const int64_t grown = backend_->allocated_bytes() - loaded_.allocated;
  memory_.workspace_bytes = loaded_.workspace + grown;
  note_device_memory();
  if (loaded_.free > 0) memory_.graph_bytes = std::max<int64_t>(0, loaded_.free - memory_.device_free_bytes - grown);
  return warmed;
}

absl::StatusOr<int> Engine::warm_up_buckets() {
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
  Sequence* found = seqs_->get(id);
  if (!found) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  Sequence& s = *found;
  if (n < 0 || n >= s.num_pending()) {
    return absl::InvalidArgumentError(absl::StrCat("assume_computed: ", n, " of ", s.num_pending(),
                                                   " pending tokens (the last one must still run)"));
  }
  // In chunks of a step's budget, trimming the window between them, as a real chunked
  // prefill would: the SWA pool then holds a window plus one chunk, not the whole context.
  for (int32_t left = n; left > 0;) {
    const int32_t chunk = std::min(left, cfg_.max_batch_tokens);
    KVFUSE_RETURN_IF_ERROR(seqs_->reserve(id, chunk));
    seqs_->computed(s, chunk);
    left -= chunk;
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
