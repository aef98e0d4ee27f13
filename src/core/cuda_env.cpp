#include "epx/cuda_check.hpp"

namespace epx {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

void require_gpu(const char* what) {
  if (cuda_device_count() == 0) {
    EPX_THROW(UnsupportedError, std::string(what) +
                                    " needs an NVIDIA GPU (sm_90, Hopper), and this machine has "
                                    "none visible to the CUDA driver");
  }
}

}  // namespace epx
