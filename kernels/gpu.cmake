# GPU kernels, one CUDA-dialect source for both vendors (docs/design.md#gpu-portability-layer): with
# KVFUSE_GPU=CUDA the kernels/<family>/*.cu files build as CUDA, with KVFUSE_GPU=HIP the same
# files are marked LANGUAGE HIP. Included by the top-level CMakeLists.txt and by the
# standalone GPU test build (tests/gpu/CMakeLists.txt), so paths are relative to this
# file, never to PROJECT_SOURCE_DIR.
#
# Defines:
#   kvfuse_kernels_gpu      static library of the GPU kernels and their launchers
#   kvfuse_gpu_sources(...) marks sources as the GPU language (for tests and benches)
#   kvfuse_gpu_warnings(t)  -Wall -Wextra -Werror on a GPU target's host and device code
get_filename_component(KVFUSE_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

if(KVFUSE_GPU STREQUAL "CUDA")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # H200/H100 by default (sm_90a: the "a" features are not used, but it is what the
    # device runs); CI also compiles sm_80. Override with -DCMAKE_CUDA_ARCHITECTURES.
    set(CMAKE_CUDA_ARCHITECTURES 90a)
  endif()
  enable_language(CUDA)
  # C++20 for device code too. CMake 3.25 (Debian 12) does not know nvcc's C++20 flag
  # and, left alone, would refuse the targets (CUDA_STANDARD falls back to the C++20
  # CXX_STANDARD): there, ask for 17 and make "17" mean -std=c++20.
  if(CMAKE_CUDA20_COMPILE_FEATURES)
    set(CMAKE_CUDA_STANDARD 20)
  else()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA17_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA17_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(CMAKE_CUDA_EXTENSIONS OFF)
  find_package(CUDAToolkit REQUIRED)
  set(KVFUSE_GPU_LANG CUDA)
  set(KVFUSE_GPU_RUNTIME CUDA::cudart)
elseif(KVFUSE_GPU STREQUAL "HIP")
  if(NOT DEFINED CMAKE_HIP_ARCHITECTURES)
    set(CMAKE_HIP_ARCHITECTURES "gfx942;gfx950")
  endif()
  enable_language(HIP)
  set(CMAKE_HIP_STANDARD 20)
  set(CMAKE_HIP_STANDARD_REQUIRED ON)
  find_package(hip REQUIRED CONFIG)
  set(KVFUSE_GPU_LANG HIP)
  set(KVFUSE_GPU_RUNTIME hip::host)
else()
  message(FATAL_ERROR "kernels/gpu.cmake: KVFUSE_GPU must be CUDA or HIP (got '${KVFUSE_GPU}')")
endif()

function(kvfuse_gpu_sources)
  if(KVFUSE_GPU STREQUAL "HIP")
    set_source_files_properties(${ARGN} PROPERTIES LANGUAGE HIP)
  endif()
endfunction()

function(kvfuse_gpu_warnings target)
  # nvcc: host code through the host compiler's flags, device code through --Werror.
  # No fast-math anywhere: the conversions rely on IEEE division, NaN compares and
  # denormals (kernels/kv_write/kv_write.cu).
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Werror --Werror all-warnings>
    $<$<COMPILE_LANGUAGE:HIP>:-Wall -Wextra -Werror>)
endfunction()

# The CPU references the GPU kernels and their parity tests use: the KV write (the GPU
# scratch layout is its layout), paged attention, and the FP8-weight GEMM (with the bf16
# GEMM it runs its blocks through, and the ops' bulk conversions). In the full build they
# come with kvfuse_kernels_cpu; the standalone GPU build compiles only these files (no
# BLAS, no absl), the GEMM's vector kernels with their instruction sets as the top-level
# CMakeLists.txt gives them.
if(TARGET kvfuse_kernels_cpu)
  set(KVFUSE_GPU_CPU_REF kvfuse_kernels_cpu)
else()
  set(KVFUSE_CPU_REF_SOURCES ${KVFUSE_ROOT}/kernels/cpu/kv_write/kv_write.cc ${KVFUSE_ROOT}/kernels/cpu/attention/attention.cc
      ${KVFUSE_ROOT}/kernels/cpu/gemm/gemm.cc ${KVFUSE_ROOT}/kernels/cpu/gemm/gemm_fp8.cc ${KVFUSE_ROOT}/kernels/cpu/ops/ops.cc)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
    set_source_files_properties(${KVFUSE_ROOT}/kernels/cpu/gemm/gemm_avx2.cc PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma")
    set_source_files_properties(${KVFUSE_ROOT}/kernels/cpu/gemm/gemm_avx512.cc PROPERTIES COMPILE_OPTIONS "-mavx512f")
    list(APPEND KVFUSE_CPU_REF_SOURCES ${KVFUSE_ROOT}/kernels/cpu/gemm/gemm_avx2.cc
         ${KVFUSE_ROOT}/kernels/cpu/gemm/gemm_avx512.cc)
  endif()
  add_library(kvfuse_cpu_ref STATIC ${KVFUSE_CPU_REF_SOURCES})
  target_include_directories(kvfuse_cpu_ref PUBLIC ${KVFUSE_ROOT})
  target_compile_options(kvfuse_cpu_ref PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>)
  kvfuse_gpu_warnings(kvfuse_cpu_ref)
  set(KVFUSE_GPU_CPU_REF kvfuse_cpu_ref)
endif()

# Every family folder's .cu (kernels/cpu holds C++ only).
file(GLOB_RECURSE KVFUSE_GPU_KERNEL_SOURCES CONFIGURE_DEPENDS ${KVFUSE_ROOT}/kernels/*.cu)
kvfuse_gpu_sources(${KVFUSE_GPU_KERNEL_SOURCES})
add_library(kvfuse_kernels_gpu STATIC ${KVFUSE_GPU_KERNEL_SOURCES})
target_include_directories(kvfuse_kernels_gpu PUBLIC ${KVFUSE_ROOT})
target_link_libraries(kvfuse_kernels_gpu PUBLIC ${KVFUSE_GPU_CPU_REF} ${KVFUSE_GPU_RUNTIME})
# KVFUSE_HAVE_GPU (which switches make_backend over to a GPU-aware one) is left to the
# GPU backend glue that links this library into the engine.
target_compile_definitions(kvfuse_kernels_gpu PUBLIC $<$<STREQUAL:${KVFUSE_GPU},HIP>:KVFUSE_HIP>)
kvfuse_gpu_warnings(kvfuse_kernels_gpu)
