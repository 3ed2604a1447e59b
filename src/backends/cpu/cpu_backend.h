// The CPU backend: the embedded default, and the reference every GPU backend matches.
// "Device" memory is host memory; ops call the reference kernels in kernels/cpu/.
#pragma once

#include <memory>
#include <vector>

#include "kernels/cpu/gemm/gemm.h"
#include "src/backends/backend.h"

namespace kvfuse {

// GEMMs on the given kernel (every kernel computes the same bits; see kernels/cpu/gemm/gemm.h).
std::unique_ptr<Backend> make_cpu_backend(cpu::GemmIsa isa);
// GEMMs on the widest kernel this CPU runs.
std::unique_ptr<Backend> make_cpu_backend();
// As make_backend(Device::cpu): the kernel KVFUSE_CPU_GEMM names, else the widest; a bad
// KVFUSE_CPU_GEMM is an error.
absl::StatusOr<std::unique_ptr<Backend>> make_cpu_backend_from_env();
// The host's memory: MemAvailable and MemTotal of /proc/meminfo (the CPU backend's
// device_memory()).
absl::StatusOr<DeviceMemory> host_memory();

}  // namespace kvfuse
