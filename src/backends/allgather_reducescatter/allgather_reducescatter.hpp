#pragma once
// The allgather_reducescatter backend: its algorithm over the shared peer kernels (src/backends/common), built for
// every world by src/backends/all2all.cpp.
#include "backends/common/peer_all2all.hpp"

namespace epx::allgather_reducescatter {
const peer::Algorithm& algorithm();
}  // namespace epx::allgather_reducescatter
