#include <cuda.h>

#include "core/device_guard.hpp"
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

// ---- DeviceGuard (core/device_guard.hpp) -------------------------------------------------------

namespace epx {

bool has_primary_context(int device) {
  // cuDevicePrimaryCtxGetState through the runtime (nothing links libcuda).
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const GetState get_state = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &p, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &p, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return GetState(nullptr);
    }
    return reinterpret_cast<GetState>(p);
  }();
  if (get_state == nullptr) return false;
  unsigned int flags = 0;
  int active = 0;
  // A CUdevice is the ordinal of the process's visible devices.
  return get_state(CUdevice(device), &flags, &active) == CUDA_SUCCESS && active != 0;
}

DeviceGuard::DeviceGuard() {
  if (cudaGetDevice(&original_) != cudaSuccess) {
    (void)cudaGetLastError();
    original_ = -1;
  }
}

DeviceGuard::DeviceGuard(int device) : DeviceGuard() { set(device); }

void DeviceGuard::set(int device) { EPX_CUDA_CHECK(cudaSetDevice(device)); }

DeviceGuard::~DeviceGuard() {
  if (original_ < 0) return;
  int now = -1;
  if (cudaGetDevice(&now) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (now == original_ || !has_primary_context(original_)) return;
  if (cudaSetDevice(original_) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace epx
