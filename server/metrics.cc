#include "server/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace kvfuse::server {

namespace {

std::string num(double v) { return absl::StrFormat("%.17g", v); }

std::string label_value(const std::string& v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void scalar(std::string& out, const std::string& name, const char* type, const std::string& help, double v) {
  header(out, name, type, help);
  absl::StrAppend(&out, name, " ", num(v), "\n");
}

void labelled(std::string& out, const std::string& name, const std::string& help, const std::string& label,
              const std::map<std::string, int64_t>& values) {
  header(out, name, "counter", help);
  for (const auto& [k, v] : values)
    absl::StrAppend(&out, name, "{", label, "=\"", label_value(k), "\"} ", v, "\n");
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double v) {
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard lock(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard lock(mu_);
  return count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard lock(mu_);
  header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(&out, name, "_bucket{le=\"", num(bounds_[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, name, "_bucket{le=\"+Inf\"} ", count_, "\n", name, "_sum ", num(sum_), "\n", name,
                  "_count ", count_, "\n");
}

ServerMetrics::ServerMetrics() = default;

void ServerMetrics::set_info(std::map<std::string, std::string> labels) {
  std::lock_guard lock(mu_);
  info_ = std::move(labels);
}

void ServerMetrics::set_serving(bool serving) {
  std::lock_guard lock(mu_);
  serving_ = serving;
}

void ServerMetrics::set_load(const LoadGauges& g) {
  std::lock_guard lock(mu_);
  load_ = g;
}

void ServerMetrics::add_prompt_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += n;
}

void ServerMetrics::add_generation_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  generation_tokens_ += n;
}

void ServerMetrics::count_finished(const std::string& reason) {
  std::lock_guard lock(mu_);
  ++finished_[reason];
}

void ServerMetrics::count_failed(const std::string& code) {
  std::lock_guard lock(mu_);
  ++failed_[code];
}

std::string ServerMetrics::render() const {
  std::string out;
  {
    std::lock_guard lock(mu_);
    header(out, "kvfuse:engine_info", "gauge",
           "Engine configuration: model, device, KV cache dtype and format, KV write path, attention path.");
    out += "kvfuse:engine_info{";
    bool first = true;
    for (const auto& [k, v] : info_) {
      absl::StrAppend(&out, first ? "" : ",", k, "=\"", label_value(v), "\"");
      first = false;
    }
    out += "} 1\n";
    header(out, "kvfuse:kv_write_path_info", "gauge",
           "The KV write path in use (fused: one kernel per layer).");
    const auto path = info_.find("kv_write");
    absl::StrAppend(&out, "kvfuse:kv_write_path_info{kv_write=\"",
                    label_value(path == info_.end() ? "" : path->second), "\"} 1\n");
    scalar(out, "kvfuse:serving", "gauge", "1 while the health status is SERVING.", serving_ ? 1 : 0);
    scalar(out, "kvfuse:num_requests_running", "gauge",
           "Generate requests admitted to the engine plus live router-driven sequences.",
           double(load_.running));
    scalar(out, "kvfuse:num_requests_waiting", "gauge", "Generate requests waiting for KV capacity.",
           double(load_.waiting));
    scalar(out, "kvfuse:num_router_sequences", "gauge", "Live router-driven sequences.",
           double(load_.router_sequences));
    scalar(out, "kvfuse:num_streams", "gauge", "Open Generate streams.", double(load_.streams));
    scalar(out, "kvfuse:kv_cache_usage_perc", "gauge",
           "KV cache usage of the full pool: 1 means 100 percent.",
           load_.full_total > 0 ? double(load_.full_used) / double(load_.full_total) : 0.0);
    header(out, "kvfuse:kv_pool_pages", "gauge", "KV pages per pool and state.");
    absl::StrAppend(&out, "kvfuse:kv_pool_pages{pool=\"full\",state=\"used\"} ", load_.full_used, "\n",
                    "kvfuse:kv_pool_pages{pool=\"full\",state=\"free\"} ", load_.full_total - load_.full_used,
                    "\n");
    if (load_.swa_total > 0) {
      absl::StrAppend(&out, "kvfuse:kv_pool_pages{pool=\"swa\",state=\"used\"} ", load_.swa_used, "\n",
                      "kvfuse:kv_pool_pages{pool=\"swa\",state=\"free\"} ", load_.swa_total - load_.swa_used,
                      "\n");
    }
    scalar(out, "kvfuse:num_preemptions_total", "counter", "Generate requests preempted for KV capacity.",
           double(load_.preemptions));
    scalar(out, "kvfuse:prompt_tokens_total", "counter", "Prompt tokens received (Generate and Prefill).",
           double(prompt_tokens_));
    scalar(out, "kvfuse:generation_tokens_total", "counter",
           "Tokens generated (Generate, Prefill and Decode).", double(generation_tokens_));
    labelled(out, "kvfuse:request_success_total", "Generate requests finished, by finish reason.",
             "finished_reason", finished_);
    labelled(out, "kvfuse:request_failure_total", "Generate requests failed, by gRPC status code.", "code",
             failed_);
  }
  ttft.render(out, "kvfuse:time_to_first_token_seconds", "Generate: arrival to first token, server side.");
  itl.render(out, "kvfuse:inter_token_latency_seconds", "Generate: time between consecutive tokens.");
  e2e.render(out, "kvfuse:e2e_request_latency_seconds", "Generate: arrival to the final message.");
  step.render(out, "kvfuse:step_duration_seconds", "Duration of one engine step.");
  step_tokens.render(out, "kvfuse:step_tokens", "Tokens computed in one engine step.");
  return out;
}

}  // namespace kvfuse::server
