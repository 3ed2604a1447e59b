// kvfuse-ab: fused against unfused KV writes (or any two configs), end to end, on one
// build and one device. The two engines run interleaved, A B A B, over a grid of batch
// sizes and context lengths; each cell reports decode tokens/s, step time and the A/B
// ratio with a 95% confidence interval, as a table, JSON and an SVG plot.
//
// With --server ADDR twice it measures two running kvfuse servers over gRPC instead
// (bench/ab/ab_server.h): side A the first, side B the second.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "bench/ab/ab_stats.h"
#include "bench/ab/progress.h"
#include "bench/synthetic_cell.h"
#include "src/loading/int_list.h"
#ifdef KVFUSE_AB_WITH_SERVER
#include "bench/ab/ab_server.h"
#endif
#include "src/loading/config.h"
#include "src/common/status_macros.h"
#include "src/runtime/engine.h"

using namespace kvfuse;
using nlohmann::json;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "kvfuse-ab: %s\n", msg.c_str());
  return 2;
}

absl::StatusOr<json> read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("cannot open config file " + path);
  json j = json::parse(in, nullptr, false, true);
  if (j.is_discarded()) return absl::InvalidArgumentError(path + " is not valid JSON");
  return j;
}

struct Side {
  std::string name;
  std::unique_ptr<Engine> engine;
};

absl::StatusOr<ab::Sample> decode(Engine& e, int batch, int steps, SeqId first_id) {
  std::vector<StepItem> items;
  for (int i = 0; i < batch; ++i) items.push_back({first_id + SeqId(i), 1, true});
  KVFUSE_RETURN_IF_ERROR(e.backend().synchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    auto r = e.step(items);
    if (!r.ok()) return r.status();
    for (const auto& x : *r) {
      if (!x.status.ok()) return x.status;
    }
  }
  KVFUSE_RETURN_IF_ERROR(e.backend().synchronize());
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return ab::Sample{ms / steps, 1000.0 * batch * steps / ms};
}

