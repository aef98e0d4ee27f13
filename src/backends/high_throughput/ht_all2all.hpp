#pragma once
// The high_throughput backend (ring-buffered, for prefill-sized calls): one object per rank over
// a SymmetricBuffer whose size does not depend on the token count.

#include <memory>
#include <span>
#include <vector>

#include "backends/high_throughput/ht_layout.hpp"
#include "epx/all2all.hpp"

namespace epx {
class InProcessWorld;
class IpcWorld;
class NcclWorld;
namespace ht {
std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& cfg,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch);
// Collective over the world's ranks, as peer::make_ipc_rank; the fingerprint also covers the
// ring geometry (channels, ring rows), which every rank's buffer must share.
std::unique_ptr<All2All> make_ipc_rank(const EpConfig& cfg, IpcWorld& world,
                                       const LaunchConfigs& launch);
std::unique_ptr<All2All> make_nccl_rank(const EpConfig& cfg, NcclWorld& world,
                                        const LaunchConfigs& launch);
// Device memory of one rank with the default launch shape of a rank with 16 blocks: the rings
// and the per-token state, plus (worst_case_output) the received rows' areas.
size_t buffer_bytes(const EpConfig& cfg);
// Whether `a` is a rank of this backend (group launches dispatch on it).
bool is_rank(const All2All* a);
std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream);
void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream);
}  // namespace ht
}  // namespace epx
