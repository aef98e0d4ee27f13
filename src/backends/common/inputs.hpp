#pragma once
// Argument checks that every backend makes alike (implemented in src/backends/all2all.cpp).

#include "epx/all2all.hpp"

namespace epx {

// InputError unless `in` routes by top-k ids (rank_mask and expert_counts null): what every
// backend but high_throughput serves.
void check_routing_by_ids(const DispatchInput& in, Backend backend);

}  // namespace epx
