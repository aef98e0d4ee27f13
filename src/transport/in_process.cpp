#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "epx/cuda_check.hpp"
#include "core/env.hpp"
#include "epx/config.hpp"
#include "epx/world.hpp"

namespace epx {

InProcessWorld::InProcessWorld(int num_ranks, std::vector<int> devices)
    : num_ranks_(num_ranks), devices_(std::move(devices)) {
  require_gpu("an in-process world");
  EPX_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, InputError, "num_ranks", num_ranks,
            "1.." + std::to_string(kMaxRanks));
  if (devices_.empty()) devices_.push_back(0);
  const int count = cuda_device_count();
  EPX_CHECK(int(devices_.size()) <= num_ranks, InputError, "devices.size()", devices_.size(),
            "at most num_ranks = " + std::to_string(num_ranks));
  for (int d : devices_) {
    EPX_CHECK(d >= 0 && d < count, InputError, "device", d,
              "0.." + std::to_string(count - 1) + " (visible GPUs)");
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
    sms_.push_back(prop.multiProcessorCount);
  }
  const int queues = env::hardware_queues_per_gpu();
  for (int d : devices_) {
    const int n = ranks_on_device(d);
    if (n > queues) {
      EPX_THROW(ConfigError,
                fmt::format("{} ranks on GPU {}, expected at most CUDA_DEVICE_MAX_CONNECTIONS = {} "
                            "(one hardware work queue per rank; set CUDA_DEVICE_MAX_CONNECTIONS={} "
                            "or more, up to 32, before the process's first CUDA call)",
                            n, d, queues, std::min(32, n)));
    }
  }
  // Peer access between every pair of distinct devices used by the world.
  for (size_t i = 0; i < devices_.size(); ++i) {
    for (size_t j = 0; j < devices_.size(); ++j) {
      if (devices_[i] == devices_[j]) continue;
      int can = 0;
      EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, devices_[i], devices_[j]));
      if (!can) {
        EPX_THROW(UnsupportedError, "GPU " + std::to_string(devices_[i]) + " cannot access GPU " +
                                        std::to_string(devices_[j]) +
                                        " (no peer access): an in-process world needs it");
      }
      EPX_CUDA_CHECK(cudaSetDevice(devices_[i]));
      const cudaError_t e = cudaDeviceEnablePeerAccess(devices_[j], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        EPX_CUDA_CHECK(e);
      }
    }
  }
}

int InProcessWorld::device_of(int rank) const {
  EPX_CHECK(rank >= 0 && rank < num_ranks_, InputError, "rank", rank,
            "0.." + std::to_string(num_ranks_ - 1));
  return devices_[rank % devices_.size()];
}

int InProcessWorld::ranks_on_device(int device) const {
  int n = 0;
  for (int r = 0; r < num_ranks_; ++r) n += device_of(r) == device;
  return n;
}

int InProcessWorld::num_sms(int rank) const {
  return sms_[rank % devices_.size()];
}

int InProcessWorld::sm_budget(int rank) const {
  return std::max(1, num_sms(rank) / ranks_on_device(device_of(rank)));
}

}  // namespace epx
