#include "bench/common/peak_bandwidth.h"

#include <cstdio>

namespace kvfuse::bench {

namespace {

// Nominal peaks from the vendors' data sheets, under the names the runtimes report.
constexpr PeakEntry kTable[] = {
    {"NVIDIA H200", 4800},            // HBM3e, SXM and NVL
    {"NVIDIA H100 80GB HBM3", 3350},  // H100 SXM
    {"NVIDIA H100 PCIe", 2000},      {"NVIDIA H20", 4000},
    {"NVIDIA A100-SXM4-80GB", 2039}, {"NVIDIA A100-SXM4-40GB", 1555},
    {"NVIDIA A100-PCIE-40GB", 1555}, {"NVIDIA L40S", 864},
    {"AMD Instinct MI300X", 5300},   {"AMD Instinct MI325X", 6000},
    {"AMD Instinct MI355X", 8000},   {"AMD Instinct MI300A", 5300},
    {"AMD Instinct MI250X", 3277},
};
constexpr const char* kReference = "NVIDIA H200";

bool word_end(std::string_view s, size_t i) {
  return i == s.size() || s[i] == ' ' || s[i] == '/' || s[i] == '-' || s[i] == '(';
}

std::string fixed(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f", v);
  return b;
}

}  // namespace

std::span<const PeakEntry> peak_table() { return kTable; }

std::optional<PeakEntry> lookup_peak(std::string_view device_name) {
  std::optional<PeakEntry> best;
  for (const PeakEntry& e : kTable) {
    const std::string_view key = e.device;
    for (size_t at = device_name.find(key); at != std::string_view::npos;
         at = device_name.find(key, at + 1)) {
      if ((at == 0 || device_name[at - 1] == ' ') && word_end(device_name, at + key.size())) {
        if (!best || key.size() > std::string_view(best->device).size()) best = e;
        break;
      }
    }
  }
  return best;
}

double peak_from_bus(int bus_width_bits, int memory_clock_khz) {
  if (bus_width_bits <= 0 || memory_clock_khz <= 0) return 0;
  return 2.0 * double(memory_clock_khz) * 1e3 * (double(bus_width_bits) / 8) / 1e9;
}

PeakBandwidth resolve_peak(std::string_view device_name, int bus_width_bits, int memory_clock_khz,
                           std::optional<double> override_gbs) {
  if (override_gbs) return {*override_gbs, "--peak-gbs"};
  if (auto e = lookup_peak(device_name)) return {e->gbs, std::string("table: ") + e->device};
  const double bus = peak_from_bus(bus_width_bits, memory_clock_khz);
  if (bus > 0) {
    return {bus, "device: " + std::to_string(bus_width_bits) + "-bit bus x " + fixed(memory_clock_khz / 1e3) +
                     " MHz memory clock x 2"};
  }
  return {0, "unknown: not in the table and no bus figures from the device; pass --peak-gbs"};
}

PeakBandwidth resolve_peak_by_name(std::string_view device_name, std::optional<double> override_gbs) {
  PeakBandwidth p = resolve_peak(device_name, 0, 0, override_gbs);
  if (p.gbs > 0) return p;
  const PeakEntry ref = *lookup_peak(kReference);
  return {ref.gbs, std::string("reference: ") + ref.device + " table entry, no figure for this device"};
}

}  // namespace kvfuse::bench
