#pragma once
// Argument checks that every backend makes alike (implemented in src/backends/all2all.cpp).

#include "epx/all2all.hpp"

namespace epx {

// InputError unless `in` routes by top-k ids (rank_mask and expert_counts null): what every
// backend but high_throughput serves.
void check_routing_by_ids(const DispatchInput& in, Backend backend);

// StateError unless `stream` is not capturing: high_throughput without worst_case_output reads
// the round's counts back on the host during dispatch, which a CUDA graph cannot hold.
void check_not_capturing_counts(cudaStream_t stream);

}  // namespace epx
