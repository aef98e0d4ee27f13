#pragma once
// The host side shared by the backends whose kernels write into and read from peers' buffers
// directly (low_latency, allgather_reducescatter, naive): one object per rank over a
// SymmetricBuffer, configured by an Algorithm.

#include <memory>
#include <vector>

#include "backends/common/layout.hpp"
#include "epx/all2all.hpp"

namespace epx {
class InProcessWorld;
namespace peer {
std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& cfg,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch,
                                                            const Algorithm& algo);
size_t buffer_bytes(const EpConfig& cfg, const Algorithm& algo);
}  // namespace peer
}  // namespace epx
