// kvfuse-server: the decode service on a config. Logs are logfmt-style (key=value)
// through spdlog; SIGTERM or SIGINT drains gracefully and exits 0 (a second signal
// cuts the grace period short).
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "server/engine_loop.h"
#include "server/server.h"
#include "server/signals.h"
#include "src/common/status_macros.h"
#include "src/loading/config.h"
#include "src/loading/config_docs.h"
#include "src/loading/env_switches.h"
#include "src/runtime/engine.h"

using namespace kvfuse;

namespace {

int fail(const std::string& what, const absl::Status& st) {
  spdlog::critical("event={} error=\"{}\"", what, st.ToString());
  return 1;
}

absl::StatusOr<Config> build_config(const std::string& path, const std::vector<std::string>& overrides) {
  nlohmann::json j = nlohmann::json::object();
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError("cannot open config file " + path);
    j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
    if (j.is_discarded()) return absl::InvalidArgumentError(path + " is not valid JSON");
  }
  KVFUSE_RETURN_IF_ERROR(apply_config_env(j));
  for (const auto& o : overrides) {
    KVFUSE_RETURN_IF_ERROR(apply_config_override(j, o));
  }
  return config_from_json(j);
}

// A process whose tp_rank is not 0 in a group that spans processes: no gRPC service; it
// joins the group, then runs rank 0's commands until rank 0 shuts the group down (exit 0)
// or the group fails (exit 1). A signal ends it at once, while it waits for the group to
// form as well: rank 0's group cannot go on without this rank.
int run_follower(const Config& cfg) {
  spdlog::info("event=following rank={} tensor_parallel={} leader={} note=\"no gRPC service: rank 0 serves\"",
               cfg.tp_rank, cfg.tensor_parallel, cfg.tp_rendezvous);
  std::atomic<bool> done{false};
  absl::Status result;
  const char* failed_at = "group_failed";
  std::thread follower([&] {
    auto engine = Engine::create(cfg, server::log_load_progress());
    if (!engine.ok()) {
      result = engine.status();
      failed_at = "start_failed";
    } else {
      spdlog::info("event=joined rank={} local_ranks={} tensor_parallel={} leader={}", cfg.tp_rank,
                   (*engine)->num_local_ranks(), cfg.tensor_parallel, cfg.tp_rendezvous);
      result = (*engine)->follow();
    }
    done = true;
  });
  while (!done.load()) {
    if (const int sig = server::wait_shutdown_signal(200); sig != 0) {
      spdlog::warn("event=signal signal={} action=exit note=\"rank 0's group fails without this rank\"",
                   sig == SIGTERM ? "SIGTERM" : "SIGINT");
      spdlog::shutdown();
      std::_Exit(128 + sig);
    }
  }
  follower.join();
  if (!result.ok()) return fail(failed_at, result);
  spdlog::info("event=shutdown reason=\"rank 0 shut the group down\"");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  server::install_shutdown_handlers();

  CLI::App app{"kvfuse-server: the kvfuse decode service (gRPC)"};
  std::string config_path;
  std::vector<std::string> overrides;
  server::ServerOptions opts;
  double grace_s = 30.0;
  std::string log_level = "info";
  app.add_option("-c,--config", config_path,
                 "JSON config file (default: built-in defaults, see --config-keys)");
  app.add_option("-s,--set", overrides,
                 "override a config key: key=value (repeatable). Precedence: these flags > KVFUSE_<KEY> "
                 "environment variables > --config file > defaults");
  // Every config key is also a flag of its own: --num_pages 256 is --set num_pages=256.
  std::vector<std::pair<std::string, std::string>> key_flags;
  key_flags.reserve(config_key_docs().size());
  for (const auto& d : config_key_docs()) {
    key_flags.emplace_back(d.key, "");
    // --kv_write and --kv-write: the other flags use dashes.
    std::string names = std::string("--") + d.key;
    std::string dashed = d.key;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    if (dashed != d.key) names += ",--" + dashed;
    app.add_option(names, key_flags.back().second,
                   std::string(d.meaning) + " (" + d.values + "; env " + config_env_name(d.key) + ")")
        ->group("Config keys");
  }
  app.add_option("-l,--listen", opts.listen, "gRPC listen address host:port (port 0: a free port)")
      ->capture_default_str();
  app.add_option("--metrics-port", opts.metrics_port,
                 "Prometheus /metrics HTTP port; 0 picks one, -1 turns it off")
      ->capture_default_str();
  app.add_option("--drain-grace-s", grace_s, "on SIGTERM/SIGINT, how long in-flight work may finish")
      ->capture_default_str();
  app.add_option(
         "--watchdog-s", opts.loop.watchdog_s,
         "health turns NOT_SERVING when the engine makes no progress this long with work pending (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-waiting", opts.loop.max_waiting, "Generate requests queued before RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--stream-queue", opts.service.stream_queue_messages,
                 "messages queued per Generate stream before tokens are coalesced")
      ->capture_default_str();
  int max_message_mib = opts.max_message_bytes >> 20;
  app.add_option("--max-message-mib", max_message_mib, "largest gRPC message, MiB")
      ->check(CLI::Range(1, 2047))
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error")->capture_default_str();
  std::string keys_format;
  CLI::Option* print_keys =
      app.add_option("--config-keys", keys_format,
                     "print every config key and exit; =markdown prints the tables of docs/configuration.md "
                     "(keys with defaults and variables, then the KVFUSE_* switches)")
          ->expected(0, 1)
          ->default_str("plain")
          ->check(CLI::IsMember({"plain", "markdown"}));
  bool print_env = false;
  app.add_flag("--help-env", print_env, "print every KVFUSE_* environment variable and exit");
  CLI11_PARSE(app, argc, argv);

  if (print_keys->count() > 0) {
    if (keys_format == "markdown") {
      std::fputs(config_keys_markdown().c_str(), stdout);
      return 0;
    }
    for (const auto& d : config_key_docs()) std::printf("%-18s %-45s %s\n", d.key, d.values, d.meaning);
    return 0;
  }
  if (print_env) {
    std::fputs(env_help().c_str(), stdout);
    return 0;
  }
  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::set_pattern("ts=%Y-%m-%dT%H:%M:%S.%e%z level=%l %v");

  for (const auto& [key, value] : key_flags) {
    if (!value.empty()) overrides.push_back(key + "=" + value);
  }
  auto cfg = build_config(config_path, overrides);
  if (!cfg.ok()) return fail("bad_config", cfg.status());
  if (cfg->tensor_parallel > 1 && !cfg->tp_rendezvous.empty() && cfg->tp_rank > 0) {
    spdlog::info("event=starting version={} config={}", KVFUSE_VERSION, config_to_json(*cfg).dump());
    return run_follower(*cfg);
  }
  opts.loop.config = *cfg;
  opts.max_message_bytes = max_message_mib << 20;
  spdlog::info("event=starting version={} config={}", KVFUSE_VERSION, config_to_json(*cfg).dump());

  auto srv = server::KvfuseServer::start(opts);
  if (!srv.ok()) return fail("start_failed", srv.status());
  server::KvfuseServer& s = **srv;

  // Wait for a signal; meanwhile notice an engine that failed to start.
  int sig = 0;
  while ((sig = server::wait_shutdown_signal(200)) == 0) {
    if (s.loop().state() == server::LoopState::failed) {
      s.drain(0);
      // The loop logged why (event=engine_start_failed).
      spdlog::critical("event=exit code=1 reason=engine_start_failed");
      return 1;
    }
  }
  const char* sig_name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
  // Still loading, or waiting for a tensor-parallel group to form: nothing was admitted
  // (calls are UNAVAILABLE while warming, and once warm the drain asked for here wins), so
  // there is nothing to drain and no reason to wait for the load or the rendezvous.
  s.loop().begin_drain();
  if (s.loop().state() == server::LoopState::warming) {
    spdlog::info(
        "event=signal signal={} action=exit note=\"the engine was still starting: nothing in flight\"",
        sig_name);
    spdlog::shutdown();
    std::_Exit(0);
  }
  spdlog::info("event=signal signal={} action=drain grace_s={}", sig_name, grace_s);
  // A second signal during the drain: stop waiting for in-flight work.
  std::atomic<bool> draining_done{false};
  std::thread second([&] {
    while (!draining_done.load()) {
      if (server::wait_shutdown_signal(100) != 0) {
        spdlog::warn("event=signal action=stop_now");
        s.loop().stop(absl::UnavailableError("server is shutting down"));
        return;
      }
    }
  });
  s.drain(grace_s);
  draining_done = true;
  second.join();
  return 0;
}
