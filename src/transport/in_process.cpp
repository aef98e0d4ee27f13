#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/device_guard.hpp"
#include "core/env.hpp"
#include "epx/cuda_check.hpp"
#include "epx/config.hpp"
#include "epx/world.hpp"
#include "transport/peer_links.hpp"

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
  // Peer access and native peer atomics between every pair of distinct devices of the world
  // (transport/peer_links.hpp), then peer access enabled; the caller's device is kept.
  {
    std::vector<std::string> gpu_of_rank, label_of_rank;
    std::vector<int> ordinal_of_rank;
    for (int r = 0; r < num_ranks_; ++r) {
      const int d = device_of(r);
      gpu_of_rank.push_back(std::to_string(d));
      label_of_rank.push_back("GPU " + std::to_string(d));
      ordinal_of_rank.push_back(d);
    }
    transport::require_peer_links(
        {transport::link_report(gpu_of_rank, ordinal_of_rank, transport::peer_link_query())},
        label_of_rank, "InProcessWorld");
  }
  DeviceGuard guard;
  for (size_t i = 0; i < devices_.size(); ++i) {
    for (size_t j = 0; j < devices_.size(); ++j) {
      if (devices_[i] == devices_[j]) continue;
      guard.set(devices_[i]);
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
