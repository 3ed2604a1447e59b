// What a kernel benchmark prints and records about its GPU: filled by query_device()
// (bench/common/gpu_bench.cuh, the one part that needs the CUDA/HIP runtime), formatted
// here in plain C++.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/common/json_writer.h"
#include "bench/common/peak_bandwidth.h"

namespace kvfuse::bench {

struct DeviceInfo {
  bool hip = false;         // AMD (HIP) rather than NVIDIA (CUDA)
  std::string name;         // as the runtime reports it, e.g. "NVIDIA H200"
  std::string arch;         // "sm_90" or the gcnArchName, e.g. "gfx942:sramecc+:xnack-"
  int multiprocessors = 0;  // SMs (CUDA) or CUs (HIP)
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  int bus_width_bits = 0;    // 0: not reported
  int memory_clock_khz = 0;  // 0: not reported
  int clock_khz = 0;         // SM / CU clock; 0: not reported
  int driver_version = 0;
  int runtime_version = 0;
};

// "NVIDIA H200 (132 SMs, L2 60 MB)": the "device" of the results files.
std::string device_label(const DeviceInfo& d);

// The device's peak: --peak-gbs, the table, else bus width x memory clock.
PeakBandwidth device_peak(const DeviceInfo& d, std::optional<double> override_gbs);

// Two lines, each ending in '\n': the device (name, arch, SMs/CUs, memory, clocks,
// driver/runtime) and the peak bandwidth with its source.
std::string device_banner(const DeviceInfo& d, const PeakBandwidth& peak);

// A kernel benchmark's results file: "device", "hbm_peak_gbs", "hbm_peak_source",
// "shape" (a JSON object), each of `arrays` (rows of JSON objects) and "targets" (JSON).
// Prints "wrote PATH" when written.
struct JsonArray {
  std::string key;
  std::vector<std::string> rows;
};
void write_results(const std::string& path, const DeviceInfo& d, const PeakBandwidth& peak,
                   const std::string& shape, const std::vector<JsonArray>& arrays,
                   const std::string& targets);

// gbs as a fraction of the peak (0 when the peak is unknown).
inline double fraction_of_peak(double gbs, const PeakBandwidth& peak) {
  return peak.gbs > 0 ? gbs / peak.gbs : 0;
}

}  // namespace kvfuse::bench
