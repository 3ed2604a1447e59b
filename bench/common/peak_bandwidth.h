// Peak memory (HBM) bandwidth of a benchmark's device, the denominator of every "% of
// peak" and roofline figure: --peak-gbs when given, else the device's entry in a table
// of nominal figures keyed by the name the runtime reports, else the bus width x memory
// clock the device reports. The source goes with the figure into banners and JSON.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvfuse::bench {

struct PeakBandwidth {
  double gbs = 0;      // 1 GB = 1e9 bytes; 0: unknown
  std::string source;  // where gbs came from, e.g. "table: NVIDIA H200"
};

// One row of the table: the name as cudaGetDeviceProperties / hipGetDeviceProperties
// report it, and the vendor's nominal peak.
struct PeakEntry {
  const char* device;
  double gbs;
};
std::span<const PeakEntry> peak_table();

// The table row whose name stands in `device_name` as whole words (followed by the end,
// a space, '/', '-' or '('; "NVIDIA H20" is not "NVIDIA H200"), the longest if several.
std::optional<PeakEntry> lookup_peak(std::string_view device_name);

// Bus width x memory clock x 2 (double data rate) in GB/s; 0 if either is unknown.
double peak_from_bus(int bus_width_bits, int memory_clock_khz);

// --peak-gbs if given, else the table, else the bus (gbs 0 if that is unknown too).
PeakBandwidth resolve_peak(std::string_view device_name, int bus_width_bits, int memory_clock_khz,
                           std::optional<double> override_gbs);

// For a program that knows only the device's name (the engine benchmark reads it from the
// backend's description): --peak-gbs, else the table, else the table's reference row,
// the H200, said so in the source. (The CPU backend has no HBM figure of its own:
// kvfuse-bench-engine computes no roofline there unless --peak-gbs is given.)
PeakBandwidth resolve_peak_by_name(std::string_view device_name, std::optional<double> override_gbs);

// The --peak-gbs help text every benchmark shows.
inline constexpr const char* kPeakGbsHelp =
    "peak memory bandwidth in GB/s (default: the device's entry in bench/common's table, else its bus "
    "width x memory clock)";

}  // namespace kvfuse::bench
