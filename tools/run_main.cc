// kvfuse-run: runs the engine in-process on a config and prints the generated tokens
// and per-step timings. No server: the quickest way to see the engine work.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/loading/config.h"
#include "src/runtime/engine.h"
#include "src/loading/int_list.h"
#include "src/runtime/scheduler.h"

using namespace kvfuse;

namespace {

int fail(const absl::Status& st) {
  std::fprintf(stderr, "kvfuse-run: %s\n", std::string(st.message()).c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-run: generate with the kvfuse engine in-process"};
  std::string config_path;
  std::vector<std::string> overrides;
  std::string prompt_ids = "1,2,3,4,5,6,7,8";
  int num_prompts = 4;
  int max_tokens = 32;
  float temperature = 0.0f;
  bool quiet_steps = false;
  bool print_keys = false;
  app.add_option("-c,--config", config_path,
                 "JSON config file (default: the built-in defaults, as kvfuse-server's without --config; "
                 "see --config-keys)");
  app.add_option("-s,--set", overrides,
                 "override a config key: key=value (repeatable; over KVFUSE_<KEY> environment variables, "
                 "over the --config file)");
  app.add_option("--prompt-ids", prompt_ids, "comma-separated prompt token ids")->capture_default_str();
  app.add_option(
         "-n,--num-prompts", num_prompts,
         "number of sequences (prompt i is the prompt with i added to every id; each must stay inside "
         "the vocabulary)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("-m,--max-tokens", max_tokens,
                 "tokens to generate per sequence (at most max_seq_len; generation also stops there)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-t,--temperature", temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  app.add_flag("-q,--quiet-steps", quiet_steps, "print only the summary, not each step");
  app.add_flag("--config-keys", print_keys, "print every config key and exit");
  CLI11_PARSE(app, argc, argv);

  if (print_keys) {
    for (const auto& d : config_key_docs()) std::printf("%-18s %-45s %s\n", d.key, d.values, d.meaning);
    return 0;
  }

  nlohmann::json j = nlohmann::json::object();
  if (!config_path.empty()) {
    std::ifstream in(config_path);
    if (!in) return fail(absl::NotFoundError("cannot open config file " + config_path));
    j = nlohmann::json::parse(in, nullptr, false, true);
    if (j.is_discarded()) return fail(absl::InvalidArgumentError(config_path + " is not valid JSON"));
  }
  if (auto st = apply_config_env(j); !st.ok()) return fail(st);
  for (const auto& o : overrides) {
    if (auto st = apply_config_override(j, o); !st.ok()) return fail(st);
  }
  auto cfg = config_from_json(j);
  if (!cfg.ok()) return fail(cfg.status());

  const auto t0 = std::chrono::steady_clock::now();
  auto engine = Engine::create(*cfg, load_progress_every(15, [](const LoadProgress& p) {
    // A long load says how far it is; a short one prints nothing more than the summary.
    if (p.layers_done > 0 && p.layers_done < p.layers) {
      std::fprintf(stderr, "kvfuse-run: loading weights, %d of %d layers (%.0f s)\n", p.layers_done, p.layers,
                   p.elapsed_s);
    }
  }));
  if (!engine.ok()) return fail(engine.status());
  const double init_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  Engine& e = **engine;
  double kv_gib = 0;  // one rank's K/V buffers, every layer (SWA layers hold their smaller pool)
  for (int32_t l = 0; l < e.spec().num_layers; ++l) {
    const PagedKvView v = e.pool().layer_view(l);
    kv_gib += double(v.num_pages) * double(e.pool().page_bytes_per_layer()) / double(int64_t(1) << 30);
  }
  std::printf(
      "kvfuse-run: model %s on %s%s, kv %s (%s write), %s attention, %lld pages x %d tokens%s (%.2f GiB of KV per "
      "rank), init %.0f ms\n",
      e.spec().name.c_str(), e.backend().description().c_str(),
      e.num_ranks() > 1 ? absl::StrCat(" and ", e.num_ranks() - 1, " more rank(s), tensor_parallel ", e.num_ranks()).c_str()
                        : "",
      kv_format_name(e.kv_format()), to_string(cfg->kv_write), to_string(cfg->attention), (long long)cfg->num_pages,
      cfg->page_size, e.num_ranks() > 1 ? " per rank" : "",
      kv_gib, init_ms);
  if (e.is_follower()) {
    // Rank 0's process runs the prompts; this one runs its steps' share until it is done.
    const int32_t local = e.num_local_ranks();
    const std::string ranks = local == 1 ? absl::StrCat("rank ", cfg->tp_rank)
                                         : absl::StrCat("ranks ", cfg->tp_rank, "-", cfg->tp_rank + local - 1);
    std::printf("kvfuse-run: %s of %d follow%s rank 0 at %s\n", ranks.c_str(), cfg->tensor_parallel,
                local == 1 ? "s" : "", cfg->tp_rendezvous.c_str());
    std::fflush(stdout);
    if (auto st = e.follow(); !st.ok()) return fail(st);
    std::printf("kvfuse-run: rank 0 shut the group down\n");
    return 0;
  }

  auto ids = parse_int_list(prompt_ids);
  if (!ids.ok()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--prompt-ids must be comma-separated integers: ", ids.status().message())));
  }
  const std::vector<int32_t> base = *std::move(ids);
  Scheduler sched(e);
  for (int i = 0; i < num_prompts; ++i) {
    GenerateRequest r;
    r.id = SeqId(i);
    r.prompt = base;
    for (auto& t : r.prompt) t += i;
    r.max_new_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.seed = uint64_t(i);
    // Checked as the server checks a Generate request: a token outside the vocabulary
    // or a max_tokens beyond max_seq_len is refused, not wrapped or capped.
    if (auto st = sched.submit(std::move(r)); !st.ok()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("prompt ", i, " (--prompt-ids shifted by ", i, "): ", st.message())));
    }
  }

  std::map<SeqId, std::vector<int32_t>> out;
  int64_t steps = 0, generated = 0;
  double total_ms = 0;
  while (sched.has_work()) {
    auto events = sched.step();
    if (!events.ok()) return fail(events.status());
    const StepTimings& t = e.last_timings();
    ++steps;
    total_ms += t.total_ms;
    std::vector<std::string> toks;
    for (const auto& ev : *events) {
      if (ev.token) {
        out[ev.id].push_back(*ev.token);
        ++generated;
        toks.push_back(std::to_string(ev.id) + ":" + std::to_string(*ev.token));
      }
      if (ev.finish == FinishReason::error) {
        std::fprintf(stderr, "sequence %llu failed: %s\n", (unsigned long long)ev.id,
                     std::string(ev.status.message()).c_str());
      }
    }
    if (!quiet_steps) {
      std::printf("step %4lld  %3d seqs %4lld tokens  %7.2f ms (prepare %.2f forward %.2f sample %.2f)  %s\n",
                  (long long)steps, t.num_seqs, (long long)t.num_tokens, t.total_ms, t.prepare_ms,
                  t.forward_ms, t.sample_ms, absl::StrJoin(toks, " ").c_str());
    }
  }
  for (const auto& [id, toks] : out) {
    std::printf("sequence %llu: %s\n", (unsigned long long)id, absl::StrJoin(toks, ",").c_str());
  }
  std::printf("generated %lld tokens in %lld steps, %.1f ms of engine time (%.0f tokens/s)\n",
              (long long)generated, (long long)steps, total_ms,
              total_ms > 0 ? 1000.0 * double(generated) / total_ms : 0.0);
  return 0;
}
