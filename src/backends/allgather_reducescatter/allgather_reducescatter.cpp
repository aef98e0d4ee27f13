// allgather_reducescatter: dispatch all-gathers every token (with ids and weights) to every
// rank; combine is a reduce-scatter: each rank pulls its own tokens' rows from every rank and sums
// them in rank order. The yardstick of vLLM's allgather_reducescatter all2all backend.
#include "backends/allgather_reducescatter/allgather_reducescatter.hpp"

#include "backends/common/peer_all2all.hpp"

namespace epx::allgather_reducescatter {

const peer::Algorithm kAlgorithm{Backend::kAllgatherReduceScatter, /*every_rank=*/true, /*all_reduce=*/false};

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

}  // namespace epx::allgather_reducescatter
