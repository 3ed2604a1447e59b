// kvfuse-bench-engine: the engine's decode step against batch size and context length,
// for one model, with the achieved bandwidth and the ratio to the memory roofline
// (the weights as stored, bf16 or FP8, + attended KV read once per step at a peak bandwidth). Every cell runs
// each variant (attention unified | split x graphs off | on, and with --kv-write each KV
// write path: the unfused / fused / fused_rope A/B in one engine) interleaved, in rotating
// order, after a warm-up that covers graph capture; the output is a table, JSON and SVG.
// On the CPU backend graphs do nothing (only graphs off runs) and there is no memory
// roofline unless --peak-gbs names a bandwidth: without it, no roofline figures.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "absl/strings/str_format.h"
#include "bench/ab/ab_stats.h"
#include "bench/ab/progress.h"
#include "bench/common/peak_bandwidth.h"
#include "bench/engine/engine_cells.h"
#include "bench/engine/roofline.h"
#include "bench/synthetic_cell.h"
#include "src/common/status_macros.h"
#include "src/loading/config.h"
#include "src/loading/int_list.h"
#include "src/runtime/engine.h"

using namespace kvfuse;
using namespace kvfuse::bench;
using nlohmann::json;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "\nkvfuse-bench-engine: %s\n", msg.c_str());
  return 2;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> v;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) v.push_back(item);
  }
  return v;
}

// A paired comparison of two variants of one cell: mean of the per-repetition step-time
// ratios num/den, with its 95% interval.
struct Comparison {
  std::string name;
  int num = 0, den = 0;  // variant indices
};
MeanCi compare(const Cell& c, const Comparison& k) {
  std::vector<double> r;
  for (size_t i = 0; i < c.s[size_t(k.num)].size(); ++i)
    r.push_back(c.s[size_t(k.num)][i].step_ms / c.s[size_t(k.den)][i].step_ms);
  return mean_ci(r);
}

