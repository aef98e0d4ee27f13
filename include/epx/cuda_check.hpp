#pragma once
// EPX_CUDA_CHECK(call): throws epx::CudaError with the call text, the CUDA error name and string,
// file and line. Host code only; the one CUDA-check macro of the library, its tools and tests.

#include <cuda_runtime.h>

#include <string>

#include "epx/error.hpp"

#define EPX_CUDA_CHECK(call)                                                               \
  do {                                                                                     \
    cudaError_t epx_err_ = (call);                                                         \
    if (epx_err_ != cudaSuccess) {                                                         \
      throw ::epx::CudaError(::epx::detail::located(                                       \
          std::string(#call) + " failed: " + cudaGetErrorName(epx_err_) + " (" +           \
              cudaGetErrorString(epx_err_) + ")",                                          \
          __FILE__, __LINE__));                                                            \
    }                                                                                      \
  } while (0)

namespace epx {
// Number of CUDA devices visible; 0 when there is no driver or no GPU (never throws).
int cuda_device_count();
// Throws UnsupportedError("... needs an NVIDIA GPU ...") when no device is visible.
void require_gpu(const char* what);
}  // namespace epx
