// low_latency: each token goes once to each rank that holds one of its experts (deduplicated
// per rank), written straight into the peer's receive area; combine pulls the partials of the
// ranks that got the token and sums them in rank order.
#include "backends/low_latency/low_latency.hpp"

#include "backends/common/peer_all2all.hpp"

namespace epx::low_latency {

const peer::Algorithm kAlgorithm{Backend::kLowLatency, /*every_rank=*/false, /*all_reduce=*/false};

std::vector<std::unique_ptr<All2All>> make_group(const EpConfig& cfg, const InProcessWorld& world,
                                                 const LaunchConfigs& launch) {
  return peer::make_in_process_group(cfg, world, launch, kAlgorithm);
}

std::unique_ptr<All2All> make_rank(const EpConfig& cfg, IpcWorld& world, const LaunchConfigs& launch) {
  return peer::make_ipc_rank(cfg, world, launch, kAlgorithm);
}

std::unique_ptr<All2All> make_rank(const EpConfig& cfg, NcclWorld& world, const LaunchConfigs& launch) {
  return peer::make_nccl_rank(cfg, world, launch, kAlgorithm);
}

size_t buffer_bytes(const EpConfig& cfg) { return peer::buffer_bytes(cfg, kAlgorithm); }

}  // namespace epx::low_latency
