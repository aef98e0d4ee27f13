// naive: every rank broadcasts every token (with ids and weights) to every rank; combine is an
// all-reduce of all rows' partials (reduce-scatter + all-gather over the peers' buffers), after
// which each rank takes its own tokens' rows. The yardstick of vLLM's naive all2all backend.
#include "backends/naive/naive.hpp"

#include "backends/common/peer_all2all.hpp"

namespace epx::naive {

const peer::Algorithm kAlgorithm{Backend::kNaive, /*every_rank=*/true, /*all_reduce=*/true};

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

}  // namespace epx::naive
