#include <string>

#include "backends/allgather_reducescatter/allgather_reducescatter.hpp"
#include "backends/low_latency/low_latency.hpp"
#include "backends/naive/naive.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"

namespace epx {

namespace {

const peer::Algorithm& algorithm_of(Backend backend) {
  switch (backend) {
    case Backend::kLowLatency: return low_latency::algorithm();
    case Backend::kNaive: return naive::algorithm();
    case Backend::kAllgatherReduceScatter: return allgather_reducescatter::algorithm();
  }
  EPX_THROW(ConfigError, "backend = " + std::to_string(int(backend)) + ", expected one of naive, "
                         "allgather_reducescatter, low_latency");
}

}  // namespace

std::vector<std::unique_ptr<All2All>> make_all2all_group(Backend backend, EpConfig cfg,
                                                         const InProcessWorld& world,
                                                         LaunchConfigs launch) {
  return peer::make_in_process_group(cfg, world, launch, algorithm_of(backend));
}

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, IpcWorld& world,
                                      LaunchConfigs launch) {
  return peer::make_ipc_rank(cfg, world, launch, algorithm_of(backend));
}

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, NcclWorld& world,
                                      LaunchConfigs launch) {
  return peer::make_nccl_rank(cfg, world, launch, algorithm_of(backend));
}

size_t buffer_bytes(Backend backend, const EpConfig& cfg) {
  return peer::buffer_bytes(cfg, algorithm_of(backend));
}

size_t low_latency_buffer_bytes(const EpConfig& cfg) {
  return peer::buffer_bytes(cfg, low_latency::algorithm());
}

}  // namespace epx
