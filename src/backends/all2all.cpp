#include <string>

#include "backends/allgather_reducescatter/allgather_reducescatter.hpp"
#include "backends/low_latency/low_latency.hpp"
#include "backends/naive/naive.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"

namespace epx {

std::vector<std::unique_ptr<All2All>> make_all2all_group(Backend backend, EpConfig cfg,
                                                         const InProcessWorld& world,
                                                         LaunchConfigs launch) {
  switch (backend) {
    case Backend::kLowLatency: return low_latency::make_group(cfg, world, launch);
    case Backend::kNaive: return naive::make_group(cfg, world, launch);
    case Backend::kAllgatherReduceScatter:
      return allgather_reducescatter::make_group(cfg, world, launch);
  }
  EPX_THROW(ConfigError, "backend = " + std::to_string(int(backend)) + ", expected one of naive, "
                         "allgather_reducescatter, low_latency");
}

namespace {

// One process per rank (IpcWorld, NcclWorld): every backend has a make_rank for each.
template <typename World>
std::unique_ptr<All2All> make_process_rank(Backend backend, const EpConfig& cfg, World& world,
                                           const LaunchConfigs& launch) {
  switch (backend) {
    case Backend::kLowLatency: return low_latency::make_rank(cfg, world, launch);
    case Backend::kNaive: return naive::make_rank(cfg, world, launch);
    case Backend::kAllgatherReduceScatter:
      return allgather_reducescatter::make_rank(cfg, world, launch);
  }
  EPX_THROW(ConfigError, "backend = " + std::to_string(int(backend)) + ", expected one of naive, "
                         "allgather_reducescatter, low_latency");
}

}  // namespace

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, IpcWorld& world,
                                      LaunchConfigs launch) {
  return make_process_rank(backend, cfg, world, launch);
}

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, NcclWorld& world,
                                      LaunchConfigs launch) {
  return make_process_rank(backend, cfg, world, launch);
}

size_t buffer_bytes(Backend backend, const EpConfig& cfg) {
  switch (backend) {
    case Backend::kLowLatency: return low_latency::buffer_bytes(cfg);
    case Backend::kNaive: return naive::buffer_bytes(cfg);
    case Backend::kAllgatherReduceScatter: return allgather_reducescatter::buffer_bytes(cfg);
  }
  return 0;
}

size_t low_latency_buffer_bytes(const EpConfig& cfg) { return low_latency::buffer_bytes(cfg); }

}  // namespace epx
