#pragma once
// The collective engine: the baselines naive and allgather_reducescatter over NCCL's host
// collectives on the caller's stream (coll_kernels.hpp), for an NcclWorld whose ranks span
// several nodes, where peer memory does not reach every rank (docs/scale-out.md §2).
// Where it differs from the one-node engines:
//   * a send half enqueues an NCCL collective, which waits on the device for every peer: work
//     on the same stream between the halves does not overlap with it (the receive half waits
//     for the send half's end, on any stream);
//   * NCCL's collectives have no bound of their own: a host watchdog gives each eager one
//     EpConfig::timeout_ms from the moment the stream reaches it, then aborts the world's
//     communicator and records a TimeoutError (poll(), synchronize(); the world is done). A
//     collective replayed from a CUDA graph is not watched;
//   * memory: naive holds every rank's blocks of partials, world_size^2 * max_tokens_per_rank
//     rows of hidden bf16 (the all-gather it stands for).

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