// The table on stdout, then the JSON and SVG files if asked for: the same in both modes.
void write_outputs(const std::vector<ab::Cell>& cells, const std::string& a_name, const std::string& b_name,
                   const json& meta, const std::string& json_path, const std::string& svg_path,
                   const std::string& title) {
  std::printf("%s", ab::render_table(cells, a_name, b_name).c_str());
  if (!json_path.empty()) {
    std::ofstream(json_path) << ab::to_json(cells, a_name, b_name, meta).dump(2) << "\n";
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (!svg_path.empty()) {
    std::ofstream(svg_path) << ab::render_svg(cells, a_name, b_name, title);
    std::printf("wrote %s\n", svg_path.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-ab: A/B of two engine configs (default: fused vs unfused KV writes), interleaved"};
  std::string a_path, b_path, batches = "1,8,32", contexts = "512,2048", json_path, svg_path, title;
  std::vector<std::string> overrides, servers;
  int reps = 5, warmup = 1, steps = 16;
  app.add_option("--a", a_path, "config A (default: the built-in default with kv_write=fused)");
  app.add_option("--b", b_path, "config B (default: A with kv_write=unfused)");
  app.add_option("-s,--set", overrides, "override a key in both configs: key=value (repeatable)");
  app.add_option("--server", servers,
                 "measure a running kvfuse-server over gRPC instead of an in-process engine: give it twice, "
                 "side A then side B (host:port)");
  app.add_option("--batch", batches, "batch sizes, comma-separated")->capture_default_str();
  app.add_option("--context", contexts, "context lengths, comma-separated")->capture_default_str();
  app.add_option("--reps", reps, "measured repetitions per side and cell (>= 5)")
      ->check(CLI::Range(5, 1000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "unmeasured repetitions first")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app.add_option("--steps", steps, "decode steps per repetition")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--json", json_path, "write the results as JSON");
  app.add_option("--svg", svg_path, "write the plot as SVG");
  app.add_option("--title", title, "plot title (default: the two sides, the model and the device)");
  CLI11_PARSE(app, argc, argv);

  auto bl = parse_int_list(batches), cl = parse_int_list(contexts);
  if (!bl.ok() || !cl.ok()) return fail("--batch and --context take comma-separated integers");
  const std::vector<int> bs = *std::move(bl), cs = *std::move(cl);
  if (bs.empty() || cs.empty()) return fail("--batch and --context need at least one value each");
  for (int v : bs) {
    if (v < 1) return fail("batch sizes must be >= 1");
  }
  for (int v : cs) {
    if (v < 2) return fail("context lengths must be >= 2");
  }

  if (!servers.empty()) {
#ifdef KVFUSE_AB_WITH_SERVER
    if (auto st = ab::check_server_args(servers, !a_path.empty() || !b_path.empty()); !st.ok())
      return fail(std::string(st.message()));
    if (!overrides.empty()) {
      return fail(
          "--set configures the in-process engines; with --server, start each kvfuse-server with its "
          "own --set key=value");
    }
    ab::ServerAbOptions so;
    so.servers = servers;
    so.batches = bs;
    so.contexts = cs;
    so.reps = reps;
    so.warmup = warmup;
    so.steps = steps;
    auto r = ab::run_server_ab(so);
    if (!r.ok()) {
      std::fprintf(stderr, "\n");
      return fail(std::string(r.status().message()));
    }
    write_outputs(r->cells, r->a_name, r->b_name, r->meta, json_path, svg_path,
                  title.empty() ? r->default_title : title);
    return 0;
#else
    return fail("kvfuse-ab was built without the gRPC client (KVFUSE_BUILD_SERVER=OFF)");
#endif
  }

  const int max_b = *std::max_element(bs.begin(), bs.end());
  const int max_c = *std::max_element(cs.begin(), cs.end());

  json ja = json::object(), jb;
  if (!a_path.empty()) {
    auto j = read_json(a_path);
    if (!j.ok()) return fail(std::string(j.status().message()));
    ja = *j;
  } else {
    ja["kv_write"] = "fused";
  }
  if (!b_path.empty()) {
    auto j = read_json(b_path);
    if (!j.ok()) return fail(std::string(j.status().message()));
    jb = *j;
  } else {
    jb = ja;
    jb["kv_write"] = "unfused";
  }
  const std::string a_name = b_path.empty() ? "fused" : "A", b_name = b_path.empty() ? "unfused" : "B";
  // Room for the largest cell: every sequence holds its context plus what it decodes.
  const int grow = (warmup + reps) * steps + 2;
  for (json* j : {&ja, &jb}) {
    for (const auto& o : overrides) {
      if (auto st = apply_config_override(*j, o); !st.ok()) return fail(std::string(st.message()));
    }
    const int ps = j->value("page_size", 16);
    (*j)["max_running_seqs"] = std::max(max_b, j->value("max_running_seqs", 1));
    (*j)["max_seq_len"] = std::max(max_c + grow, j->value("max_seq_len", 2));
    (*j)["max_batch_tokens"] = std::max(max_b, j->value("max_batch_tokens", 1));
    const int64_t pages = int64_t(max_b) * ((max_c + grow + ps - 1) / ps + 1);
    (*j)["num_pages"] = std::max<int64_t>(pages, j->value("num_pages", int64_t(1)));
  }
  Side sides[2] = {{a_name, nullptr}, {b_name, nullptr}};
  const json* cfgs[2] = {&ja, &jb};
  for (int i = 0; i < 2; ++i) {
    auto cfg = config_from_json(*cfgs[i]);
    if (!cfg.ok()) return fail(sides[i].name + ": " + std::string(cfg.status().message()));
    std::fprintf(stderr, "kvfuse-ab: building engine %s (%s, %s write, %s attention)...\n",
                 sides[i].name.c_str(), cfg->model.c_str(), to_string(cfg->kv_write),
                 to_string(cfg->attention));
    auto e = Engine::create(*cfg);
    if (!e.ok()) return fail(sides[i].name + ": " + std::string(e.status().message()));
    sides[i].engine = std::move(*e);
  }
  Engine& ea = *sides[0].engine;
  std::printf(
      "kvfuse-ab: %s vs %s, model %s (weights %s) on %s, kv %s, %d reps (+%d warm-up) of %d decode steps per cell\n",
      a_name.c_str(), b_name.c_str(), ea.spec().name.c_str(), ea.spec().weight_format().c_str(),
      ea.backend().description().c_str(), kv_format_name(ea.kv_format()), reps, warmup, steps);

  std::vector<ab::Cell> cells;
  const size_t total = bs.size() * cs.size();
  bench::Progress progress(stderr);
  SeqId next_id = 1;
  for (int b : bs) {
    for (int c : cs) {
      ab::Cell cell{b, c, {}, {}};
      for (Side& s : sides) {
        if (auto st = bench::start_synthetic_cell(*s.engine, b, c, next_id); !st.ok()) {
          return fail(s.name + ": " + std::string(st.message()));
        }
      }
      for (int r = 0; r < warmup + reps; ++r) {
        progress.update(
            absl::StrFormat("kvfuse-ab: cell %zu/%zu (batch %d, context %d)", cells.size() + 1, total, b, c),
            absl::StrFormat("repetition %d/%d", r + 1, warmup + reps));
        for (int i = 0; i < 2; ++i) {
          // Alternate which side goes first, so drift over time affects both alike.
          Side& s = sides[(r % 2) ^ i];
          auto sample = decode(*s.engine, b, steps, next_id);
          if (!sample.ok()) return fail(s.name + ": " + std::string(sample.status().message()));
          if (r >= warmup) (((r % 2) ^ i) == 0 ? cell.a : cell.b).push_back(*sample);
        }
      }
      for (Side& s : sides) {
        for (int i = 0; i < b; ++i) (void)s.engine->release(next_id + SeqId(i));
      }
      next_id += SeqId(b);
      cells.push_back(std::move(cell));
    }
  }
  progress.finish();

  json meta = {{"model", ea.spec().name},
               {"weights", ea.spec().weight_format()},
               {"device", ea.backend().description()},
               {"kv_dtype", kv_format_name(ea.kv_format())},
               {"reps", reps},
               {"warmup", warmup},
               {"steps", steps},
               {"config_a", ja},
               {"config_b", jb}};
  if (title.empty())
    title =
        "kvfuse " + a_name + " vs " + b_name + ": " + ea.spec().name + " on " + ea.backend().description();
  write_outputs(cells, a_name, b_name, meta, json_path, svg_path, title);
  return 0;
}
