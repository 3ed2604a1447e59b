#include "bench/common/stats.h"

#include <boost/math/distributions/students_t.hpp>

#include <algorithm>
#include <cmath>

namespace kvfuse::bench {

double t95(int n) {
  const int df = n - 1;
  if (df < 1) return NAN;
  const boost::math::students_t dist(df);
  return boost::math::quantile(boost::math::complement(dist, 0.025));
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::vector<bool> outliers(const std::vector<double>& v) {
  std::vector<bool> out(v.size(), false);
  // Too few to tell a stray repetition from the spread.
  if (v.size() < 4) return out;
  const double med = median(v);
  std::vector<double> dev;
  for (double x : v) dev.push_back(std::fabs(x - med));
  // 1.4826 * MAD estimates the standard deviation of normal data; 3.5 of those is the
  // usual cut (Iglewicz and Hoaglin). With more than half the values equal the MAD is 0:
  // their fallback, 1.2533 * the mean absolute deviation, takes over.
  double scale = 1.4826 * median(dev);
  if (scale == 0) {
    for (double d : dev) scale += 1.2533 * d / double(dev.size());
  }
  const double limit = 3.5 * scale;
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::fabs(v[i] - med) > limit;
  return out;
}

MeanCi mean_ci(const std::vector<double>& x) {
  MeanCi m;
  const size_t n = x.size();
  if (n == 0) return m;
  for (double v : x) m.mean += v / double(n);
  double var = 0;
  for (double v : x) var += (v - m.mean) * (v - m.mean);
  if (n > 1) m.half = t95(int(n)) * std::sqrt(var / double(n - 1) / double(n));
  return m;
}

Axis nice_axis(double lo, double hi, int target_ticks) {
  if (!(hi > lo)) {
    const double pad = std::max(0.01, std::fabs(lo) * 0.01);
    lo -= pad;
    hi += pad;
  }
  // A step of 1, 2, 2.5 or 5 times a power of ten, so that tick labels read plainly.
  const double raw = (hi - lo) / std::max(1, target_ticks);
  int exponent = int(std::floor(std::log10(raw)));
  double mult = 10;
  for (double m : {1.0, 2.0, 2.5, 5.0}) {
    if (m * std::pow(10.0, exponent) >= raw * (1 - 1e-9)) {
      mult = m;
      break;
    }
  }
  if (mult == 10) {
    mult = 1;
    ++exponent;
  }
  Axis a;
  a.step = mult * std::pow(10.0, exponent);
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  a.decimals = std::max(0, -exponent + (mult == 2.5 ? 1 : 0));
  return a;
}

std::string xml_escape(const std::string& in) {
  std::string o;
  for (char ch : in) {
    if (ch == '&')
      o += "&amp;";
    else if (ch == '<')
      o += "&lt;";
    else if (ch == '>')
      o += "&gt;";
    else if (ch == '\'')
      o += "&apos;";
    else
      o += ch;
  }
  return o;
}

}  // namespace kvfuse::bench
