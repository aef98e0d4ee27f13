#pragma once
// The allgather_reducescatter backend: its algorithm over the shared peer kernels (src/backends/peer), built for
// every world by src/backends/all2all.cpp.
#include "backends/peer/peer_all2all.hpp"

namespace epx::allgather_reducescatter {
const peer::Algorithm& algorithm();
}  // namespace epx::allgather_reducescatter
