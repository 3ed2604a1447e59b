// Statistics and rendering for kvfuse-ab: paired A/B repetitions, a mean ratio with a
// 95% confidence interval, and the table, JSON and SVG outputs.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kvfuse::ab {

// One measurement of one side in one repetition.
struct Sample {
  double step_ms = 0;       // mean decode step time
  double tokens_per_s = 0;  // decode tokens per second
};

struct Cell {
  int batch = 0;
  int context = 0;
  std::vector<Sample> a, b;  // paired: a[i] and b[i] ran back to back
};

struct Summary {
  double a_tps = 0, b_tps = 0;          // mean tokens/s
  double a_step_ms = 0, b_step_ms = 0;  // mean step time
  double ratio = 0;                     // mean of the paired ratios a_tps / b_tps
  double ci_low = 0, ci_high = 0;       // 95% confidence interval of that mean
};

// Two-sided 95% Student t quantile for n-1 degrees of freedom.
double t95(int n);
Summary summarize(const Cell& c);

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name);
nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta);
// A bar per cell (ratio with its interval), a line at 1.0: readable at a glance.
std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title);

}  // namespace kvfuse::ab
