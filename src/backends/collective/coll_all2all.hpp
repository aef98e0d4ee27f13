#pragma once
// The collective engine: the baselines naive and allgather_reducescatter over NCCL's host
// collectives on the caller's stream (coll_kernels.hpp), for an NcclWorld whose ranks span
// several nodes, where peer memory does not reach every rank (docs/scale-out.md §2).

#include <memory>

#include "epx/all2all.hpp"

namespace epx {
class NcclWorld;
namespace coll {
// Collective over the world's ranks, as peer::make_nccl_rank: the fingerprints are compared first.
// `backend`: naive or allgather_reducescatter.
std::unique_ptr<All2All> make_nccl_rank(Backend backend, const EpConfig& cfg, NcclWorld& world);
}  // namespace coll
}  // namespace epx
