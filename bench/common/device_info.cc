#include "bench/common/device_info.h"

#include <cstdio>

#include "bench/common/args.h"

namespace kvfuse::bench {

namespace {

// CUDA encodes 1000 x major + 10 x minor; HIP 10^7 x major + 10^5 x minor + patch.
std::string version(const DeviceInfo& d, int v) {
  if (v <= 0) return "?";
  char b[32];
  if (d.hip) {
    std::snprintf(b, sizeof b, "%d.%d.%d", v / 10000000, v / 100000 % 100, v % 100000);
  } else {
    std::snprintf(b, sizeof b, "%d.%d", v / 1000, v % 1000 / 10);
  }
  return b;
}

const char* mp_unit(const DeviceInfo& d) { return d.hip ? "CUs" : "SMs"; }

std::string mhz(int khz) { return khz > 0 ? std::to_string(khz / 1000) + " MHz" : "?"; }

}  // namespace

std::string device_label(const DeviceInfo& d) {
  return d.name + " (" + std::to_string(d.multiprocessors) + " " + mp_unit(d) + ", L2 " +
         std::to_string(d.l2_bytes >> 20) + " MB)";
}

PeakBandwidth device_peak(const DeviceInfo& d, std::optional<double> override_gbs) {
  return resolve_peak(d.name, d.bus_width_bits, d.memory_clock_khz, override_gbs);
}

std::string device_banner(const DeviceInfo& d, const PeakBandwidth& peak) {
  char b[512];
  std::snprintf(b, sizeof b,
                "device: %s, %s, %d %s, %.1f GiB, L2 %lld MB, clock %s, memory %d-bit at %s; %s driver %s, "
                "runtime %s\n",
                d.name.c_str(), d.arch.c_str(), d.multiprocessors, mp_unit(d),
                double(d.memory_bytes) / double(int64_t(1) << 30), (long long)(d.l2_bytes >> 20),
                mhz(d.clock_khz).c_str(), d.bus_width_bits, mhz(d.memory_clock_khz).c_str(),
                d.hip ? "HIP" : "CUDA", version(d, d.driver_version).c_str(),
                version(d, d.runtime_version).c_str());
  char p[384];
  if (peak.gbs > 0) {
    std::snprintf(p, sizeof p, "peak memory bandwidth: %.0f GB/s (%s)\n", peak.gbs, peak.source.c_str());
  } else {
    std::snprintf(p, sizeof p, "peak memory bandwidth: %s\n", peak.source.c_str());
  }
  return std::string(b) + p;
}

void write_results(const std::string& path, const DeviceInfo& d, const PeakBandwidth& peak,
                   const std::string& shape, const std::vector<JsonArray>& arrays,
                   const std::string& targets) {
  JsonResultsFile f;
  f.str("device", device_label(d));
  f.number("hbm_peak_gbs", {peak.gbs, 0});
  f.str("hbm_peak_source", peak.source);
  f.raw("shape", shape);
  for (const JsonArray& a : arrays) f.rows(a.key, a.rows);
  f.raw("targets", targets);
  if (f.write(path, program_name())) std::printf("wrote %s\n", path.c_str());
}

}  // namespace kvfuse::bench
