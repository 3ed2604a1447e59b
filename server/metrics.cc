#include "server/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace kvfuse::server {

namespace {

// The shortest text that parses back to the same double ("0.1", not
// "0.10000000000000001"), as the Go and Python Prometheus clients print.
std::string num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, res.ptr);
}

std::string label_value(const std::string& v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// `labels` is the model_name label every series carries, then any of its own.
void scalar(std::string& out, const std::string& name, const char* type, const std::string& help,
            const std::string& labels, double v) {
  header(out, name, type, help);
  absl::StrAppend(&out, name, "{", labels, "} ", num(v), "\n");
}

void labelled(std::string& out, const std::string& name, const std::string& help, const std::string& labels,
              const std::string& label, const std::map<std::string, int64_t>& values) {
  header(out, name, "counter", help);
  for (const auto& [k, v] : values)
    absl::StrAppend(&out, name, "{", labels, ",", label, "=\"", label_value(k), "\"} ", v, "\n");
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

void Histogram::render(std::string& out, const std::string& name, const std::string& help,
                       const std::string& labels) const {
  std::lock_guard lock(mu_);
  header(out, name, "histogram", help);
  const std::string pre = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(&out, name, "_bucket{", pre, "le=\"", num(bounds_[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, name, "_bucket{", pre, "le=\"+Inf\"} ", count_, "\n", name, "_sum{", labels, "} ",
                  num(sum_), "\n", name, "_count{", labels, "} ", count_, "\n");
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

LoadGauges ServerMetrics::load() const {
  std::lock_guard lock(mu_);
  return load_;
}

int64_t ServerMetrics::generation_tokens() const {
  std::lock_guard lock(mu_);
  return generation_tokens_;
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
  std::string ml;  // model_name="...": vLLM labels every series with it, so do dashboards
  {
    std::lock_guard lock(mu_);
    const auto model = info_.find("model");
    ml = absl::StrCat("model_name=\"", label_value(model == info_.end() ? "" : model->second), "\"");
    header(out, "kvfuse:engine_info", "gauge",
           "Engine configuration: model, device, KV cache dtype and format, KV write path, attention path.");
    out += "kvfuse:engine_info{" + ml;
    for (const auto& [k, v] : info_) absl::StrAppend(&out, ",", k, "=\"", label_value(v), "\"");
    out += "} 1\n";
    header(out, "kvfuse:kv_write_path_info", "gauge",
           "The KV write path in use (fused: one kernel per layer).");
    const auto path = info_.find("kv_write");
    absl::StrAppend(&out, "kvfuse:kv_write_path_info{", ml, ",kv_write=\"",
                    label_value(path == info_.end() ? "" : path->second), "\"} 1\n");
    scalar(out, "kvfuse:serving", "gauge", "1 while the health status is SERVING.", ml, serving_ ? 1 : 0);
    scalar(out, "kvfuse:num_requests_running", "gauge",
           "Generate requests admitted to the engine plus live router-driven sequences.", ml,
           double(load_.running));
    scalar(out, "kvfuse:num_requests_waiting", "gauge", "Generate requests waiting for KV capacity.", ml,
           double(load_.waiting));
    scalar(out, "kvfuse:num_router_sequences", "gauge", "Live router-driven sequences.", ml,
           double(load_.router_sequences));
    scalar(out, "kvfuse:num_streams", "gauge", "Open Generate streams.", ml, double(load_.streams));
    scalar(out, "kvfuse:kv_cache_usage_perc", "gauge",
           "KV cache usage of the full pool: 1 means 100 percent.", ml,
           load_.full_total > 0 ? double(load_.full_used) / double(load_.full_total) : 0.0);
    header(out, "kvfuse:kv_pool_pages", "gauge", "KV pages per pool and state.");
    absl::StrAppend(&out, "kvfuse:kv_pool_pages{", ml, ",pool=\"full\",state=\"used\"} ", load_.full_used,
                    "\n", "kvfuse:kv_pool_pages{", ml, ",pool=\"full\",state=\"free\"} ",
                    load_.full_total - load_.full_used, "\n");
    if (load_.swa_total > 0) {
      absl::StrAppend(&out, "kvfuse:kv_pool_pages{", ml, ",pool=\"swa\",state=\"used\"} ", load_.swa_used,
                      "\n", "kvfuse:kv_pool_pages{", ml, ",pool=\"swa\",state=\"free\"} ",
                      load_.swa_total - load_.swa_used, "\n");
    }
    scalar(out, "kvfuse:num_preemptions_total", "counter", "Generate requests preempted for KV capacity.", ml,
           double(load_.preemptions));
    scalar(out, "kvfuse:prefix_cache_queries_total", "counter",
           "Prompt tokens looked up in the prefix cache (vLLM counts tokens too).", ml,
           double(load_.cache_query_tokens));
    scalar(out, "kvfuse:prefix_cache_hits_total", "counter", "Of those, tokens found cached.", ml,
           double(load_.cache_hit_tokens));
    header(out, "kvfuse:prefix_cache_pages", "gauge", "Full-pool pages the prefix cache holds, by state.");
    absl::StrAppend(&out, "kvfuse:prefix_cache_pages{", ml, ",state=\"held\"} ",
                    load_.cached_pages - load_.evictable_pages, "\n", "kvfuse:prefix_cache_pages{", ml,
                    ",state=\"evictable\"} ", load_.evictable_pages, "\n");
    scalar(out, "kvfuse:prompt_tokens_total", "counter", "Prompt tokens received (Generate and Prefill).", ml,
           double(prompt_tokens_));
    scalar(out, "kvfuse:generation_tokens_total", "counter",
           "Tokens generated (Generate, Prefill and Decode).", ml, double(generation_tokens_));
    labelled(out, "kvfuse:request_success_total", "Generate requests finished, by finish reason.", ml,
             "finished_reason", finished_);
    labelled(out, "kvfuse:request_failure_total", "Generate requests failed, by gRPC status code.", ml,
             "code", failed_);
  }
  ttft.render(out, "kvfuse:time_to_first_token_seconds", "Generate: arrival to first token, server side.",
              ml);
  itl.render(out, "kvfuse:inter_token_latency_seconds", "Generate: time between consecutive tokens.", ml);
  e2e.render(out, "kvfuse:e2e_request_latency_seconds", "Generate: arrival to the final message.", ml);
  step.render(out, "kvfuse:step_duration_seconds", "Duration of one engine step.", ml);
  step_tokens.render(out, "kvfuse:step_tokens", "Tokens computed in one engine step.", ml);
  return out;
}

}  // namespace kvfuse::server
