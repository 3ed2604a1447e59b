#include "bench/ab/ab_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvfuse::ab {

double t95(int n) {
  // Quantiles t_{0.975, df} for df = 1..30; the normal 1.96 beyond.
  static const double table[] = {12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                                 2.201,  2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                                 2.080,  2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042};
  const int df = n - 1;
  if (df < 1) return NAN;
  return df <= 30 ? table[df - 1] : 1.96;
}

Summary summarize(const Cell& c) {
  Summary s;
  const size_t n = std::min(c.a.size(), c.b.size());
  if (n == 0) return s;
  std::vector<double> ratios;
  for (size_t i = 0; i < n; ++i) {
    s.a_tps += c.a[i].tokens_per_s / double(n);
    s.b_tps += c.b[i].tokens_per_s / double(n);
    s.a_step_ms += c.a[i].step_ms / double(n);
    s.b_step_ms += c.b[i].step_ms / double(n);
    ratios.push_back(c.a[i].tokens_per_s / c.b[i].tokens_per_s);
  }
  double mean = 0;
  for (double r : ratios) mean += r / double(n);
  double var = 0;
  for (double r : ratios) var += (r - mean) * (r - mean);
  var = n > 1 ? var / double(n - 1) : 0;
  const double half = n > 1 ? t95(int(n)) * std::sqrt(var / double(n)) : 0;
  s.ratio = mean;
  s.ci_low = mean - half;
  s.ci_high = mean + half;
  return s;
}

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name) {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%6s %8s | %12s %10s | %12s %10s | %8s %19s\n", "batch", "context",
                (a_name + " tok/s").c_str(), "step ms", (b_name + " tok/s").c_str(), "step ms", "A/B",
                "95% CI");
  out << line;
  for (const Cell& c : cells) {
    const Summary s = summarize(c);
    std::snprintf(line, sizeof line, "%6d %8d | %12.1f %10.3f | %12.1f %10.3f | %8.4f  [%7.4f, %7.4f]\n",
                  c.batch, c.context, s.a_tps, s.a_step_ms, s.b_tps, s.b_step_ms, s.ratio, s.ci_low,
                  s.ci_high);
    out << line;
  }
  return out.str();
}

nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta) {
  nlohmann::json j;
  j["meta"] = meta;
  j["a"] = a_name;
  j["b"] = b_name;
  for (const Cell& c : cells) {
    const Summary s = summarize(c);
    nlohmann::json cell = {{"batch", c.batch},          {"context", c.context},
                           {"a_tokens_per_s", s.a_tps}, {"b_tokens_per_s", s.b_tps},
                           {"a_step_ms", s.a_step_ms},  {"b_step_ms", s.b_step_ms},
                           {"ratio", s.ratio},          {"ci95", {s.ci_low, s.ci_high}}};
    for (const auto& [name, side] : {std::pair{"a_samples", &c.a}, std::pair{"b_samples", &c.b}}) {
      for (const Sample& x : *side)
        cell[name].push_back({{"step_ms", x.step_ms}, {"tokens_per_s", x.tokens_per_s}});
    }
    j["cells"].push_back(cell);
  }
  return j;
}

std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title) {
  const double w = std::max(640.0, 120.0 + 70.0 * double(cells.size())), h = 380, top = 50, bottom = 300,
               left = 70;
  std::vector<Summary> sums;
  double lo = 1.0, hi = 1.0;
  for (const Cell& c : cells) {
    sums.push_back(summarize(c));
    lo = std::min({lo, sums.back().ci_low, sums.back().ratio});
    hi = std::max({hi, sums.back().ci_high, sums.back().ratio});
  }
  const double pad = std::max(0.01, (hi - lo) * 0.15);
  lo -= pad;
  hi += pad;
  auto y = [&](double v) { return bottom - (v - lo) / (hi - lo) * (bottom - top); };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << left << "' y='24' font-size='15'>" << title << "</text>\n";
  s << "<text x='" << left << "' y='40' fill='#555'>tokens/s ratio " << a_name << " / " << b_name
    << ", 95% confidence interval; above 1: " << a_name << " faster</text>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4.0;
    s << "<line x1='" << left << "' x2='" << w - 20 << "' y1='" << y(v) << "' y2='" << y(v)
      << "' stroke='#eee'/><text x='" << left - 8 << "' y='" << y(v) + 4 << "' text-anchor='end'>";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", v);
    s << buf << "</text>\n";
  }
  s << "<line x1='" << left << "' x2='" << w - 20 << "' y1='" << y(1.0) << "' y2='" << y(1.0)
    << "' stroke='#333' stroke-dasharray='4 3'/>\n";
  for (size_t i = 0; i < cells.size(); ++i) {
    const double x = left + 30 + 70.0 * double(i);
    const Summary& m = sums[i];
    const bool faster = m.ci_low > 1.0, slower = m.ci_high < 1.0;
    const char* color = faster ? "#2a7f3f" : slower ? "#b03030" : "#888";
    const double y0 = y(1.0), y1 = y(m.ratio);
    s << "<rect x='" << x - 18 << "' y='" << std::min(y0, y1) << "' width='36' height='"
      << std::fabs(y1 - y0) + 0.5 << "' fill='" << color << "' opacity='0.8'/>\n";
    s << "<line x1='" << x << "' x2='" << x << "' y1='" << y(m.ci_low) << "' y2='" << y(m.ci_high)
      << "' stroke='black'/>\n";
    for (double v : {m.ci_low, m.ci_high}) {
      s << "<line x1='" << x - 6 << "' x2='" << x + 6 << "' y1='" << y(v) << "' y2='" << y(v)
        << "' stroke='black'/>\n";
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%+.1f%%", (m.ratio - 1.0) * 100.0);
    s << "<text x='" << x << "' y='" << std::min(y(m.ci_high), y1) - 6 << "' text-anchor='middle'>" << buf
      << "</text>\n";
    s << "<text x='" << x << "' y='" << bottom + 18 << "' text-anchor='middle'>b=" << cells[i].batch
      << "</text>\n";
    s << "<text x='" << x << "' y='" << bottom + 32 << "' text-anchor='middle' fill='#555'>ctx "
      << cells[i].context << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kvfuse::ab
