#pragma once
#include <memory>

#include "epx/all2all.hpp"
#include "epx/symmetric.hpp"

namespace epx {
class InProcessWorld;
namespace ll {
// The low_latency backend: one object per rank over a SymmetricBuffer.
std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& cfg,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch);
}  // namespace ll
}  // namespace epx
