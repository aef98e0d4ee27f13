#pragma once
#include <memory>
#include <vector>

#include "epx/all2all.hpp"

namespace epx {
class InProcessWorld;
class IpcWorld;
class NcclWorld;
namespace low_latency {
std::vector<std::unique_ptr<All2All>> make_group(const EpConfig& cfg, const InProcessWorld& world,
                                                 const LaunchConfigs& launch);
// This process's rank of an IpcWorld; collective over the world (peer::make_ipc_rank).
std::unique_ptr<All2All> make_rank(const EpConfig& cfg, IpcWorld& world, const LaunchConfigs& launch);
std::unique_ptr<All2All> make_rank(const EpConfig& cfg, NcclWorld& world, const LaunchConfigs& launch);
size_t buffer_bytes(const EpConfig& cfg);
}  // namespace low_latency
}  // namespace epx
