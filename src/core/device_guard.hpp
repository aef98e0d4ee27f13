#pragma once
// DeviceGuard: every place where epx makes another GPU current restores the caller's one on the
// way out (normal or by exception), so that a caller's next allocation — a PyTorch tensor, a
// cudaMalloc — lands on the GPU it chose, not on the last GPU epx touched.
//
// The caller's device is restored only when it differs from the current one and already has a
// CUDA context: making a device without one current would create a context there (hundreds of
// MiB on that GPU) for a device the caller has never used. In that case the caller had not
// used CUDA on it, and epx's device stays current.

namespace epx {

class DeviceGuard {
 public:
  // Remembers the calling thread's current device.
  DeviceGuard();
  // Remembers it, then makes `device` current (CudaError when that fails).
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // Makes `device` current (CudaError when that fails); the destructor still restores the
  // device current at construction.
  void set(int device);
  int original() const { return original_; }

 private:
  int original_ = -1;  // -1: cudaGetDevice failed, nothing to restore
};

// Whether `device` (an ordinal of this process) has an active primary context; false when the
// driver cannot tell.
bool has_primary_context(int device);

}  // namespace epx