// `steps` decode steps of every sequence, timed between two device synchronizations.
absl::StatusOr<double> decode_ms(Engine& e, const std::vector<StepItem>& items, int steps,
                                 const ForwardOptions& opts) {
  KVFUSE_RETURN_IF_ERROR(e.backend().synchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    auto r = e.step(items, opts);
    if (!r.ok()) return r.status();
    for (const auto& x : *r) {
      if (!x.status.ok())
        return absl::Status(x.status.code(), absl::StrFormat("sequence %d: %s", x.id, x.status.message()));
    }
  }
  KVFUSE_RETURN_IF_ERROR(e.backend().synchronize());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string now_iso8601() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvfuse-bench-engine: decode step time against batch size and context length, and its "
      "ratio to the memory roofline, for eager/graphs and unified/split attention"};
  std::string config_path, batches = "1,8,32,64,128,256", contexts = "512,2048,8192,32768";
  std::string attn_list = "unified,split", graphs_list = "off,on", write_list, json_path, svg_path, title;
  std::vector<std::string> overrides;
  int steps = 8, reps = 5, warmup = 2;
  double peak_flag = 0, max_kv_gib = -1;
  bool rank_alone = false;
  app.add_option("--config", config_path, "engine config JSON (default: the built-in defaults)");
  app.add_option("-s,--set", overrides, "override a config key: key=value (repeatable)");
  app.add_option("--batch", batches, "batch sizes, comma-separated")->capture_default_str();
  app.add_option("--context", contexts, "context lengths, comma-separated")->capture_default_str();
  app.add_option("--attention", attn_list, "attention paths: unified,split")->capture_default_str();
  app.add_option("--graphs", graphs_list,
                 "graph modes: off,on (graphs have no effect on the CPU backend: there only off runs)")
      ->capture_default_str();
  app.add_option(
      "--kv-write", write_list,
      "KV write paths: unfused,fused,fused_rope, each a variant (default: the config's kv_write alone)");
  app.add_option("--steps", steps, "decode steps per repetition")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--reps", reps, "measured repetitions per variant and cell (>= 3)")
      ->check(CLI::Range(3, 1000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "unmeasured repetitions first (>= 1 with graphs on)")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app.add_option("--peak-gbs", peak_flag,
                 std::string(kPeakGbsHelp) +
                     "; on the CPU backend none: no roofline figures unless this option is given")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-kv-gib", max_kv_gib,
                 "KV budget in GiB; bigger cells are skipped (default 100 on a GPU, 2 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--tp-rank-alone", rank_alone,
               "with tensor_parallel >= 2: rank 0 alone on one device, its shard's kernels only; every "
               "collective left out (what a rank computes, on a machine of one GPU; logits meaningless)");
  app.add_option("--json", json_path, "write every figure as JSON");
  app.add_option("--svg", svg_path, "write the plot as SVG");
  app.add_option("--title", title, "plot title (default: the model and the device)");
  CLI11_PARSE(app, argc, argv);
  std::string cmdline;
  for (int i = 0; i < argc; ++i) cmdline += (i ? " " : "") + std::string(argv[i]);

  auto bl = parse_int_list(batches), cl = parse_int_list(contexts);
  if (!bl.ok() || !cl.ok()) return fail("--batch and --context take comma-separated integers");
  const std::vector<int> bs = *std::move(bl), cs = *std::move(cl);
  if (bs.empty() || cs.empty()) return fail("--batch and --context need at least one value each");
  if (*std::min_element(bs.begin(), bs.end()) < 1) return fail("batch sizes must be >= 1");
  if (*std::min_element(cs.begin(), cs.end()) < 2) return fail("context lengths must be >= 2");
  // Write paths: parsed as the config key is, so a bad name gets the key's message.
  std::vector<KvWritePath> writes;
  for (const auto& w : split_list(write_list)) {
    auto c = config_from_json(json{{"kv_write", w}});
    if (!c.ok()) return fail("--kv-write: " + std::string(c.status().message()));
    if (std::find(writes.begin(), writes.end(), c->kv_write) == writes.end()) writes.push_back(c->kv_write);
  }
  if (!write_list.empty() && writes.empty()) return fail("--kv-write needs at least one value");
  // The variants are made once the device is known (graphs off alone on the CPU).
  std::vector<AttentionPath> attns;
  std::vector<bool> graph_modes;
  for (const auto& a : split_list(attn_list)) {
    if (a != "unified" && a != "split")
      return fail("--attention takes unified and/or split, got '" + a + "'");
    attns.push_back(a == "split" ? AttentionPath::split : AttentionPath::unified);
  }
  for (const auto& g : split_list(graphs_list)) {
    if (g != "off" && g != "on") return fail("--graphs takes off and/or on, got '" + g + "'");
    graph_modes.push_back(g == "on");
  }
  if (attns.empty() || graph_modes.empty())
    return fail("--attention and --graphs need at least one value each");

  json j = json::object();
  if (!config_path.empty()) {
    std::ifstream in(config_path);
    if (!in) return fail("cannot open config file " + config_path);
    j = json::parse(in, nullptr, false, true);
    if (j.is_discarded() || !j.is_object()) return fail(config_path + " is not a JSON object");
  }
  // KVFUSE_<KEY> variables, as every kvfuse program takes them: over the file, under --set
  // and --kv-write.
  if (auto st = apply_config_env(j); !st.ok()) return fail(std::string(st.message()));
  for (const auto& o : overrides) {
    if (auto st = apply_config_override(j, o); !st.ok()) return fail(std::string(st.message()));
  }
  if (writes.size() == 1) {  // one path: the engine's own, as --set kv_write would make it
    if (auto st = apply_config_override(j, std::string("kv_write=") + to_string(writes[0])); !st.ok())
      return fail(std::string(st.message()));
  }
  auto base = config_from_json(j);
  if (!base.ok()) return fail(std::string(base.status().message()));
  auto spec_or = resolve_model_spec(*base);
  if (!spec_or.ok()) return fail(std::string(spec_or.status().message()));
  const ModelSpec spec = *spec_or;
  // Byte counts and KV footprints are one GPU's: its rank's shapes under tensor parallelism.
  const int tp = base->tensor_parallel;
  if (rank_alone && tp < 2)
    return fail("--tp-rank-alone needs tensor_parallel >= 2 (--set tensor_parallel=N)");
  auto rank_or = rank_shapes(spec, tp);
  if (!rank_or.ok()) return fail(std::string(rank_or.status().message()));
  const ModelSpec rank_spec = *rank_or;
  const int elem = base->kv_cache_dtype == KvCacheDtype::bf16 ? 2 : 1;
  const int ps = base->page_size;
  auto backend = make_backend(base->device, base->tp_device(0));
  if (!backend.ok()) return fail(std::string(backend.status().message()));
  const bool gpu = (*backend)->device() != Device::cpu;
  if (!gpu && std::find(graph_modes.begin(), graph_modes.end(), true) != graph_modes.end()) {
    // Graphs do nothing on the CPU: "on" would time the same steps as "off" again.
    if (app.count("--graphs"))
      std::printf(
          "kvfuse-bench-engine: --graphs on: graphs have no effect on the CPU backend; running graphs off "
          "only\n");
    graph_modes = {false};
  }
  const std::vector<Variant> vars = make_variants(attns, graph_modes, writes, base->kv_write);
  const bool any_graphs = std::any_of(vars.begin(), vars.end(), [](const Variant& v) { return v.graphs; });
  if (any_graphs && warmup < 1)
    return fail("--warmup must be >= 1 with --graphs on: the first step captures a graph");
  if (max_kv_gib <= 0) max_kv_gib = gpu ? 100 : 2;
  double budget = max_kv_gib * double(int64_t(1) << 30);

  // Sequences grow by one token per decode step of every variant and repetition.
  const int V = int(vars.size());
  const int total_steps = (warmup + reps) * V * steps;
  const int grow = total_steps + 2;
  const int max_b = *std::max_element(bs.begin(), bs.end());
  const int mbt = std::max(max_b, j.value("max_batch_tokens", base->max_batch_tokens));
  const int max_len_limit = std::min(spec.max_position, 1048576);
  std::vector<Cell> cells;
  for (int b : bs) {
    for (int c : cs) {
      Cell cell;
      cell.batch = b;
      cell.context = c;
      cell.fp = kv_footprint(rank_spec, ps, elem, b, int64_t(c) + grow, mbt);
      if (int64_t(c) + grow > max_len_limit)
        cell.skip = absl::StrFormat("skipped: context %d + %d decode steps exceeds %s's max position %d", c,
                                    total_steps, spec.name, max_len_limit);
      cells.push_back(cell);
    }
  }

  // One engine sized for the largest cells under the KV budget; if it cannot be created
  // for lack of memory, the budget halves below the largest cell and it tries again.
  std::unique_ptr<Engine> engine;
  json used;
  std::string create_error;  // of the last failed attempt
  for (;;) {
    int fb = 0, fc = 0;
    int64_t full_pages = 0, swa_pages = 0;
    double biggest = 0;
    for (Cell& cell : cells) {
      if (!cell.skip.empty()) continue;
      const double gib = double(cell.fp.bytes) / double(int64_t(1) << 30);
      if (double(cell.fp.bytes) > budget) {
        cell.skip = absl::StrFormat("skipped: needs %.2f GiB of KV (budget %.2f GiB)", gib,
                                    budget / double(int64_t(1) << 30));
        continue;
      }
      fb = std::max(fb, cell.batch);
      fc = std::max(fc, cell.context);
      full_pages = std::max(full_pages, cell.fp.full_pages);
      swa_pages = std::max(swa_pages, cell.fp.swa_pages);
      biggest = std::max(biggest, double(cell.fp.bytes));
    }
    if (fb == 0) {
      for (const Cell& cell : cells)
        std::printf("batch %d context %d: %s\n", cell.batch, cell.context, cell.skip.c_str());
      if (!create_error.empty()) return fail("cannot create the engine: " + create_error);
      return fail("no cell fits (see --max-kv-gib, --context)");
    }
    used = j;
    used["max_running_seqs"] = std::max(fb, j.value("max_running_seqs", 1));
    used["max_batch_tokens"] = mbt;
    used["max_seq_len"] = std::max(fc + grow, j.value("max_seq_len", 2));
    used["num_pages"] = std::max(full_pages, j.value("num_pages", int64_t(1)));
    if (spec.any_swa()) used["swa_num_pages"] = std::max(swa_pages, j.value("swa_num_pages", int64_t(0)));
    auto cfg = config_from_json(used);
    if (!cfg.ok()) return fail(std::string(cfg.status().message()));
    cfg->tp_rank_alone = rank_alone;
    std::fprintf(stderr,
                 "kvfuse-bench-engine: building engine (%s, %s KV, %.3f GiB of KV pages, weights generated: "
                 "this can take a while)...\n",
                 spec.name.c_str(), to_string(cfg->kv_cache_dtype),
                 double(kv_pool_bytes(rank_spec, ps, elem, used["num_pages"].get<int64_t>(),
                                      spec.any_swa() ? used["swa_num_pages"].get<int64_t>() : 0)) /
                     double(int64_t(1) << 30));
    const auto t0 = std::chrono::steady_clock::now();
    auto e = Engine::create(*cfg, std::move(*backend), load_progress_every(15, [](const LoadProgress& p) {
      if (p.layers_done > 0 && p.layers_done < p.layers) {
        std::fprintf(stderr, "kvfuse-bench-engine: loading weights, %d of %d layers (%.0f s)\n",
                     p.layers_done, p.layers, p.elapsed_s);
      }
    }));
    if (e.ok()) {
      engine = std::move(*e);
      std::fprintf(stderr, "kvfuse-bench-engine: engine ready in %.1f s; %s\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                   engine->num_ranks() == 1 ? describe_memory(engine->memory()).c_str() : "tensor parallel");
      break;
    }
    if (e.status().code() != absl::StatusCode::kResourceExhausted)
      return fail(std::string(e.status().message()));
    create_error = std::string(e.status().message());
    budget = biggest * 0.5;
    std::fprintf(stderr,
                 "kvfuse-bench-engine: engine creation failed (%s); retrying with a KV budget of %.2f GiB\n",
                 std::string(e.status().message()).c_str(), budget / double(int64_t(1) << 30));
    backend = make_backend(base->device, base->tp_device(0));
    if (!backend.ok()) return fail(std::string(backend.status().message()));
  }
  Engine& e = *engine;
  // What the header, the JSON and the plot name as the write: the one path, or the list.
  std::string write_names;
  std::vector<KvWritePath> named;
  for (const Variant& v : vars) {
    if (std::find(named.begin(), named.end(), v.write) != named.end()) continue;
    named.push_back(v.write);
    write_names += (write_names.empty() ? "" : ",") + std::string(to_string(v.write));
  }
  const int64_t weight_bytes = decode_weight_bytes(rank_spec);
  // The backend's description names the device ("cuda NVIDIA H200 (sm_90, 140 GiB)"). The
  // CPU has no peak of its own: a roofline there only against --peak-gbs.
  const bool roofline = gpu || app.count("--peak-gbs") > 0;
  const PeakBandwidth peak =
      roofline
          ? resolve_peak_by_name(e.backend().description(),
                                 app.count("--peak-gbs") ? std::optional<double>(peak_flag) : std::nullopt)
          : PeakBandwidth{0, "none: the CPU backend has no peak bandwidth of its own (--peak-gbs gives one)"};
  const double peak_gbs = peak.gbs;  // 0 without a roofline: figures() leaves its figures NaN
  std::printf(
      "kvfuse-bench-engine: model %s (weights %s) on %s, kv %s, %s write; %d reps (+%d warm-up) of %d decode "
      "steps per variant and cell\n",
      spec.name.c_str(), spec.weight_format().c_str(), e.backend().description().c_str(),
      kv_format_name(e.kv_format()), write_names.c_str(), reps, warmup, steps);
  if (roofline) {
    std::printf("roofline: (%.3f GB of %s weights + KV attended) per step at a peak of %.0f GB/s (%s)\n",
                double(weight_bytes) / 1e9, spec.weight_format().c_str(), peak_gbs, peak.source.c_str());
  } else {
    std::printf("no memory roofline on the CPU backend (--peak-gbs N computes one against N GB/s)\n");
  }
  if (tp > 1 && e.rank_alone()) {
    std::printf(
        "tensor_parallel %d, rank 0 alone (--tp-rank-alone): its shard of the weights and its KV heads on "
        "one "
        "device, no other rank; the step's %d all-reduces and the logits gather are left out, so a step "
        "here is a rank's own work, without the collectives it would wait for in a group\n",
        tp, 2 * spec.num_layers);
  } else if (tp > 1) {
    std::printf(
        "tensor_parallel %d: %d ranks; byte counts and the roofline are one GPU's (its shard of the weights, its "
        "KV heads); each step runs %d all-reduces of batch x %d bf16 and one all-gather of the logits\n",
        tp, e.num_ranks(), 2 * spec.num_layers, spec.hidden);
    std::printf("collectives: %s\n", e.collectives_path().c_str());
    if (!e.collectives_library().empty())
      std::printf("collectives library: %s\n", e.collectives_library().c_str());
  }
  for (const Cell& cell : cells) {
    if (!cell.skip.empty())
      std::printf("batch %d context %d: %s\n", cell.batch, cell.context, cell.skip.c_str());
  }

  const size_t n_run =
      size_t(std::count_if(cells.begin(), cells.end(), [](const Cell& c) { return c.skip.empty(); }));
  size_t done = 0;
  SeqId next_id = 1;
  bench::Progress progress(stderr);
  for (Cell& cell : cells) {
    if (!cell.skip.empty()) continue;
    ++done;
    const int b = cell.batch;
    cell.s.assign(vars.size(), {});
    if (auto st = bench::start_synthetic_cell(e, b, cell.context, next_id,
                                              ForwardOptions{vars[0].write, AttentionPath::unified, false});
        !st.ok()) {
      return fail(
          absl::StrFormat("batch %d context %d: starting the sequences: %s", b, cell.context, st.message()));
    }
    std::vector<StepItem> items;
    for (int i = 0; i < b; ++i) items.push_back({next_id + SeqId(i), 1, true});
    for (int r = 0; r < warmup + reps; ++r) {
      for (int i = 0; i < V; ++i) {
        const int v = (r + i) % V;  // rotating order: drift affects every variant alike
        progress.update(
            absl::StrFormat("kvfuse-bench-engine: cell %zu/%zu (batch %d, context %d)", done, n_run, b,
                            cell.context),
            absl::StrFormat("%-14s %s %d/%d", vars[size_t(v)].name(), r < warmup ? "warm-up" : "rep",
                            r < warmup ? r + 1 : r - warmup + 1, r < warmup ? warmup : reps));
        const int64_t ctx0 = e.sequence(next_id)->num_computed + 1;  // keys the first step attends
        const Variant& var = vars[size_t(v)];
        auto ms = decode_ms(e, items, steps, ForwardOptions{var.write, var.attention, var.graphs});
        if (!ms.ok()) {
          return fail(absl::StrFormat("batch %d context %d %s: decode step failed: %s", b, cell.context,
                                      vars[size_t(v)].name(), ms.status().ToString()));
        }
        if (r < warmup) continue;
        Sample smp;
        smp.step_ms = *ms / steps;
        for (int t = 0; t < steps; ++t) {
          const double kv = double(b) * double(decode_kv_bytes_per_seq(rank_spec, ctx0 + t, elem));
          smp.kv_bytes += kv / steps;
          smp.bytes += (double(weight_bytes) + kv) / steps;
        }
        smp.context = double(ctx0) + (steps - 1) / 2.0;
        cell.s[size_t(v)].push_back(smp);
      }
    }
    if (tp > 1 && !e.rank_alone()) {
      // The same collectives alone, as the step's graphs run them.
      auto cm = e.collectives_ms(b, std::max(reps * steps, 10));
      if (!cm.ok()) return fail(absl::StrFormat("batch %d: timing the collectives: %s", b, cm.status().ToString()));
      cell.collectives_ms = *cm;
    }
    for (int i = 0; i < b; ++i) {
      if (auto st = e.release(next_id + SeqId(i)); !st.ok()) return fail(std::string(st.message()));
    }
    next_id += SeqId(b);
  }
  progress.finish();

  // Comparisons: graphs speedup (eager / graphs step time) per attention path, and
  // split / unified step time per graph mode, where both variants ran (with several write
  // paths, for the reference path, fused if it ran, named in the comparison); then each
  // other write path's step time against the reference's per attention path and graph mode.
  std::vector<Comparison> comps;
  auto find = [&](AttentionPath a, bool g, KvWritePath w) {
    for (int v = 0; v < V; ++v) {
      const Variant& x = vars[size_t(v)];
      if (x.attention == a && x.graphs == g && x.write == w) return v;
    }
    return -1;
  };
  const KvWritePath ref_write = std::find(writes.begin(), writes.end(), KvWritePath::fused) != writes.end()
                                    ? KvWritePath::fused
                                    : vars[0].write;
  const std::string of_ref = writes.size() > 1 ? std::string(" ") + to_string(ref_write) : "";
  for (AttentionPath a : {AttentionPath::unified, AttentionPath::split}) {
    if (find(a, false, ref_write) >= 0 && find(a, true, ref_write) >= 0)
      comps.push_back({std::string("graphs speedup ") + to_string(a) + of_ref, find(a, false, ref_write),
                       find(a, true, ref_write)});
  }
  for (bool g : {false, true}) {
    if (find(AttentionPath::split, g, ref_write) >= 0 && find(AttentionPath::unified, g, ref_write) >= 0)
      comps.push_back({std::string("split/unified ") + (g ? "graphs" : "eager") + of_ref,
                       find(AttentionPath::split, g, ref_write), find(AttentionPath::unified, g, ref_write)});
  }
  for (KvWritePath w : writes) {
    if (w == ref_write) continue;
    for (AttentionPath a : {AttentionPath::unified, AttentionPath::split}) {
      for (bool g : {false, true}) {
        if (find(a, g, w) >= 0 && find(a, g, ref_write) >= 0)
          comps.push_back({absl::StrFormat("%s/%s %s %s", to_string(w), to_string(ref_write), to_string(a),
                                           g ? "graphs" : "eager"),
                           find(a, g, w), find(a, g, ref_write)});
      }
    }
  }

  int name_w = 15, comp_w = 22;
  for (const Variant& v : vars) name_w = std::max(name_w, int(v.name().size()));
  for (const auto& k : comps) comp_w = std::max(comp_w, int(k.name.size()));
  if (roofline) {
    std::printf("\n%6s %8s  %-*s %10s %9s %11s %9s %7s %11s %10s\n", "batch", "context", name_w, "variant",
                "step ms", "ci95 ms", "tok/s", "GB/s", "%peak", "roofline ms", "x roofline");
  } else {
    std::printf("\n%6s %8s  %-*s %10s %9s %11s %9s\n", "batch", "context", name_w, "variant", "step ms",
                "ci95 ms", "tok/s", "GB/s");
  }
  for (const Cell& cell : cells) {
    if (!cell.skip.empty()) continue;
    for (int v = 0; v < V; ++v) {
      const Figures f = figures(cell.s[size_t(v)], cell.batch, peak_gbs);
      std::printf("%6d %8d  %-*s %10.3f %9.3f %11.1f %9.2f", cell.batch, cell.context, name_w,
                  vars[size_t(v)].name().c_str(), f.step_ms, f.ci_ms, f.tokens_per_s, f.gbs);
      if (roofline) std::printf(" %7.3f %11.4f %10.2f", 100 * f.frac_peak, f.roofline_ms, f.ratio);
      std::printf("\n");
    }
  }
  if (!comps.empty()) {
    std::printf("\n%6s %8s", "batch", "context");
    for (const auto& k : comps) std::printf("  %*s", comp_w, k.name.c_str());
    std::printf("\n");
    for (const Cell& cell : cells) {
      if (!cell.skip.empty()) continue;
      std::printf("%6d %8d", cell.batch, cell.context);
      for (const auto& k : comps) {
        const MeanCi m = compare(cell, k);
        std::printf("  %*.4f ± %6.4f", comp_w - 9, m.mean, m.half);
      }
      std::printf("\n");
    }
    // The CPU runs no graphs, so has no graphs speedup to explain.
    std::printf(
        "(%ssplit/unified: step time ratio, < 1: split faster; a/b of write paths: step time ratio, < 1: a "
        "faster; ± is the 95%% interval over paired repetitions)\n",
        gpu ? "graphs speedup: eager / graphs step time, > 1: graphs faster; " : "");
  }

  if (tp > 1 && !e.rank_alone()) {
    std::printf("\n%6s %8s  %18s  %s\n", "batch", "context", "collectives ms", "share of each variant's step");
    for (const Cell& cell : cells) {
      if (!cell.skip.empty()) continue;
      std::printf("%6d %8d  %18.3f ", cell.batch, cell.context, cell.collectives_ms);
      for (int v = 0; v < V; ++v) {
        const Figures f = figures(cell.s[size_t(v)], cell.batch, peak_gbs);
        std::printf(" %s %.1f%%", vars[size_t(v)].name().c_str(), 100 * cell.collectives_ms / f.step_ms);
      }
      std::printf("\n");
    }
    std::printf("(collectives: the step's %d all-reduces and logits gather alone, back to back%s; %s)\n",
                2 * spec.num_layers, gpu ? " in a graph" : "", e.collectives_path().c_str());
  }

  const std::string device = e.backend().description();
  if (!json_path.empty()) {
    json out;
    out["meta"] = {{"program", "kvfuse-bench-engine"},
                   {"model", spec.name},
                   {"weights", spec.weight_format()},
                   {"device", device},
                   {"kv_dtype", kv_format_name(e.kv_format())},
                   {"kv_write", write_names},
                   {"steps", steps},
                   {"reps", reps},
                   {"warmup", warmup},
                   {"peak_gbs", roofline ? json(peak_gbs) : json(nullptr)},
                   {"peak_source", peak.source},
                   {"max_kv_gib", max_kv_gib},
                   {"weight_bytes", weight_bytes},
                   {"tensor_parallel", tp},
                   {"tp_rank_alone", rank_alone},
                   {"collectives", e.collectives_path()},
                   {"date", now_iso8601()},
                   {"command_line", cmdline},
                   {"config", used}};
    for (const Variant& v : vars) out["variants"].push_back(v.name());
    out["cells"] = json::array();
    out["skipped"] = json::array();
    for (const Cell& cell : cells) {
      if (!cell.skip.empty()) {
        out["skipped"].push_back({{"batch", cell.batch},
                                  {"context", cell.context},
                                  {"kv_gib", double(cell.fp.bytes) / double(int64_t(1) << 30)},
                                  {"reason", cell.skip}});
        continue;
      }
      json jc = {{"batch", cell.batch},
                 {"context", cell.context},
                 {"kv_pool_gib", double(cell.fp.bytes) / double(int64_t(1) << 30)}};
      if (cell.collectives_ms >= 0) jc["collectives_ms"] = cell.collectives_ms;
      for (int v = 0; v < V; ++v) {
        const Figures f = figures(cell.s[size_t(v)], cell.batch, peak_gbs);
        // Without a roofline (the CPU, no --peak-gbs) its figures are null.
        const auto rf = [&](double x) { return roofline ? json(x) : json(nullptr); };
        json jv = {{"variant", vars[size_t(v)].name()},   {"attention", to_string(vars[size_t(v)].attention)},
                   {"graphs", vars[size_t(v)].graphs},    {"step_ms", f.step_ms},
                   {"step_ms_ci95_half", f.ci_ms},        {"tokens_per_s", f.tokens_per_s},
                   {"bytes_per_step", f.bytes},           {"kv_bytes_per_step", f.kv_bytes},
                   {"mean_context_len", f.context},       {"achieved_gbs", f.gbs},
                   {"fraction_of_peak", rf(f.frac_peak)}, {"roofline_ms", rf(f.roofline_ms)},
                   {"ratio_to_roofline", rf(f.ratio)},    {"ratio_to_roofline_ci95_half", rf(f.ratio_ci)}};
        jv["kv_write"] = to_string(vars[size_t(v)].write);
        for (const Sample& x : cell.s[size_t(v)])
          jv["samples"].push_back(
              {{"step_ms", x.step_ms}, {"bytes_per_step", x.bytes}, {"mean_context_len", x.context}});
        jc["variants"].push_back(jv);
      }
      for (const auto& k : comps) {
        const MeanCi m = compare(cell, k);
        jc["comparisons"][k.name] = {{"ratio", m.mean}, {"ci95", {m.mean - m.half, m.mean + m.half}}};
      }
      out["cells"].push_back(jc);
    }
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
    if (!f) return fail("cannot write " + json_path);
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (!svg_path.empty()) {
    if (title.empty())
      title = (roofline ? "kvfuse decode step vs memory roofline: " : "kvfuse decode step time: ") +
              spec.name + " on " + device;
    const std::string sub =
        roofline ? absl::StrFormat(
                       "step time / ((%s weights + KV attended) at %.0f GB/s); KV %s, %s write; lower is "
                       "better, 1 = at the roofline; bars: 95%% CI",
                       spec.quant ? "FP8" : "bf16", peak_gbs, kv_format_name(e.kv_format()), write_names)
                 : absl::StrFormat("mean decode step time; KV %s, %s write; lower is better; bars: 95%% CI",
                                   kv_format_name(e.kv_format()), write_names);
    std::ofstream f(svg_path);
    f << render_svg(cells, vars, cs, peak_gbs, title, sub);
    if (!f) return fail("cannot write " + svg_path);
    std::printf("wrote %s\n", svg_path.c_str());
  }
  return 0;
}
