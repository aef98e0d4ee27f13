#include "illegal_write.hpp"

#include <cstdint>

#include "epx/cuda_check.hpp"

namespace epx::fault {
namespace {

__global__ void __launch_bounds__(1) write_to(int* address) {
  *reinterpret_cast<volatile int*>(address) = 1;
}

// In the first page of the address space, which CUDA never maps.
constexpr uintptr_t kUnmappedAddress = 64;

}  // namespace

void preload_illegal_write() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, write_to));
}

cudaError_t launch_illegal_write(cudaStream_t stream) {
  write_to<<<1, 1, 0, stream>>>(reinterpret_cast<int*>(kUnmappedAddress));
  return cudaGetLastError();
}

}  // namespace epx::fault
