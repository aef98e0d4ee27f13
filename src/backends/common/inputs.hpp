#pragma once
// Argument checks that every backend makes alike (implemented in src/backends/all2all.cpp).

#include "epx/all2all.hpp"

namespace epx {

class RankStatus;

// InputError unless `in` routes by top-k ids (rank_mask and expert_counts null): what every
// backend but high_throughput serves.
void check_routing_by_ids(const DispatchInput& in, Backend backend);

// high_throughput's routing: by top-k ids, or by a rank mask with the caller's expert counts
// (never both; not with the highest-slot order), each pointer on this rank's GPU and aligned
// (the per-token ones only when the round has tokens). InputError naming the argument otherwise.
void check_high_throughput_routing(const RankStatus& status, const DispatchInput& in,
                                   const EpConfig& cfg);

// StateError unless `stream` is not capturing: high_throughput without worst_case_output reads
// the round's counts back on the host during dispatch, which a CUDA graph cannot hold.
void check_not_capturing_counts(cudaStream_t stream);

// high_throughput's combine extras: the top-k weights and their output set together, each
// pointer on this rank's GPU and aligned (those written per token only where the rank has
// tokens). InputError naming the argument otherwise.
void check_combine_extras(const RankStatus& status, const CombineExtras& extras, int tokens);

}  // namespace epx
