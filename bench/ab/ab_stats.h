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
  double a_tps = 0, b_tps = 0;          // tokens/s at the median step time
  double a_step_ms = 0, b_step_ms = 0;  // median step time
  double ratio = 0;                     // mean of the paired ratios a_tps / b_tps, outliers dropped
  double ci_low = 0, ci_high = 0;       // 95% confidence interval of that mean
  int n = 0;                            // repetitions in the ratio
  int outliers = 0;                     // repetitions dropped from it
};

// A cell whose interval is wider than +-5% of its ratio says little: flagged.
inline constexpr double kWideInterval = 0.05;

// Two-sided 95% Student t quantile for n-1 degrees of freedom (Boost.Math).
double t95(int n);
double median(std::vector<double> v);
// Values farther from the median than 3.5 scaled median absolute deviations (none
// with fewer than 4 values).
std::vector<bool> outliers(const std::vector<double>& v);
Summary summarize(const Cell& c);
bool too_wide(const Summary& s);

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name);
nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta);
// A value axis with round ticks: [lo, hi] in steps of 1, 2, 2.5 or 5 times a power of
// ten, about `target_ticks` of them, covering the data range given.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  int decimals = 0;  // enough to print every tick exactly
};
Axis nice_axis(double lo, double hi, int target_ticks);

// Text made safe for an SVG/XML attribute or element (&, <, >, ').
std::string xml_escape(const std::string& in);

// A bar per cell (ratio with its interval), a line at 1.0: readable at a glance.
std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title);

}  // namespace kvfuse::ab
