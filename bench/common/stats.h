// Statistics and plot helpers shared by kvfuse-ab and kvfuse-bench-engine: Student t
// intervals over repetitions, a robust outlier test, round axis ticks and XML escaping
// for their SVG plots.
#pragma once

#include <string>
#include <vector>

namespace kvfuse::bench {

// Two-sided 95% Student t quantile for n-1 degrees of freedom (Boost.Math).
double t95(int n);
// The median (the mean of the middle two of an even count); NaN when empty.
double median(std::vector<double> v);
// Values farther from the median than 3.5 scaled median absolute deviations (none
// with fewer than 4 values).
std::vector<bool> outliers(const std::vector<double>& v);

struct MeanCi {
  double mean = 0, half = 0;
};
// Mean and the half-width of its 95% Student t interval (0 with fewer than 2 values).
MeanCi mean_ci(const std::vector<double>& x);

// A value axis with round ticks: [lo, hi] in steps of 1, 2, 2.5 or 5 times a power of
// ten, about `target_ticks` of them, covering the data range given.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  int decimals = 0;  // enough to print every tick exactly
};
Axis nice_axis(double lo, double hi, int target_ticks);

// Text made safe for an SVG/XML attribute or element (&, <, >, ').
std::string xml_escape(const std::string& in);

}  // namespace kvfuse::bench
