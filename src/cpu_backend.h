// The CPU backend: the embedded default, and the reference every GPU backend matches.
// "Device" memory is host memory; ops call the reference kernels in kernels/cpu/.
#pragma once

#include <memory>
#include <vector>

#include "src/backend.h"

namespace kvfuse {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace kvfuse
