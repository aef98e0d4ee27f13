#pragma once
// The host side shared by the backends whose kernels write into and read from peers' buffers
// directly (low_latency, allgather_reducescatter, naive): one object per rank over a
// SymmetricBuffer, configured by an Algorithm.

#include <memory>
#include <span>
#include <vector>

#include "backends/peer/layout.hpp"
#include "epx/all2all.hpp"

namespace epx {
class InProcessWorld;
class IpcWorld;
class NcclWorld;
namespace peer {
std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& cfg,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch,
                                                            const Algorithm& algo);
// This process's rank of an IpcWorld (collective over the world's ranks): rank and world size
// from the world, the same checks as make_in_process_group, then every rank's fingerprint is
// compared (ConfigError on every rank when they differ) before anything is allocated.
std::unique_ptr<All2All> make_ipc_rank(const EpConfig& cfg, IpcWorld& world,
                                       const LaunchConfigs& launch, const Algorithm& algo);
// The same over an NcclWorld (symmetric memory from NCCL windows).
std::unique_ptr<All2All> make_nccl_rank(const EpConfig& cfg, NcclWorld& world,
                                        const LaunchConfigs& launch, const Algorithm& algo);
size_t buffer_bytes(const EpConfig& cfg, const Algorithm& algo);
// One launch serving several ranks of an in-process group (epx::dispatch_group / combine_group).
std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream);
void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream);
}  // namespace peer
}  // namespace epx
