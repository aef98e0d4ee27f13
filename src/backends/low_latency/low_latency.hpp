#pragma once
// The low_latency backend: its algorithm over the shared peer kernels (src/backends/peer), built for
// every world by src/backends/all2all.cpp.
#include "backends/peer/peer_all2all.hpp"

namespace epx::low_latency {
const peer::Algorithm& algorithm();
}  // namespace epx::low_latency
